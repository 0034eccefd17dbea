#!/bin/sh
# Inside the guest of tests/guests/guest.rs: four NUMA nodes of one CPU each (SNC/NPS-like) and node 4
# with memory and no CPU (GB200-like), nearest to node 3. QEMU's pci-testdev at 0000:81:00.0
# behind a root bridge on node 4, and another at 0000:00:10.0 on the root bus, where the kernel
# knows no node (numa_node -1); the NVML test double names them GPU 0 and GPU 1. Arguments: the
# preload library, the CLI, the double's directory, numa_placement.
lib=$1 cli=$2 nvml_dir=$3 placement=$4
. "$(dirname "$0")/scenario.sh"
scenario guest identity
scenario nodes sh -c 'echo "has_cpu=$(cat /sys/devices/system/node/has_cpu)"
  echo "has_memory=$(cat /sys/devices/system/node/has_memory)"
  echo "node4_distance=$(cat /sys/devices/system/node/node4/distance)"'
scenario pci sh -c 'for d in 0000:81:00.0 0000:00:10.0; do
  echo "$d $(cat /sys/bus/pci/devices/$d/numa_node)"
done'
work=$(mktemp -d)
cat >"$work/nvml" <<NVML
gpu 00000000:00:10.0 GPU-00100010-0000-1111-2222-333344445555 -
gpu 00000000:81:00.0 GPU-81818181-0000-1111-2222-333344445555 -
NVML
export LD_LIBRARY_PATH="$nvml_dir" TLLM_NVML_DOUBLE="$work/nvml"
# NVML lists GPUs in PCI order: GPU 0 is 0000:00:10.0 (no node), GPU 1 0000:81:00.0 (node 4).
scenario placement_gpu0 env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 0
scenario placement_gpu1 env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 1
scenario topo "$cli" topo --json
scenario plan_gpu0 "$cli" plan --gpu 0 --json
scenario plan_gpu1 "$cli" plan --gpu 1 --json
