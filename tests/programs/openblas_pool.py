"""Where numpy's OpenBLAS pool lands (tests/process/runtimes.rs, docs/runtimes.md).

OpenBLAS (pthreads build, as in numpy's wheels) starts its pool when the library loads, i.e. at
`import numpy`, from the importing thread, sized to that thread's CPUs. Usage:
openblas_pool.py MODE, MODE one of
  host-first     the main thread imports numpy at start (a server's usual import order)
  worker-before  the worker thread imports numpy, then configures
  worker-after   the worker thread configures, then imports numpy
Prints "BLAS <n>" (the threads the import started, noted blas1..n) and the phases before,
configured, released; the worker does BLAS work during the lease.
"""
import sys
import threading

from runtime_helpers import blas_work, configure, import_numpy, note, phase, release, say

mode = sys.argv[1]
assert mode in ("host-first", "worker-before", "worker-after"), mode
np = {}


def load():
    np["numpy"], pool = import_numpy("blas")
    say("BLAS", len(pool))


def worker():
    note("worker")
    if mode == "worker-before":
        load()
    phase("before")
    lease = configure(0)
    if mode == "worker-after":
        load()
    blas_work(np["numpy"])
    phase("configured")
    release(lease)
    phase("released")


note("main")
if mode == "host-first":
    load()
t = threading.Thread(target=worker, name="worker")
t.start()
t.join()
