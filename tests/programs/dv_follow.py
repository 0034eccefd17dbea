"""The device variables set after load (tests/process/device_variables.rs). Steps come from argv, each a
word; after each the program prints `PHASE <step> <thread>=<tid>:<role> ...` for its threads and
waits for a line on stdin. Threads `a` and `b` live throughout; `a` makes the assignments (so they
come from a thread other than the main one, as Ray's do), a thread `late_<n>` is started after
each step.

  set:NAME=VALUE   os.environ[NAME] = VALUE (libc setenv)
  del:NAME         del os.environ[NAME] (libc unsetenv)
  configure:N      tllm_affinity.configure(N) on thread `a`; prints `LEASE <id>`
  release          releases every lease this program holds (the load-time one included)
"""
import os
import sys
import threading

import tllm_affinity

ROLE = {"host": 0, "worker": 1, None: -1}
threads = {"main": threading.get_native_id()}
todo = {}
done = threading.Event()
quit_all = threading.Event()
leases = []


def worker(name):
    threads[name] = threading.get_native_id()
    if name == "a":
        while not quit_all.is_set():
            job = todo.pop("job", None)
            if job is None:
                threading.Event().wait(0.005)
                continue
            job()
            done.set()
    else:
        quit_all.wait()


for name in ("a", "b"):
    threading.Thread(target=worker, args=(name,), daemon=True).start()
while len(threads) < 3:
    threading.Event().wait(0.005)


def phase(step):
    words = " ".join(
        "%s=%d:%d" % (n, tid, ROLE[tllm_affinity.role(tid)]) for n, tid in threads.items()
    )
    print("PHASE", step, words, flush=True)
    sys.stdin.readline()


def on_a(job):
    done.clear()
    todo["job"] = job
    done.wait()


phase("load")
for n, step in enumerate(sys.argv[1:]):
    verb, _, arg = step.partition(":")
    if verb == "set":
        name, _, value = arg.partition("=")
        on_a(lambda: os.environ.__setitem__(name, value))
    elif verb == "del":
        on_a(lambda: os.environ.__delitem__(arg))
    elif verb == "configure":
        def configure():
            lease = tllm_affinity.configure(int(arg))
            leases.append(lease)
            print("LEASE", lease.id, flush=True)
        on_a(configure)
    elif verb == "release":
        for lease in leases:
            lease.release()
        for lease in tllm_affinity.report()["leases"]:
            tllm_affinity.release(lease["id"])
    late = "late_%d" % n
    threading.Thread(target=worker, args=(late,), daemon=True).start()
    while late not in threads:
        threading.Event().wait(0.005)
    phase(step)
quit_all.set()
print("DONE", flush=True)
