# Sourced by the guest scripts of the machine with a device on each node (memory.sh,
# memory_bench.sh) after scenario.sh: the identity scenario, then the NVML test double and a
# driver list naming 0000:41:00.0 (node 0) GPU 0 and 0000:81:00.0 (node 1) GPU 1, for every later
# scenario; `work` is a scratch directory. Needs `nvml_dir`.
work=$(mktemp -d)
scenario guest identity
printf '%s\n' "gpu 00000000:41:00.0 GPU-41414141-0000-1111-2222-333344445555 -" \
  "gpu 00000000:81:00.0 GPU-81818181-0000-1111-2222-333344445555 -" >"$work/nvml"
export LD_LIBRARY_PATH="$nvml_dir" TLLM_NVML_DOUBLE="$work/nvml"
mkdir -p "$work/driver"
mount -t tmpfs driver /proc/driver 2>/dev/null || mount --bind "$work/driver" /proc/driver
minor=0
for gpu in 0000:41:00.0 0000:81:00.0; do
  mkdir -p /proc/driver/nvidia/gpus/$gpu
  printf 'GPU UUID: \t GPU-%s\nDevice Minor: \t %s\n' "$gpu" $minor \
    >/proc/driver/nvidia/gpus/$gpu/information
  touch /dev/nvidia$minor
  minor=$((minor + 1))
done
scenario devices sh -c 'for d in 41 81; do cat /sys/bus/pci/devices/0000:$d:00.0/numa_node; done;
  ls /proc/driver/nvidia/gpus'

