"""Stand-ins for the native libraries a real server loads, over the test programs of
tests/programs: torch's intra-op OpenMP pool (``RT_OMP``: openmp_region.c, a real libgomp parallel
region) and MPI/NCCL progress threads (``RT_NCCL`` + ``RT_SPAWN``: nccl.c, built as libnccl.so.2,
whose start routine the default ``TLLM_AFFINITY_WORKER_LIBS`` matches, started by
progress_threads.c's ``pthread_create`` from the calling thread). Without the variables there are no such threads.

Each native thread gets a name (its kernel ``comm``), as the tests tell threads apart by name.
"""
import ctypes
import os
import threading

_lock = threading.Lock()
_libs = {}


def name_thread(tid, name):
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _load(key):
    with _lock:
        if key not in _libs:
            _libs[key] = _open(key)
        return _libs[key]


def _open(key):
    if key == "omp":
        path = os.environ.get("RT_OMP")
        if not path:
            return None
        lib = ctypes.CDLL(path)
        lib.rt_omp_run.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_double),
        ]
        return lib
    nccl, spawn = os.environ.get("RT_NCCL"), os.environ.get("RT_SPAWN")
    if not (nccl and spawn):
        return None
    nccl, spawner = ctypes.CDLL(nccl), ctypes.CDLL(spawn)
    spawner.spawn_progress.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    nccl.fake_nccl_set_note.argtypes = [ctypes.c_void_p]
    nccl.fake_nccl_set_note(ctypes.cast(spawner.rt_note, ctypes.c_void_p))
    return spawner, ctypes.cast(nccl.fake_nccl_progress, ctypes.c_void_p)


def omp_region(prefix):
    """One parallel region from the calling thread (libgomp starts the caller's pool the first
    time and keeps it docked between regions); names the pool <prefix>1, <prefix>2, ..."""
    lib = _load("omp")
    if lib is None:
        return []
    tids = (ctypes.c_int * 64)()
    result = ctypes.c_double()
    team = lib.rt_omp_run(tids, 64, ctypes.byref(result))
    pool = [tids[i] for i in range(1, min(team, 64))]
    for i, tid in enumerate(pool, 1):
        name_thread(tid, f"{prefix}{i}")
    return pool


def progress_thread(name):
    """A communication library's progress thread, started from the calling thread; its tid."""
    libs = _load("comm")
    if libs is None:
        return None
    spawner, progress = libs
    tid = spawner.spawn_progress(progress, name.encode())
    name_thread(tid, name)
    return tid
