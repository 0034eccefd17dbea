"""A Python thread population for the external-constraint tests (tests/process/constraints.rs): run under
`numactl --physcpubind`, `taskset -c` or inside a cpuset cgroup.

Threads: main (host); host, a host thread started before the worker; worker, which configures
DEVICE (argv[1]); child0, child1 and grandchild, the worker's, alive throughout; child_late, the
worker's, and host_late, main's, both born during the lease. Phases: before, configured,
released. After configure, one line on stderr: "REPORT <json>" with the library's view (mask at
load, cpuset, constrained, worker mask).
"""
import json
import sys
import threading

from runtime_helpers import configure, note, phase, release, report, start, stop

device = int(sys.argv[1])
make_host_late = threading.Event()
host_late_made = threading.Event()


def worker():
    note("worker")
    start("child0")
    grandchild = threading.Event()
    start("child1", lambda: (start("grandchild"), grandchild.set()))
    assert grandchild.wait(30)
    phase("before")
    lease = configure(device)
    r = report()
    keys = ("mask_at_load", "cpuset", "constrained", "worker_mask")
    print("REPORT", json.dumps({k: r[k] for k in keys}), file=sys.stderr, flush=True)
    make_host_late.set()
    host_late_made.wait(30)
    start("child_late")
    phase("configured")
    release(lease)
    phase("released")
    stop.set()


note("main")
start("host")
w = threading.Thread(target=worker, name="worker")
w.start()
make_host_late.wait(30)
start("host_late")
host_late_made.set()
w.join()
