# Sourced by the guest scripts of tests/guests/guest.rs, which run inside the guest. Every line a
# scenario prints goes to the console as `<name>| <line>` (stdout) or `<name>! <line>` (stderr),
# then `<name>= <exit status>`, so the host test finds each scenario's output whatever ran
# around it.

# scenario NAME COMMAND [ARG...]
scenario() {
  name=$1
  shift
  out=$(mktemp) err=$(mktemp)
  "$@" >"$out" 2>"$err"
  emit "$name" "$out" "$err" $?
  rm -f "$out" "$err"
}

# emit NAME STDOUT_FILE STDERR_FILE STATUS: a scenario run otherwise (one the script talks to).
emit() {
  sed "s/^/$1| /" "$2"
  sed "s/^/$1! /" "$3"
  echo "$1= $4"
}

# What the host test checks first: this is the guest's kernel, with the nodes the topology
# asked for, read from the real /sys (no simulated root).
identity() {
  echo "uname=$(uname -r)"
  echo "nodes=$(cat /sys/devices/system/node/online)"
  echo "cpus=$(cat /sys/devices/system/cpu/online)"
  echo "sysfs_root=${TLLM_AFFINITY_SYSFS_ROOT-unset}"
  echo "cgroup=$(stat -fc %T /sys/fs/cgroup)"
}

# start_with_the_device_as_gpu0 NVML_DIR WORK: the identity scenario, then the NVML test double
# (from NVML_DIR) naming QEMU's pci-testdev at 0000:81:00.0 GPU 0, for every later scenario.
start_with_the_device_as_gpu0() {
  scenario guest identity
  echo "gpu 00000000:81:00.0 GPU-81818181-0000-1111-2222-333344445555 -" >"$2/nvml"
  export LD_LIBRARY_PATH="$1" TLLM_NVML_DOUBLE="$2/nvml"
}

# held NAME CGROUP: numa_placement ($placement, preloaded with $lib, for GPU 0) waits at HOLD
# while `tllm-affinity ps` ($cli) reads it from outside: scenarios NAME_ps, then NAME. CGROUP, if
# not empty, is the cgroup it runs alone in. Its files go to $work.
held() {
  # Names of their own: `scenario` sets name, out and err.
  held_name=$1 held_cgroup=$2
  held_fifo="$work/$1.go" held_out="$work/$1.out" held_err="$work/$1.err"
  mkfifo "$held_fifo"
  sh -c '[ -z "$3" ] || echo $$ >"$3/cgroup.procs" || exit 90
    exec env LD_PRELOAD="$0" NUMA_PLACEMENT_HOLD="$2" "$1" 0' "$lib" "$placement" "$held_fifo" \
    "$held_cgroup" >"$held_out" 2>"$held_err" &
  held_pid=$!
  tries=0
  while ! grep -q '^HOLD' "$held_out" && [ $tries -lt 600 ] && kill -0 $held_pid 2>/dev/null; do
    sleep 0.1; tries=$((tries + 1))
  done
  scenario "${held_name}_ps" "$cli" ps --json $held_pid
  echo go >"$held_fifo"
  wait $held_pid
  emit "$held_name" "$held_out" "$held_err" $?
}
