"""Issue #2, rule 3, in Python: threads that end by returning, by an exception, by SystemExit,
and a thread pool shut down; then the library's thread list must equal the live threads."""
import concurrent.futures
import json
import threading

import tllm_affinity
from phases import note, phase


def ok():
    return 1


def boom():
    raise RuntimeError("thread ends by an exception")


def leave():
    raise SystemExit(0)


threading.excepthook = lambda args: None
note("main")
ended = 0
for _ in range(30):
    for fn in (ok, boom, leave):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
        ended += 1
with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
    assert sum(pool.map(lambda _: 1, range(64))) == 64
lease = tllm_affinity.configure(0)
workers = [threading.Thread(target=ok) for _ in range(20)]
for w in workers:
    w.start()
for w in workers:
    w.join()
ended += len(workers)
lease.release()
print("ENDED", ended, flush=True)
phase("ended")
print("REPORT ended", json.dumps(tllm_affinity.report()), flush=True)
