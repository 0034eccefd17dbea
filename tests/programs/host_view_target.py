"""A server-shaped process for `tllm-affinity ps` without a PID: a host thread, and as asked a
worker thread that configured for a GPU and step and result threads that pinned themselves.

Run under the library. Options:
  --gpu DEV     a worker thread configures for DEV (opens a lease)
  --step DEV    a thread pins itself as DEV's step thread
  --result DEV  a thread pins itself as DEV's result thread
  --explicit    a thread sets its own mask (sched_setaffinity, which the library sees): its
                placement is the application's, "explicit"
  --external DEV  a thread configures for DEV, its mask is changed behind the library's back (a
                raw syscall, as another process's `taskset -p` would), then it releases its
                lease: the library keeps the mask it finds, "external"
Prints one JSON line
  {"pid": p, "host": tid, "worker": tid, "step": tid, "result": tid, "rc": {...}}
(only the threads asked for), then waits until stdin closes and exits.
"""

import argparse
import ctypes
import json
import os
import sys
import threading

lib = ctypes.CDLL(None)
for name in ("tllm_affinity_pin_step_thread", "tllm_affinity_pin_result_thread"):
    getattr(lib, name).restype = ctypes.c_int32
    getattr(lib, name).argtypes = [ctypes.c_int32]
lib.tllm_affinity_configure.restype = ctypes.c_int64
lib.tllm_affinity_configure.argtypes = [ctypes.c_int32]
lib.tllm_affinity_release.restype = ctypes.c_int32
lib.tllm_affinity_release.argtypes = [ctypes.c_int64]
lib.syscall.restype = ctypes.c_long
SYS_SCHED_SETAFFINITY = {"x86_64": 203, "aarch64": 122}[os.uname().machine]


def one_cpu():
    """The lowest CPU this thread may run on."""
    return min(os.sched_getaffinity(0))


def explicit():
    os.sched_setaffinity(0, {one_cpu()})
    return 0


def external(device):
    lease = lib.tllm_affinity_configure(device)
    if lease < 0:
        return lease
    # Another of the process's CPUs than its worker set's, set not through libc's
    # sched_setaffinity: the library does not see this change.
    others = os.sched_getaffinity(os.getpid()) - os.sched_getaffinity(0)
    mask = ctypes.c_uint64(1 << min(others or {one_cpu()}))
    if lib.syscall(SYS_SCHED_SETAFFINITY, 0, ctypes.c_size_t(8), ctypes.byref(mask)) != 0:
        return -ctypes.get_errno() or -1
    return lib.tllm_affinity_release(lease)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int)
    ap.add_argument("--step", type=int)
    ap.add_argument("--result", type=int)
    ap.add_argument("--explicit", action="store_true")
    ap.add_argument("--external", type=int)
    args = ap.parse_args()
    done = threading.Event()
    tids, rc = {}, {}
    bodies = {"host": lambda: 0}
    if args.gpu is not None:
        bodies["worker"] = lambda: lib.tllm_affinity_configure(args.gpu)
    if args.step is not None:
        bodies["step"] = lambda: lib.tllm_affinity_pin_step_thread(args.step)
    if args.result is not None:
        bodies["result"] = lambda: lib.tllm_affinity_pin_result_thread(args.result)
    if args.explicit:
        bodies["explicit"] = explicit
    if args.external is not None:
        bodies["external"] = lambda: external(args.external)
    ready = threading.Barrier(len(bodies) + 1)

    def thread(name, body):
        tids[name] = threading.get_native_id()
        rc[name] = body()
        ready.wait()
        done.wait()

    threads = [threading.Thread(target=thread, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    ready.wait()
    print(json.dumps({"pid": os.getpid(), "rc": rc, **tids}), flush=True)
    sys.stdin.read()
    done.set()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
