"""Pins step and result threads through the preloaded library's C ABI and reports the masks.

Run under LD_PRELOAD=libtllm_affinity.so. Prints one JSON line:
  {"configure": lease or null,
   "step": {"rc": n, "tid": t, "mask": [...], "pool": [{"tid": t, "mask": [...]}, ...]},
   "result": {...}}
Options:
  --configure DEV  configure the main thread for DEV first (opens a lease)
  --step DEV       pin a new thread as the step thread for DEV
  --result DEV     pin another new thread as the result thread for DEV
  --pool N         each pinned thread then runs N ThreadPoolExecutor tasks at once and reports
                   the masks of the pool's threads
  --hold           after printing, sleep until killed (keeps the process and its lock alive)
"""

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

lib = ctypes.CDLL(None)
lib.tllm_affinity_configure.restype = ctypes.c_int64
lib.tllm_affinity_configure.argtypes = [ctypes.c_int32]
for name in ("tllm_affinity_pin_step_thread", "tllm_affinity_pin_result_thread"):
    getattr(lib, name).restype = ctypes.c_int32
    getattr(lib, name).argtypes = [ctypes.c_int32]


def status_mask(tid):
    """The kernel's view of one thread's mask, from /proc."""
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return None


def me():
    tid = threading.get_native_id()
    return {"tid": tid, "mask": sorted(os.sched_getaffinity(0)), "status": status_mask(tid)}


def pinned(fn_name, device, pool):
    out = {}

    def body():
        out["rc"] = getattr(lib, fn_name)(device)
        out.update(me())
        if pool:
            barrier = threading.Barrier(pool)

            def task():
                # Every task waits for the others, so the pool really starts `pool` threads.
                barrier.wait(timeout=10)
                return me()

            with ThreadPoolExecutor(max_workers=pool) as ex:
                out["pool"] = [f.result() for f in [ex.submit(task) for _ in range(pool)]]

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configure", type=int)
    ap.add_argument("--step", type=int)
    ap.add_argument("--result", type=int)
    ap.add_argument("--pool", type=int, default=0)
    ap.add_argument("--hold", action="store_true")
    args = ap.parse_args()
    report = {"configure": None, "main": me()}
    if args.configure is not None:
        report["configure"] = lib.tllm_affinity_configure(args.configure)
    if args.step is not None:
        report["step"] = pinned("tllm_affinity_pin_step_thread", args.step, args.pool)
    if args.result is not None:
        report["result"] = pinned("tllm_affinity_pin_result_thread", args.result, args.pool)
    print(json.dumps(report), flush=True)
    if args.hold:
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
