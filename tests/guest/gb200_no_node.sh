#!/bin/sh
# Inside the aarch64 guest of tests/guests/guest_aarch64.rs booted with QEMU's own device tree: the same
# nodes as gb200.sh, but the PCI host bridge has no NUMA node, so the GPU at 0000:00:02.0 has
# numa_node -1 (a DGX Spark's GPU is so) and NVML's CPU affinity (node 1's CPUs) is all that says
# where it is. Arguments: as gb200.sh.
lib=$1 cli=$2 nvml_dir=$3 placement=$4
. "$(dirname "$0")/scenario.sh"
work=$(mktemp -d)
scenario guest identity
scenario pci cat /sys/bus/pci/devices/0000:00:02.0/numa_node /sys/bus/pci/devices/0000:00:02.0/local_cpulist
echo "gpu 00000000:00:02.0 GPU-00020002-0000-1111-2222-333344445555 2-3" >"$work/nvml"
export LD_LIBRARY_PATH="$nvml_dir" TLLM_NVML_DOUBLE="$work/nvml"
scenario placement env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 0
scenario plan "$cli" plan --gpu 0 --json
