"""OpenMP with its own thread binding (OMP_PROC_BIND / OMP_PLACES set by the test): libgomp
places each team member itself, pool threads through the affinity in their pthread_attr_t and
the calling thread with pthread_setaffinity_np, so the library sees explicit placements.

Threads: main and its pool (host_omp*), worker (configures 0, then runs a region) and its pool
(worker_omp*). Phases: configured, released. After each phase's region, stderr gets
"PLACEMENTS <json>": tid -> placement, from the library's report.
"""
import json
import sys
import threading

from runtime_helpers import Omp, configure, note, phase, release, report

omp = Omp()


def placements():
    r = report()
    print("PLACEMENTS", json.dumps({t["tid"]: t["placement"] for t in r["threads"]}),
          file=sys.stderr, flush=True)


def worker():
    note("worker")
    lease = configure(0)
    omp.run("worker_omp")
    placements()
    phase("configured")
    release(lease)
    placements()
    phase("released")


note("main")
omp.run("host_omp")
t = threading.Thread(target=worker, name="worker")
t.start()
t.join()
