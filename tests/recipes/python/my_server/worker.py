"""Stand-in for `python -m my_server.worker [--step-thread]`, a dedicated worker process (an MPI
rank, a Slurm task), for the README recipe test.

It starts an engine thread with a pool thread of its own, then prints one JSON line: its rank,
each thread's mask, and what the library says. With --step-thread the engine thread pins itself
as a step thread (`tllm_affinity.pin_step_thread`) and the line says where it went.

When the library is loaded into a process that was started as a worker
(TLLM_AFFINITY_PROCESS_ROLE=worker), it checks that the process is an active worker whose
threads share one mask, and exits 1 otherwise.
"""
import json
import os
import sys
import threading

seen = {}
step = "--step-thread" in sys.argv[1:]
try:
    import tllm_affinity
except ImportError:
    tllm_affinity = None
loaded = tllm_affinity is not None and tllm_affinity.available()


def pool():
    seen["pool"] = sorted(os.sched_getaffinity(0))


def engine():
    if step and loaded:
        seen["step_cpus"] = tllm_affinity.pin_step_thread(-1)
    seen["engine"] = sorted(os.sched_getaffinity(0))
    t = threading.Thread(target=pool)
    t.start()
    t.join()


t = threading.Thread(target=engine)
t.start()
t.join()
seen["main"] = sorted(os.sched_getaffinity(0))
rank = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if v in os.environ),
            "0")
line = {"program": "my_server.worker (stand-in)", "rank": rank, "masks": seen}
if loaded:
    report = tllm_affinity.report()
    line["library"] = {k: report.get(k) for k in ("state", "constrained", "worker_mask",
                                                    "peak_workers")}
    line["role"] = tllm_affinity.role()
print(json.dumps(line), flush=True)
if loaded and os.environ.get("TLLM_AFFINITY_PROCESS_ROLE") == "worker":
    if line["role"] != "worker" or report["state"] != "active":
        sys.exit(f"my_server.worker (stand-in): not an active worker: {line}")
    if not step and not seen["main"] == seen["engine"] == seen["pool"]:
        sys.exit(f"my_server.worker (stand-in): worker threads on different masks: {line}")
