#!/bin/sh
# Inside the guest of tests/guests/guest.rs with a device on each node (memory.sh's machine, booted
# apart): the move's cost, a dedicated worker's configure for GPU 1 (node 1) after it touched
# 64 MiB or 1 GiB on node 0, with the move and with TLLM_AFFINITY_MOVE_MEMORY=0, ROUNDS times
# each, alternating (the test takes the medians); for 1 GiB also numactl's `migratepages PID 0 1`
# on a process that touched as much on node 0 (the kernel's own tool, timed around its run), and,
# where AGAINST names another build of the library (scripts/bench --memory-move: the previous
# revision's), its move in the same rounds. This revision's moves log at debug: their line of
# where the move's time went (asking, moving, reading), which scripts/bench prints. Arguments:
# the preload library, the CLI, the double's directory, memory_follows, then ROUNDS (default 3)
# and AGAINST (optional).
lib=$1 cli=$2 nvml_dir=$3 follows=$4 rounds=${5:-3} against=$6
here=$(dirname "$0")
. "$here/scenario.sh"
. "$here/two_devices.sh"

run() { env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$@"; }
for mib in 64 1024; do
  for i in $(seq "$rounds"); do
    # At debug: the move's line of where its time went.
    scenario "bench_${mib}_moved_$i" run TLLM_AFFINITY_LOG=debug MF_MIB=$mib "$follows" main 1
    [ -z "$against" ] || scenario "bench_${mib}_against_$i" \
      env LD_PRELOAD="$against" TLLM_AFFINITY_LOG=info MF_MIB=$mib "$follows" main 1
    scenario "bench_${mib}_stays_$i" run MF_MIB=$mib TLLM_AFFINITY_MOVE_MEMORY=0 "$follows" main 1
    [ "$mib" = 1024 ] || continue
    go=$(mktemp -u) out=$(mktemp)
    MF_MIB=$mib "$follows" wait "$go" >"$out" 2>&1 &
    pid=$!
    for _ in $(seq 3000); do grep -q READY "$out" && break; sleep 0.1; done
    t0=$(date +%s%N)
    migratepages $pid 0 1
    t1=$(date +%s%N)
    touch "$go"
    wait $pid
    status=$?
    echo "MIGRATE_US $(((t1 - t0) / 1000))" >>"$out"
    emit "bench_${mib}_migratepages_$i" "$out" /dev/null $status
    rm -f "$go" "$out"
  done
done
