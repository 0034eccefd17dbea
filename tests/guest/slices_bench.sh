#!/bin/sh
# Inside the guest of tests/guests/guest.rs: eight CPUs (two NUMA nodes, 0-3 and 4-7, which the
# bench does not use: it writes its own host, one node over every CPU, each CPU a core, four GPUs
# on it). scripts/bench_slices.py runs four engines side by side, every worker on the whole node
# against each GPU's workers on its own slice of two CPUs, in interleaved rounds. Arguments: the
# preload library, the CLI, the NVML double's directory, the scenario program (unused), then the
# Python, the bench script, the engine's shared object and the rounds.
lib=$1 python=$5 bench=$6 engine=$7 rounds=$8
. "$(dirname "$0")/scenario.sh"
scenario guest identity
scenario bench "$python" "$bench" "$lib" "$engine" --rounds "$rounds"
