"""Shared helpers of the runtime and deployment programs of tests/programs.

The PHASE protocol comes from tests/programs/phases.py (note, phase, start, stop); this module
adds a watchdog, the C ABI calls with checks, the report, and the numpy/OpenMP helpers.
"""
import ctypes
import json
import os
import sys
import threading
import time

from phases import LIB, note, phase, start, stop  # noqa: F401 (re-exported to the runtime programs)


def _watchdog(limit):
    """Ends the process should the test be gone while the program waits on something else than
    a phase (the tests take seconds; a program left behind must not live on)."""
    time.sleep(limit)
    print(f"runtime_helpers: still running after {limit} s, exiting", file=sys.stderr, flush=True)
    os._exit(4)


threading.Thread(
    target=_watchdog, args=(float(os.environ.get("RT_WATCHDOG_S", "120")),), daemon=True
).start()


def say(*words):
    """A line for the test that is not a phase (the harness skips it while waiting for one)."""
    print(*words, flush=True)


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
    """libopenmp_region.so.2 (tests/programs/openmp_region.c): a real libgomp parallel region."""

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
