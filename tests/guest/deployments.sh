#!/bin/sh
# Inside the guest of tests/guests/guest.rs: the machine of two_nodes.sh (two nodes of two CPUs, 0-1 and
# 2-3, QEMU's pci-testdev at 0000:81:00.0 on node 1, named GPU 0 by the NVML test double), booted
# apart for the seed deployments so that each boot stays well inside its limit. Arguments: the
# preload library, the CLI, the double's directory, numa_placement (unused here), then the
# Python, the test programs' directory and the native libraries the apps load (OpenMP, NCCL and
# progress-thread stand-ins).
cli=$2 nvml_dir=$3 python=$5 programs=$6 omp=$7 nccl=$8 spawn=$9
here=$(dirname "$0")
. "$here/scenario.sh"
work=$(mktemp -d)
start_with_the_device_as_gpu0 "$nvml_dir" "$work"
# The seed deployments, unmodified, through `tllm-affinity run` (no --sysfs-root: the kernel's
# own sysfs, the device NVML names GPU 0 on node 1), driven phase by phase by drive.py.
deploy() {
  deploy_name=$1
  shift
  scenario "$deploy_name" env PYTHONPATH="$programs/upstream_trtllm:$programs" RT_OMP="$omp" \
    OMP_NUM_THREADS=3 OMP_WAIT_POLICY=passive TLLM_LOG_LEVEL=info "$python" "$here/drive.py" "$@"
}
run_app() { echo "$cli" run --log info -- "$python" "$programs/zero_code/$1"; }
deploy seed_tp1 --get 2:/generate/a --get 4:/generate/b -- \
  env TLLM_WORKER_USE_SINGLE_PROCESS=1 $(run_app tp1_http_server.py)
deploy seed_mpi_session -- $(run_app mpi_session_rank0.py)
deploy seed_visualgen --get 2:/generate/a --get 4:/generate/b -- \
  env TLLM_WORKER_USE_SINGLE_PROCESS=1 $(run_app visualgen_rank0.py)
deploy seed_leader -- env RT_NCCL="$nccl" RT_SPAWN="$spawn" $(run_app leader.py)
