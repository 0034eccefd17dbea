#!/bin/sh
# Inside the aarch64 guest of tests/guest_aarch64.rs, a GB200 compute tray at small scale: Grace
# nodes 0 (CPUs 0-1) and 1 (CPUs 2-3), the GPU's memory as node 10 (memory, no CPU), and QEMU's
# pci-testdev at 0000:00:02.0 on node 1 (the device tree's PCI host bridge), which the NVML test
# double names GPU 0 with node 1's CPUs as its CPU affinity and node 10 as its memory's node
# (nvmlDeviceGetNumaNodeId). Arguments (aarch64 builds): the
# preload library, the CLI, the double's directory, numa_placement, memory_follows.
lib=$1 cli=$2 nvml_dir=$3 placement=$4 follows=$5
. "$(dirname "$0")/scenario.sh"
work=$(mktemp -d)
scenario guest identity
node=/sys/devices/system/node
scenario nodes sh -c 'node=$0
  echo "arch=$(uname -m)"
  echo "online=$(cat $node/online)"
  echo "has_cpu=$(cat $node/has_cpu)"
  echo "has_memory=$(cat $node/has_memory)"
  for n in 0 1 10; do echo "node${n}_cpus=$(cat $node/node$n/cpulist)"; done
  echo "node10_memory_kib=$(sed -n "s/.*MemTotal: *\([0-9]*\) kB/\1/p" $node/node10/meminfo)"
  echo "node1_distance=$(cat $node/node1/distance)"
  echo "siblings=$(cat /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list | tr "\n" " ")"' "$node"
scenario pci cat /sys/bus/pci/devices/0000:00:02.0/numa_node /sys/bus/pci/devices/0000:00:02.0/local_cpulist
# NVML as on a tray: CPU affinity the Grace node's CPUs, the GPU's NUMA node id its memory node.
echo "gpu 00000000:00:02.0 GPU-00020002-0000-1111-2222-333344445555 2-3 10" >"$work/nvml"
export LD_LIBRARY_PATH="$nvml_dir" TLLM_NVML_DOUBLE="$work/nvml"
# Workers and their children on node 1's CPUs, host threads on all four, release restores; the
# scope's caller's memory preference; pages first touched by workers.
scenario placement env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 0
# A dedicated worker (configure on its main thread) that touched 64 MiB on node 0 and bound
# 16 MiB to the GPU's memory node; then a shared process (configure on another thread).
scenario dedicated env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info MF_GPU_NODE=10 "$follows" main 0
scenario shared env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$follows" thread 0
scenario topo "$cli" topo --json
scenario plan "$cli" plan --gpu 0 --json
