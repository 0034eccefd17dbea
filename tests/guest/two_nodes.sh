#!/bin/sh
# Inside the guest of tests/guests/guest.rs: two NUMA nodes of two CPUs each (0-1, 2-3), QEMU's
# pci-testdev at 0000:81:00.0 behind a root bridge on node 1, which the NVML test double names
# GPU 0. Arguments: the preload library, the CLI, the double's directory, numa_placement.
lib=$1 cli=$2 nvml_dir=$3 placement=$4
here=$(dirname "$0")
. "$here/scenario.sh"
work=$(mktemp -d)
start_with_the_device_as_gpu0 "$nvml_dir" "$work"
scenario pci sh -c 'cat /sys/bus/pci/devices/0000:81:00.0/numa_node /sys/bus/pci/devices/0000:81:00.0/local_cpulist'

scenario meminfo sh -c 'grep -h MemFree /sys/devices/system/node/node*/meminfo'
# The worker and its children on node 1, host threads on all four, memory first touched by
# workers on node 1, release restores.
scenario placement env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 0
# Twice more, for the memory that lands wherever the scheduler ran a host thread (measured).
scenario placement_2 env LD_PRELOAD="$lib" "$placement" 0
scenario placement_3 env LD_PRELOAD="$lib" "$placement" 0
# A policy of the caller's own (numactl --membind) is left as it is during the scope.
scenario placement_membind numactl --membind=0 env LD_PRELOAD="$lib" "$placement" 0

# `tllm-affinity ps` of a live, configured process: its memory per node, from numa_maps (a
# process among others in the root cgroup) and from memory.numa_stat (alone in its cgroup).
held ps_numa_maps ""

# The host view (`tllm-affinity ps` with no PID) of a held process whose memory is bound to node 0
# (numactl --membind) while its workers are on node 1: its memory per node in its row, and the
# flag for memory mostly off its workers' node.
mkfifo "$work/host_view.go"
numactl --membind=0 env LD_PRELOAD="$lib" NUMA_PLACEMENT_HOLD="$work/host_view.go" "$placement" 0 \
  >"$work/host_view.out" 2>"$work/host_view.err" &
host_view_pid=$!
tries=0
while ! grep -q '^HOLD' "$work/host_view.out" && [ $tries -lt 600 ] && kill -0 $host_view_pid 2>/dev/null; do
  sleep 0.1; tries=$((tries + 1))
done
scenario host_view_pid echo $host_view_pid
scenario host_view_ps "$cli" ps --json
scenario host_view_text "$cli" ps --no-color
echo go >"$work/host_view.go"
wait $host_view_pid
emit host_view "$work/host_view.out" "$work/host_view.err" $?
echo +memory >/sys/fs/cgroup/cgroup.subtree_control
mkdir /sys/fs/cgroup/alone
held ps_numa_stat /sys/fs/cgroup/alone

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

