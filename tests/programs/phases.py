"""The PHASE protocol of the integration tests, for Python populations.

Threads note themselves by name (or are noted by tid: threads native libraries start never run
Python code); `phase(name)` prints "PHASE <name> <thread>=<tid>:<role> ..." and
waits for a line on stdin, while the test reads the kernel's masks from /proc. `phase_all(name)`
does the same for every thread of the process (`census`), for programs that cannot note the
threads a library starts.

Without libtllm_affinity.so in the process (an app run as upstream behaves), every role is -1.
"""
import ctypes
import os
import re
import sys
import threading

LIB = ctypes.CDLL(None)
try:
    LIB.tllm_affinity_role.argtypes = [ctypes.c_int32]
    LIB.tllm_affinity_configure.restype = ctypes.c_int64
    LIB.tllm_affinity_configure.argtypes = [ctypes.c_int32]
    LIB.tllm_affinity_release.argtypes = [ctypes.c_int64]
    LIB.tllm_affinity_report.restype = ctypes.c_int64
    LIB.tllm_affinity_report.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    LOADED = True
except AttributeError:  # the library is not loaded
    LOADED = False


def role(tid):
    """The library's role of `tid`: 0 host, 1 worker, negative errno; -1 without the library."""
    return LIB.tllm_affinity_role(tid) if LOADED else -1

_threads = {}
_lock = threading.Lock()


def note(name, tid=None):
    with _lock:
        _threads[name] = threading.get_native_id() if tid is None else tid


def phase(name):
    with _lock:
        parts = [f"{n}={tid}:{role(tid)}" for n, tid in _threads.items()]
    _print_and_wait(name, parts)


def _print_and_wait(name, parts):
    print("PHASE", name, *parts, flush=True)
    if not sys.stdin.readline():
        os._exit(3)  # stdin closed: the test is gone; end the whole process, not this thread


def _comm(tid):
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def census():
    """Every live thread by name: Python threads by their `threading` name (the main thread as
    "main"), native threads by the name their library gave them (their `comm`, when it differs
    from the process's; unnamed native threads are left out), and the names `note` recorded.
    Spaces, '=' and ':' in names become '_'; a name taken by another thread gets "#2", "#3"..."""
    names = {}

    def add(name, tid):
        name = re.sub(r"[\s=:]", "_", name) or "_"
        key, n = name, 2
        while key in names and names[key] != tid:
            key, n = f"{name}#{n}", n + 1
        names[key] = tid

    for t in threading.enumerate():
        if t.native_id is not None:
            add("main" if t is threading.main_thread() else t.name, t.native_id)
    python = set(names.values())
    process = _comm(os.getpid())
    for entry in sorted(os.listdir("/proc/self/task"), key=int):
        tid = int(entry)
        comm = None if tid in python else _comm(tid)
        if comm and comm != process:
            add(comm, tid)
    with _lock:
        noted = list(_threads.items())
    for name, tid in noted:
        add(name, tid)
    return names


def phase_all(name):
    """`phase` over every thread of the process (`census`)."""
    _print_and_wait(name, [f"{n}={tid}:{role(tid)}" for n, tid in census().items()])


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
