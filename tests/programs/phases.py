"""The PHASE protocol of the integration tests, for Python populations.

Threads note themselves by name (or are noted by tid: threads native libraries start never run
Python code); `phase(name)` prints "PHASE <name> <thread>=<tid>:<role> ..." and
waits for a line on stdin, while the test reads the kernel's masks from /proc.
"""
import ctypes
import os
import sys
import threading

LIB = ctypes.CDLL(None)
LIB.tllm_affinity_configure.restype = ctypes.c_int64
LIB.tllm_affinity_configure.argtypes = [ctypes.c_int32]
LIB.tllm_affinity_release.argtypes = [ctypes.c_int64]
LIB.tllm_affinity_role.argtypes = [ctypes.c_int32]
LIB.tllm_affinity_report.restype = ctypes.c_int64
LIB.tllm_affinity_report.argtypes = [ctypes.c_char_p, ctypes.c_uint64]

_threads = {}
_lock = threading.Lock()


def note(name, tid=None):
    with _lock:
        _threads[name] = threading.get_native_id() if tid is None else tid


def phase(name):
    with _lock:
        parts = [f"{n}={tid}:{LIB.tllm_affinity_role(tid)}" for n, tid in _threads.items()]
    print("PHASE", name, *parts, flush=True)
    if not sys.stdin.readline():
        os._exit(3)  # stdin closed: the test is gone; end the whole process, not this thread


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


stop = threading.Event()
