"""A main thread that builds an engine inside a worker scope, then serves itself:
it stays a host, the threads it starts in the scope (and theirs) are workers, the threads it
starts after the scope are hosts, and releasing the scope's lease puts every mask back.

Usage: worker_scope.py [passive]; `passive` (run with a malformed variable) prints one JSON line.
"""
import ctypes
import errno
import json
import sys
import threading
import warnings

import tllm_affinity
from phases import LIB, note, phase, start, stop

LIB.tllm_affinity_end_worker_scope.restype = ctypes.c_int32
LIB.tllm_affinity_end_worker_scope.argtypes = [ctypes.c_int64]


def scoped():
    note("main")
    with tllm_affinity.worker_scope(0) as lease:
        role_in_scope = tllm_affinity.role()
        # `start` returns once the thread has noted itself: wait for the engine's own child too.
        child_started = threading.Event()
        start("engine", lambda: (start("engine_child"), child_started.set()))
        start("pool")
        child_started.wait()
    start("http")
    # The scope is over, the lease is not: ending it again is a no-op, in C -ENOENT.
    tllm_affinity.end_worker_scope(lease)
    tllm_affinity.end_worker_scope(lease.id)
    api = {
        "lease": lease.id,
        "released": lease.released,
        "role_in_scope": role_in_scope,
        "role_after": tllm_affinity.role(),
        "end_again": LIB.tllm_affinity_end_worker_scope(lease.id),
        "enoent": errno.ENOENT,
    }
    print("API", json.dumps(api), flush=True)
    phase("scoped")
    lease.release()
    start("late")
    phase("released")
    stop.set()


def passive():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tllm_affinity.worker_scope(0) as lease:
            start("inside")
        tllm_affinity.end_worker_scope(lease)
        lease.release()
    stop.set()
    return {"inert": lease.inert, "warnings": [str(w.message) for w in caught],
            "categories": [w.category.__name__ for w in caught]}


if __name__ == "__main__":
    if sys.argv[1:] == ["passive"]:
        print(json.dumps(passive()), flush=True)
    else:
        scoped()
