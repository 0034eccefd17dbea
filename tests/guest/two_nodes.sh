#!/bin/sh
# Inside the guest of tests/guest.rs: two NUMA nodes of two CPUs each (0-1, 2-3), QEMU's
# pci-testdev at 0000:81:00.0 behind a root bridge on node 1, which the NVML test double names
# GPU 0. Arguments: the preload library, the CLI, the double's directory, numa_placement.
lib=$1 cli=$2 nvml_dir=$3 placement=$4
. "$(dirname "$0")/scenario.sh"
scenario guest identity
work=$(mktemp -d)
echo "gpu 00000000:81:00.0 GPU-81818181-0000-1111-2222-333344445555 -" >"$work/nvml"
export LD_LIBRARY_PATH="$nvml_dir" TLLM_NVML_DOUBLE="$work/nvml"
scenario pci sh -c 'cat /sys/bus/pci/devices/0000:81:00.0/numa_node /sys/bus/pci/devices/0000:81:00.0/local_cpulist'

scenario meminfo sh -c 'grep -h MemFree /sys/devices/system/node/node*/meminfo'
# The worker and its children on node 1, host threads on all four, memory first touched by
# workers on node 1, release restores.
scenario placement env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 0
# Twice more, for the memory that lands wherever the scheduler ran a host thread (measured).
scenario placement_2 env LD_PRELOAD="$lib" "$placement" 0
scenario placement_3 env LD_PRELOAD="$lib" "$placement" 0
scenario topo "$cli" topo --json
scenario plan "$cli" plan --gpu 0 --json

# A cgroup v2 cpuset narrower than the machine (1-3): not a constraint; taskset inside it is.
mkdir /sys/fs/cgroup/narrow
echo +cpuset >/sys/fs/cgroup/cgroup.subtree_control
echo 1-3 >/sys/fs/cgroup/narrow/cpuset.cpus
scenario cpuset sh -c '
  echo $$ >/sys/fs/cgroup/narrow/cgroup.procs || exit 90
  exec env LD_PRELOAD="$0" TLLM_AFFINITY_LOG=info "$1" 0' "$lib" "$placement"
scenario cpuset_taskset sh -c '
  echo $$ >/sys/fs/cgroup/narrow/cgroup.procs || exit 90
  exec taskset -c 1-2 env LD_PRELOAD="$0" TLLM_AFFINITY_LOG=info "$1" 0' "$lib" "$placement"
scenario cpuset_plan sh -c '
  echo $$ >/sys/fs/cgroup/narrow/cgroup.procs || exit 90
  exec "$0" plan --gpu 0 --json' "$cli"
