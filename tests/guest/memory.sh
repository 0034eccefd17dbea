#!/bin/sh
# Inside the guest of tests/guests/guest.rs: two NUMA nodes of two CPUs each (0-1, 2-3) and a
# pci-testdev on each: 0000:41:00.0 on node 0 (GPU 0) and 0000:81:00.0 on node 1 (GPU 1), named
# GPUs by the NVML test double and by a driver list of the same two (what a dedicated worker
# configured at load reads, where NVML must not be loaded). Arguments: the preload library, the
# CLI, the double's directory, memory_follows, then the Python and the test programs' directory.
lib=$1 cli=$2 nvml_dir=$3 follows=$4 python=$5 programs=$6
here=$(dirname "$0")
. "$here/scenario.sh"
. "$here/two_devices.sh"

run() { env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$@"; }
# A dedicated worker: TLLM_AFFINITY_PROCESS_ROLE=worker on GPU 0 (node 0) at load, then the
# program points CUDA_VISIBLE_DEVICES at GPU 1 (node 1); configure on the main thread.
scenario role_retarget run TLLM_AFFINITY_PROCESS_ROLE=worker CUDA_VISIBLE_DEVICES=0 "$follows" setenv 1
scenario main_configure run "$follows" main 1
# What stays: a worker thread of a shared process, TLLM_AFFINITY_MOVE_MEMORY=0, a policy of the
# process's own (numactl), and the mlock'd half.
scenario thread_configure run "$follows" thread 1
scenario move_off run TLLM_AFFINITY_MOVE_MEMORY=0 "$follows" main 1
scenario membind numactl --membind=0 env MF_NO_BIND=1 LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$follows" main 1
scenario preferred numactl --preferred=0 env MF_NO_BIND=1 LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$follows" main 1
scenario mlock run MF_LOCK=1 "$follows" main 1
# Children a worker scope's caller starts (subprocess, posix_spawn, a bare fork, a dedicated
# worker on node 0's CPUs that touches its memory, then configures for GPU 1) start clean.
scenario children run "$python" "$programs/memory_children.py" 1 \
  "taskset -c 0-1 env MF_NO_BIND=1 TLLM_NUMA_AWARE_WORKER_AFFINITY=1 $follows main 1"
# Upstream's entry functions under `tllm-affinity run`, nothing else. under_run NAME COMMAND...
under_run() {
  name=$1
  shift
  scenario "$name" env PYTHONPATH="$programs/upstream_trtllm:$programs" TLLM_LOG_LEVEL=info \
    "$cli" run --log info -- "$@"
}
# VisualGen's on the main thread of its own process (dedicated), then on a thread of a process
# that goes on serving.
visualgen() { under_run "$1" "$python" "$programs/memory_follows_visualgen.py" "$2" 1; }
visualgen visualgen_main main
visualgen visualgen_thread thread
# An MPI worker rank's worker_main on its main thread, the rank started by the real mpirun with
# the GPU on node 1 as its one visible GPU (-x: how a launcher hands a rank its device).
under_run worker_main_rank mpirun -np 1 --bind-to none --allow-run-as-root \
  -x CUDA_VISIBLE_DEVICES=1 "$python" "$programs/memory_follows_worker_main.py"
# What runs beside the move (tests/guests/guest.rs, issue of the move's safety): a thread allocating and
# a thread forking while it runs; an 8 MiB shmem object shared with a child that set its own
# policy on half of it; transparent huge pages (`always`) in a buffer 1 MiB past a huge page
# boundary, which NUMA balancing has had 3 s of the program's run time to mark; a budget smaller than the buffer, of huge pages and of base pages; and a target
# node another process has nearly filled (it holds node 1 down to 160 MiB free: 32 MiB above
# the headroom of a 1 GiB node).
scenario window run MF_WATCH=1 "$follows" main 1
# Nine more runs of the forking thread beside the move: a fork child maps every private page
# for an instant, and the move must not give up on them. The forking thread alone: the
# allocating one fills node 1 when a run is slow (two of ten stopped at its headroom).
for i in 2 3 4 5 6 7 8 9 10; do
  scenario window_$i run MF_WATCH=fork "$follows" main 1
done
scenario shared_shm run MF_SHM=1 "$follows" main 1
thp=/sys/kernel/mm/transparent_hugepage
thp_was=$(sed 's/.*\[\(.*\)\].*/\1/' $thp/enabled)
echo always >$thp/enabled
scenario thp run MF_THP=1 MF_MIB=68 MF_RUN_MS=3000 "$follows" main 1
scenario budget_huge run MF_THP=1 TLLM_AFFINITY_MOVE_MEMORY=16M "$follows" main 1
# The kernel's own default here is `always` (Debian's): a buffer then gets huge pages or not as
# free blocks allow, so the base-page budget runs with none.
echo never >$thp/enabled
scenario budget run TLLM_AFFINITY_MOVE_MEMORY=16M "$follows" main 1
# Long-term pinned pages (io_uring fixed buffers) through a 256 MiB buffer, one in every MiB and
# one in every 8 MiB, under a 64 MiB budget and the default: what moved, counted exactly.
for every in 1024 8192; do
  scenario pinned_${every}k_budget run MF_MIB=256 MF_PIN_EVERY_KIB=$every \
    TLLM_AFFINITY_MOVE_MEMORY=64M "$follows" main 1
  scenario pinned_${every}k run MF_MIB=256 MF_PIN_EVERY_KIB=$every "$follows" main 1
done
echo "$thp_was" >$thp/enabled
# As root (CAP_SYS_NICE, which lets migrate_pages move pages other processes map): a file whose
# page cache is on node 0, mapped MAP_PRIVATE by another process and by the worker, beside a
# PROT_NONE region of the worker's.
shared_file=/dev/shm/memory_follows_shared
numactl --membind=0 dd if=/dev/zero of=$shared_file bs=1M count=8 status=none
mapped=$(mktemp)
"$follows" mapfile $shared_file >"$mapped" 2>&1 &
mapper=$!
for _ in $(seq 600); do grep -q MAPPED "$mapped" && break; sleep 0.1; done
scenario file_shared run MF_FILE=$shared_file MF_PROT_NONE=1 "$follows" main 1
kill $mapper
wait $mapper 2>/dev/null
emit mapper "$mapped" /dev/null 0
rm -f "$mapped" $shared_file
held=$(mktemp)
"$follows" hold 1 160 >"$held" 2>&1 &
holder=$!
for _ in $(seq 600); do grep -q HELD "$held" && break; sleep 0.1; done
scenario node_full run "$follows" main 1
echo "alive=$(kill -0 $holder 2>/dev/null && echo 1 || echo 0)" >>"$held"
kill $holder
wait $holder 2>/dev/null
echo "oom_kills=$(dmesg | grep -c 'Killed process')" >>"$held"
emit holder "$held" /dev/null 0
rm -f "$held"
