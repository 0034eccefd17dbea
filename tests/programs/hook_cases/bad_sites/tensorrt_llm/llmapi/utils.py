import os

CALLS = []


def _set_affinity_all_threads(cpus):
    CALLS.append(("sweep", sorted(cpus)))
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def configure_cpu_affinity(device_id: int) -> None:
    CALLS.append(("configure", device_id))
    _set_affinity_all_threads({max(os.sched_getaffinity(0))})
