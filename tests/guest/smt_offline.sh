#!/bin/sh
# Inside the guest of tests/guests/guest.rs: two sockets of two cores of two SMT threads (an Intel CPU
# model), one NUMA node per socket (0-3, 4-7), QEMU's pci-testdev at 0000:81:00.0 on node 1,
# named GPU 0 by the NVML test double. CPU 7 goes offline here, and comes back online while a
# process whose worker masks the library restored is still running. Before that, with every CPU
# online, four servers on a GB200 tray the host test wrote over the two sockets (its Grace node 0
# = CPUs 0-3, node 1 = 4-7; the written tree says each CPU is a core of its own, as on Grace):
# eight CPUs give `auto` the two cores per GPU it needs. Arguments: the preload library, the
# CLI, the double's directory, step_result_hotplug, Python, the test programs' directory, the
# written tray, the written tree of four GPUs over the two sockets (two per node, each node two
# last-level-cache domains) on which four engines run side by side, with slices and without.
lib=$1 cli=$2 nvml_dir=$3 program=$4 python=$5 programs=$6 tray=$7 slice_tree=$8
. "$(dirname "$0")/scenario.sh"
scenario guest identity
scenario tray "$python" "$programs/tray_servers.py" "$cli" "$python" "$programs" "$tray" "$nvml_dir"
scenario slices "$python" "$programs/slice_servers.py" "$cli" "$python" "$programs" "$slice_tree" 4
scenario siblings sh -c 'for c in /sys/devices/system/cpu/cpu[0-9]*; do
  echo "${c##*/} $(cat $c/topology/thread_siblings_list) $(cat $c/topology/physical_package_id)"
done'
work=$(mktemp -d)
echo "gpu 00000000:81:00.0 GPU-81818181-0000-1111-2222-333344445555 -" >"$work/nvml"
export LD_LIBRARY_PATH="$nvml_dir" TLLM_NVML_DOUBLE="$work/nvml"
# The guest's "GPU" is not an NVIDIA function: the step CPU is named.
export TLLM_AFFINITY_STEP_CORE=4

echo 0 >/sys/devices/system/cpu/cpu7/online
scenario offline cat /sys/devices/system/cpu/online
scenario plan "$cli" plan --gpu 0 --json
scenario auto env TLLM_AFFINITY_STEP_CORE=auto "$cli" plan --gpu 0 --json

# Configure, pin, release with CPU 7 offline; bring it online; read every thread again.
mkfifo "$work/in"
(
  env LD_PRELOAD="$lib" TLLM_AFFINITY_LOG=info "$program" 0 <"$work/in" >"$work/out" 2>"$work/err"
  echo $? >"$work/rc"
) &
exec 3>"$work/in"
i=0
while ! grep -q '^READY' "$work/out" 2>/dev/null && [ $i -lt 600 ]; do
  sleep 0.1
  i=$((i + 1))
done
echo 1 >/sys/devices/system/cpu/cpu7/online
echo go >&3
exec 3>&-
wait
emit hotplug "$work/out" "$work/err" "$(cat "$work/rc")"
scenario back_online cat /sys/devices/system/cpu/online
