"""Issue #2, rule 2, in Python: the application's own os.sched_setaffinity calls on worker
threads during a lease are observed (placement explicit), a second configure does not override
them, release leaves them, and a `taskset -p` from outside (run by the test at the
"configured-twice" phase on thread "ext") is found and preserved. argv[1]: the CPU to pin to."""
import json
import os
import sys
import threading

import tllm_affinity
from phases import note, phase, start, stop

CPU = int(sys.argv[1])


def engine():
    note("engine")
    lease = tllm_affinity.configure(0)
    start("self_pinned", target=lambda: os.sched_setaffinity(0, {CPU}))
    other = start("other_pinned")
    os.sched_setaffinity(other.native_id, {CPU})
    start("plain")
    start("ext")
    phase("pinned")
    second = tllm_affinity.configure(0)
    phase("configured-twice")
    second.release()
    lease.release()
    phase("released")
    print("REPORT released", json.dumps(tllm_affinity.report()), flush=True)
    third = tllm_affinity.configure(0)
    phase("configured-again")
    third.release()


note("main")
t = threading.Thread(target=engine, name="engine")
t.start()
t.join()
stop.set()
