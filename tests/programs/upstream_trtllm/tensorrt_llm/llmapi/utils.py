"""tensorrt_llm.llmapi.utils, the parts the worker plumbing uses: ``ManagedThread``, the
single-process switch, and upstream's CPU-affinity code with its behaviour (and bugs) intact."""
import os
import threading
import traceback
import weakref
from functools import cache
from queue import Queue
from typing import Callable, List, Optional

from tensorrt_llm._release import CONFIGURE_KEYWORD
from tensorrt_llm.logger import logger


class ManagedThread(threading.Thread):
    """A thread that runs ``task`` until it returns False or ``stop()``; an exception goes to
    ``error_queue`` and the loop goes on."""

    def __init__(self,
                 task: Callable[..., bool],
                 error_queue: Queue,
                 name: Optional[str] = None,
                 stop_event: Optional[threading.Event] = None,
                 **kwargs):
        super().__init__(name=name)
        self.task = task
        self.error_queue = error_queue
        self.kwargs = kwargs
        self.daemon = True
        self.stop_event = stop_event or threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            task = self.task
            if isinstance(task, weakref.WeakMethod):
                task = task()
                if task is None:
                    break
            try:
                if not task(**self.kwargs):
                    break
            except Exception as e:
                logger.error(f"Error in thread {self.name}: {e}\n{traceback.format_exc()}")
                self.error_queue.put(e)

    def stop(self):
        self.stop_event.set()


@cache
def enable_worker_single_process_for_tp1() -> bool:
    return os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS", "0") == "1"


# ---- Topology: where upstream asks psutil and NVML, the sysfs tree under TLLM_AFFINITY_SYSFS_ROOT.


def _sysfs(*parts) -> str:
    return os.path.join(os.environ.get("TLLM_AFFINITY_SYSFS_ROOT", "/"), "sys", *parts)


def _read(path) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpulist(text: str) -> List[int]:
    cpus = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _all_cpus() -> List[int]:
    """psutil.cpu_count(), as the list upstream builds from it: the online CPUs."""
    online = _read(_sysfs("devices/system/cpu/online"))
    return _cpulist(online) if online else list(range(os.cpu_count()))


def _nvidia_gpus() -> List[str]:
    """The NVIDIA display/3D functions, in PCI address order (CUDA's PCI_BUS_ID order)."""
    root = _sysfs("bus/pci/devices")
    try:
        addresses = sorted(os.listdir(root))
    except OSError:
        return []
    return [
        a for a in addresses
        if _read(os.path.join(root, a, "vendor")) == "0x10de"
        and (_read(os.path.join(root, a, "class")) or "").startswith("0x03")
    ]


def get_device_count() -> int:
    """torch.cuda.device_count()."""
    return max(len(_nvidia_gpus()), 1)


def get_numa_aware_cpu_affinity(device_id: int) -> List[int]:
    """The CPUs local to GPU ``device_id`` (upstream: NVML's CPU affinity of the device)."""
    gpus = _nvidia_gpus()
    if device_id >= len(gpus):
        return _all_cpus()
    device = os.path.join(_sysfs("bus/pci/devices"), gpus[device_id])
    local = _read(os.path.join(device, "local_cpulist"))
    if not local:
        node = _read(os.path.join(device, "numa_node")) or "-1"
        local = _read(_sysfs(f"devices/system/node/node{node}/cpulist")) if node != "-1" else None
    return _cpulist(local) if local else _all_cpus()


def get_executor_loop_cpus(device_id: int) -> List[int]:
    """Where upstream pins its executor loop under ``TLLM_EXECUTOR_LOOP_PIN=1`` (PR #18701): a run
    of ``TLLM_EXECUTOR_LOOP_PIN_NCORES`` (default 2) CPUs of the GPU's NUMA-aware list, starting
    ``TLLM_EXECUTOR_LOOP_PIN_OFFSET`` (default 16) entries in and moved on by that many per GPU
    sharing the list before it; a run past the list's end, or the variable unset, pins nothing.
    Upstream's unit test: GPUs 0, 1 on CPUs 0-31 get [16, 17] and [18, 19], GPUs 2, 3 on 32-63
    get [48, 49] and [50, 51]; offset 4 with three CPUs gives GPU 1 [7, 8, 9]."""
    if os.environ.get("TLLM_EXECUTOR_LOOP_PIN") != "1":
        return []
    offset = int(os.environ.get("TLLM_EXECUTOR_LOOP_PIN_OFFSET", "16"))
    ncores = int(os.environ.get("TLLM_EXECUTOR_LOOP_PIN_NCORES", "2"))
    cpus = get_numa_aware_cpu_affinity(device_id)
    sharing = [d for d in range(device_id) if get_numa_aware_cpu_affinity(d) == cpus]
    first = offset + len(sharing) * ncores
    if ncores <= 0 or first + ncores > len(cpus):
        return []
    return cpus[first:first + ncores]


# ---- The affinity code the seeds describe: process-wide, never restored.


def _set_affinity_all_threads(cpus):
    """Every thread of the process onto ``cpus``; (threads set, threads seen)."""
    tids = os.listdir("/proc/self/task")
    done = 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            done += 1
        except OSError:
            pass  # the thread exited meanwhile
    return done, len(tids)


def _reapply_current_thread_affinity_to_all_threads():
    """The calling thread's mask onto every thread (for threads started since the sweep)."""
    return _set_affinity_all_threads(os.sched_getaffinity(0))


def _configure_cpu_affinity(device_id: int) -> None:
    pid = os.getpid()
    # psutil.Process().cpu_affinity(): sched_getaffinity(pid), the main thread's mask.
    cpu_affinity = sorted(os.sched_getaffinity(pid))
    all_cpus = _all_cpus()
    # The bug of seeds/configure-not-idempotent.txt: its own earlier pin counts as a constraint.
    constrained_affinity = cpu_affinity != all_cpus
    numa_aware_affinity = os.environ.get("TLLM_NUMA_AWARE_WORKER_AFFINITY")

    if (numa_aware_affinity is None and not constrained_affinity) or numa_aware_affinity == "1":
        cpus = get_numa_aware_cpu_affinity(device_id)
        done, total = _set_affinity_all_threads(cpus)
        logger.info(f"Worker process {pid} CPU affinity set to {cpus} for optimal NUMA-aware "
                    f"scheduling ({done}/{total} threads).")
    elif numa_aware_affinity is None:
        logger.warning(
            f"Worker process {pid} is affined to run on the following CPUs: {cpu_affinity}")
        logger.warning(
            f"Worker process {pid} has constrained CPU affinity but "
            "`TLLM_NUMA_AWARE_WORKER_AFFINITY` is not set. Removing CPU affinity constraints.")
        _set_affinity_all_threads(all_cpus)


if CONFIGURE_KEYWORD:

    def configure_cpu_affinity(*, gpu_index: int) -> None:
        _configure_cpu_affinity(gpu_index)
else:

    def configure_cpu_affinity(device_id: int) -> None:
        _configure_cpu_affinity(device_id)
