"""The everyday form of the fork-while-loading hang: threads load native objects (ctypes, a
real dlopen/dlclose of plugins whose constructor and destructor start a thread, from Python and
from a native loop that ctypes runs without the GIL, and the interpreter's own extension
modules) while another thread forks children that start a Python
thread, with os.fork and with multiprocessing's fork start method, and a worker configures and
releases. Prints "PYSTORM forks=N processes=N loads=N cycles=N" and exits 0; a child that did
not exit 0 fails the run (exit 1).

    py_fork_storm.py SECONDS PLUGIN_A PLUGIN_B
"""
import _ctypes
import ctypes
import importlib
import multiprocessing
import os
import sys
import threading
import time

seconds, plugins = float(sys.argv[1]), sys.argv[2:4]
stop = threading.Event()
counts = {"forks": 0, "processes": 0, "loads": 0, "cycles": 0, "bad": 0}
lib = ctypes.CDLL(None)
lib.tllm_affinity_configure.restype = ctypes.c_int64


def loader(path):
    while not stop.is_set():
        handle = ctypes.CDLL(path)._handle
        _ctypes.dlclose(handle)
        counts["loads"] += 1


def native_loader(path):
    # PLUGIN_A stays loaded and cycles PLUGIN_B without the GIL, as an extension module's own
    # threads would load plugins while the interpreter forks.
    driver = ctypes.CDLL(plugins[0])
    driver.storm_plugin_cycle.argtypes = (ctypes.c_char_p, ctypes.c_int)
    while not stop.is_set():
        counts["loads"] += driver.storm_plugin_cycle(path.encode(), 20)


def importer():
    # Extension modules of the standard library this program has not imported yet: each import
    # is a dlopen under the import lock.
    for name in ("_bz2", "_lzma", "_decimal", "_sqlite3", "_curses", "_dbm", "_ssl", "_hashlib",
                 "_uuid", "_zoneinfo", "_statistics", "_queue", "_asyncio", "_elementtree",
                 "_multibytecodec", "_codecs_jp", "_codecs_kr", "_codecs_cn", "_csv", "mmap"):
        if stop.is_set():
            return
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def configurer():
    while not stop.is_set():
        lease = lib.tllm_affinity_configure(0)
        threading.Thread(target=lambda: None).start()
        if lease > 0:
            lib.tllm_affinity_release(ctypes.c_int64(lease))
        counts["cycles"] += 1


def child_life():
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()


def forker():
    ctx = multiprocessing.get_context("fork")
    while not stop.is_set():
        pid = os.fork()
        if pid == 0:
            child_life()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        counts["forks"] += 1
        counts["bad"] += status != 0
        p = ctx.Process(target=child_life)
        p.start()
        p.join()
        counts["processes"] += 1
        counts["bad"] += p.exitcode != 0


threads = [threading.Thread(target=loader, args=(plugins[1],), daemon=True),
           threading.Thread(target=native_loader, args=(plugins[1],), daemon=True)]
threads += [threading.Thread(target=f, daemon=True) for f in (importer, configurer, forker)]
for t in threads:
    t.start()
time.sleep(seconds)
stop.set()
for t in threads:
    t.join()
print("PYSTORM " + " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
sys.exit(1 if counts["bad"] else 0)
