#!/bin/sh
# Inside the aarch64 guest of tests/guests/guest_aarch64.rs, a GB200 compute tray at small scale: Grace
# nodes 0 (CPUs 0-1) and 1 (CPUs 2-3), placeholder nodes 3-9 (no CPUs, no memory), node 2 one
# more placeholder or GPU 1's memory (see below), node 10 the GPU's memory (memory, no CPU) in
# NUMA mode or one more placeholder in CDMM mode, and QEMU's pci-testdev at 0000:00:02.0 on node
# 1 (the device tree's PCI host bridge), which the NVML test double names GPU 0 with node 1's
# CPUs as its CPU affinity and, in NUMA mode, node 10 as its memory's node
# (nvmlDeviceGetNumaNodeId; in CDMM mode that query is not supported). Run on the 4 KiB-page
# kernel (NUMA mode), the 16 KiB-page one (CDMM mode) and the 64 KiB-page one (NUMA mode). The
# 4 KiB boot has a second pci-testdev, GPU 1, behind a second PCI host bridge on node 0 (CPUs
# 0-1), its memory node 2.
# Arguments (aarch64 builds): the preload library, the CLI, the double's directory,
# numa_placement, memory_follows; then the GPU's memory node, or "-" in CDMM mode; then GPU 1's
# PCI address and memory node, or "- -" without one.
lib=$1 cli=$2 nvml_dir=$3 placement=$4 follows=$5 gpu_memory_node=$6 second_gpu=$7
second_gpu_memory_node=$8
. "$(dirname "$0")/scenario.sh"
work=$(mktemp -d)
thp=/sys/kernel/mm/transparent_hugepage
# With 64 KiB pages a PMD huge page is 512 MiB, and NVIDIA's Grace kernels give huge pages only
# to memory that asks (`madvise`): so does this guest. (Under `always` every small buffer of
# numa_placement lies in a 512 MiB huge page, which NUMA balancing's scan hides from
# move_pages' query whole.) The THP scenarios below ask for `always` themselves.
[ "$(cat $thp/hpage_pmd_size)" != 536870912 ] || echo madvise >$thp/enabled
scenario guest identity
node=/sys/devices/system/node
scenario nodes sh -c 'node=$0
  echo "arch=$(uname -m)"
  echo "page_size=$(getconf PAGESIZE)"
  echo "hpage_pmd_kib=$(($(cat /sys/kernel/mm/transparent_hugepage/hpage_pmd_size) / 1024))"
  echo "online=$(cat $node/online)"
  echo "has_cpu=$(cat $node/has_cpu)"
  echo "has_memory=$(cat $node/has_memory)"
  for n in 0 1 10; do echo "node${n}_cpus=$(cat $node/node$n/cpulist)"; done
  for n in 2 10; do
    echo "node${n}_memory_kib=$(sed -n "s/.*MemTotal: *\([0-9]*\) kB/\1/p" $node/node$n/meminfo)"
  done
  echo "node1_distance=$(cat $node/node1/distance)"
  echo "siblings=$(cat /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list | tr "\n" " ")"' "$node"
scenario pci cat /sys/bus/pci/devices/0000:00:02.0/numa_node /sys/bus/pci/devices/0000:00:02.0/local_cpulist
# NVML as on a tray: CPU affinity the Grace node's CPUs, the GPU's NUMA node id its memory node
# ("-": NOT_SUPPORTED, as in CDMM mode).
echo "gpu 00000000:00:02.0 GPU-00020002-0000-1111-2222-333344445555 2-3 $gpu_memory_node" >"$work/nvml"
if [ "$second_gpu" != - ]; then
  scenario pci_second cat /sys/bus/pci/devices/$second_gpu/numa_node \
    /sys/bus/pci/devices/$second_gpu/local_cpulist
  # NVML writes the domain in 8 digits.
  echo "gpu 0000$second_gpu GPU-00010081-0000-1111-2222-333344445555 0-1 $second_gpu_memory_node" \
    >>"$work/nvml"
fi
export LD_LIBRARY_PATH="$nvml_dir" TLLM_NVML_DOUBLE="$work/nvml"
# Workers and their children on node 1's CPUs, host threads on all four, release restores; the
# scope's caller's memory preference; pages first touched by workers.
scenario placement env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 0
# The same for GPU 1, on the other Grace node.
[ "$second_gpu" = - ] ||
  scenario placement_gpu1 env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$placement" 1
# A dedicated worker (configure on its main thread) that touched 64 MiB on node 0 and, in NUMA
# mode, bound 16 MiB to the GPU's memory node; then a shared process (configure on another
# thread).
bound_to_gpu_memory=""
[ "$gpu_memory_node" = - ] || bound_to_gpu_memory="MF_GPU_NODE=$gpu_memory_node"
scenario dedicated env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info $bound_to_gpu_memory "$follows" main 0
scenario shared env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$follows" thread 0
# Transparent huge pages (`always`): a buffer half a huge page past a huge page boundary, moved
# by a dedicated worker's configure: 68 MiB with 2 MiB huge pages (as tests/guests/guest.rs's), three
# huge pages and 4 MiB with bigger ones (100 MiB with the 32 MiB of 16 KiB pages, 1540 MiB with
# the 512 MiB of 64 KiB pages).
thp_was=$(sed 's/.*\[\(.*\)\].*/\1/' $thp/enabled)
thp_mib=$(($(cat $thp/hpage_pmd_size) * 3 / 1048576 + 4))
[ $thp_mib -ge 68 ] || thp_mib=68
echo always >$thp/enabled
# Free blocks of a huge page's size on node 0 for the buffer: the page cache dropped and memory
# compacted first (at 64 KiB pages a huge page is a whole 512 MiB page block).
free_huge_blocks() { sync; echo 3 >/proc/sys/vm/drop_caches; echo 1 >/proc/sys/vm/compact_memory; }
free_huge_blocks
scenario thp env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info MF_THP=1 MF_MIB=$thp_mib "$follows" main 0
# NUMA balancing off, as NVIDIA recommends for Grace: the same moves, with no hinting fault to
# lean on. Then a budget of half a huge page (TLLM_AFFINITY_MOVE_MEMORY): no huge page fits it.
balancing=/proc/sys/kernel/numa_balancing
balancing_was=$(cat $balancing)
echo 0 >$balancing
scenario balancing_off cat $balancing
scenario dedicated_balancing_off env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info $bound_to_gpu_memory "$follows" main 0
free_huge_blocks
scenario thp_balancing_off env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info MF_THP=1 MF_MIB=$thp_mib "$follows" main 0
half_huge_kib=$(($(cat $thp/hpage_pmd_size) / 2048))
free_huge_blocks
scenario thp_budget env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info \
  TLLM_AFFINITY_MOVE_MEMORY=${half_huge_kib}K MF_THP=1 MF_MIB=$thp_mib "$follows" main 0
echo "$balancing_was" >$balancing
echo "$thp_was" >$thp/enabled
# `tllm-affinity ps` of a live configured process: its memory per node, from numa_maps.
held ps_numa_maps ""
scenario topo "$cli" topo --json
scenario topo_text "$cli" topo
scenario plan "$cli" plan --gpu 0 --json
[ "$second_gpu" = - ] || scenario plan_gpu1 "$cli" plan --gpu 1 --json
