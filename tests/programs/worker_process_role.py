"""Issue #2, rule 4, in Python: under TLLM_AFFINITY_PROCESS_ROLE=worker the main thread and
every thread are workers on the GPU-local set from the start."""
import json
import os
import threading

import tllm_affinity

seen = {}


def child():
    seen["thread"] = (tllm_affinity.role(), sorted(os.sched_getaffinity(0)))


t = threading.Thread(target=child)
t.start()
t.join()
print(
    "ROLE",
    json.dumps(
        {
            "main": [tllm_affinity.role(), sorted(os.sched_getaffinity(0))],
            "thread": list(seen["thread"]),
            "leases": tllm_affinity.report()["leases"],
        }
    ),
    flush=True,
)
