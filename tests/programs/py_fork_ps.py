"""A worker thread forks; the child (its forking thread a worker) starts a thread and waits, so
that `tllm-affinity ps` can read the child's own thread table."""
import ctypes
import os
import sys
import threading

lib = ctypes.CDLL(None)
lib.tllm_affinity_configure.restype = ctypes.c_int64


def worker():
    assert lib.tllm_affinity_configure(0) > 0
    pid = os.fork()
    if pid == 0:
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        print(os.getpid(), threading.get_native_id(), t.native_id, flush=True)
        sys.stdin.readline()
        stop.set()
        t.join()
        os._exit(0)
    os.waitpid(pid, 0)


t = threading.Thread(target=worker)
t.start()
t.join()
