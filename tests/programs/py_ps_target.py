"""A process for `tllm-affinity ps` to look at: a host thread and a worker thread that configured.

Run under the library with a simulated sysfs tree. Prints one JSON line
  {"pid": p, "main": tid, "host": tid, "worker": tid, "lease": id}
then waits until stdin closes, releases the lease and exits.
"""

import ctypes
import json
import os
import sys
import threading

import tllm_affinity

PR_SET_NAME = 15
libc = ctypes.CDLL(None, use_errno=True)


def name_this_thread(name):
    """The kernel's thread name (comm), which Python 3.11 does not set for threading.Thread."""
    libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0)


def main():
    done = threading.Event()
    tids = {}
    ready = threading.Barrier(3)

    def host():
        name_this_thread("tllm-host")
        tids["host"] = threading.get_native_id()
        ready.wait()
        done.wait()

    def worker():
        name_this_thread("tllm-worker")
        tids["worker"] = threading.get_native_id()
        tids["lease"] = tllm_affinity.configure(0)
        ready.wait()
        done.wait()

    threads = [threading.Thread(target=host), threading.Thread(target=worker)]
    for t in threads:
        t.start()
    ready.wait()
    lease = tids.pop("lease")
    print(json.dumps({"pid": os.getpid(), "main": threading.get_native_id(),
                      "lease": lease.id, **tids}), flush=True)
    sys.stdin.read()
    done.set()
    for t in threads:
        t.join()
    lease.release()


if __name__ == "__main__":
    main()
