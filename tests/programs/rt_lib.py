"""Shared helpers of the runtime and deployment programs (tests/programs/rt_*.py).

The PHASE protocol is the one of tests/programs/phases.py: threads are noted by name,
`phase(name)` prints "PHASE <name> <thread>=<tid>:<role> ..." and waits for a line on stdin while
the test reads every named thread's mask from /proc/<pid>/task/<tid>/status. Here a thread can
also be noted by tid, for threads that native libraries start (OpenMP, OpenBLAS, progress
threads), which never run Python code.
"""
import ctypes
import json
import os
import sys
import threading
import time

LIB = ctypes.CDLL(None)
LIB.tllm_affinity_configure.restype = ctypes.c_int64
LIB.tllm_affinity_configure.argtypes = [ctypes.c_int32]
LIB.tllm_affinity_release.argtypes = [ctypes.c_int64]
LIB.tllm_affinity_role.argtypes = [ctypes.c_int32]
LIB.tllm_affinity_report.restype = ctypes.c_int64
LIB.tllm_affinity_report.argtypes = [ctypes.c_char_p, ctypes.c_uint64]

_threads = {}
_lock = threading.Lock()
stop = threading.Event()


def _watchdog(limit):
    """Ends the process should the test be gone while the program waits on something else than
    a phase (the tests take seconds; a program left behind must not live on)."""
    time.sleep(limit)
    print(f"rt_lib: still running after {limit} s, exiting", file=sys.stderr, flush=True)
    os._exit(4)


threading.Thread(
    target=_watchdog, args=(float(os.environ.get("RT_WATCHDOG_S", "120")),), daemon=True
).start()


def note(name, tid=None):
    with _lock:
        _threads[name] = threading.get_native_id() if tid is None else tid


def phase(name):
    with _lock:
        parts = [f"{n}={tid}:{LIB.tllm_affinity_role(tid)}" for n, tid in _threads.items()]
    print("PHASE", name, *parts, flush=True)
    if not sys.stdin.readline():
        # The test is gone (stdin closed): end the whole process, whichever thread this is.
        os._exit(3)


def say(*words):
    """A line for the test that is not a phase (the harness skips it while waiting for one)."""
    print(*words, flush=True)


def start(name, target=None):
    """Starts a thread that notes itself, runs `target` and then parks until `stop` is set."""
    ready = threading.Event()

    def run():
        note(name)
        ready.set()
        if target:
            target()
        stop.wait()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    ready.wait()
    return t


def tasks():
    """The tids of every thread of this process, from the kernel."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def configure(device):
    lease = LIB.tllm_affinity_configure(device)
    assert lease > 0, f"configure({device}) -> {lease}"
    return lease


def release(lease):
    rc = LIB.tllm_affinity_release(lease)
    assert rc == 0, f"release({lease}) -> {rc}"


def report():
    need = LIB.tllm_affinity_report(None, 0)
    buf = ctypes.create_string_buffer(need + 1)
    LIB.tllm_affinity_report(buf, need + 1)
    return json.loads(buf.value)


class Omp:
    """librt_omp.so.2 (tests/programs/rt_omp.c): a real libgomp parallel region."""

    def __init__(self):
        self.lib = ctypes.CDLL(os.environ["RT_OMP"])
        self.lib.rt_omp_run.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_double),
        ]

    def run(self, prefix):
        """Runs a region from the calling thread and notes its pool as <prefix>1, <prefix>2, ...
        (member 0 is the caller). Returns the pool's tids."""
        tids = (ctypes.c_int * 64)()
        result = ctypes.c_double()
        team = self.lib.rt_omp_run(tids, 64, ctypes.byref(result))
        assert team >= 1 and result.value > 0, (team, result.value)
        assert tids[0] == threading.get_native_id(), "the caller is member 0"
        pool = [tids[i] for i in range(1, team)]
        for i, tid in enumerate(pool, 1):
            note(f"{prefix}{i}", tid)
        return pool


def import_numpy(prefix):
    """Imports numpy on the calling thread and notes the threads the import started (OpenBLAS
    starts its pool from the importing thread) as <prefix>1, ... Returns (numpy, their tids).
    Nothing else may start threads meanwhile."""
    before = tasks()
    import numpy

    pool = sorted(tasks() - before)
    for i, tid in enumerate(pool, 1):
        note(f"{prefix}{i}", tid)
    return numpy, pool


def blas_work(numpy):
    """A matrix product big enough for OpenBLAS to use its pool."""
    a = numpy.arange(400 * 400, dtype=numpy.float64).reshape(400, 400) / 1e5
    b = a @ a.T
    assert b.shape == (400, 400) and b[0, 0] >= 0
