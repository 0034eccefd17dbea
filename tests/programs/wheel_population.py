"""A mixed population in one Python process, for the wheel tests (tests/process/wheel.rs,
tests/emulated/aarch64.rs): the main thread and a host thread, a worker configured for device 0 and its two
children. It prints what it is as one JSON line, waits for a line on stdin, exits."""
import json, os, sys, threading, tllm_affinity
seen, ready, stop = {}, threading.Barrier(5), threading.Event()
def note(name):
    seen[name] = {"tid": threading.get_native_id(), "role": tllm_affinity.role(),
                  "mask": sorted(os.sched_getaffinity(0))}
def hold(name):
    note(name); ready.wait(); stop.wait()
def worker():
    lease = tllm_affinity.configure(0)
    children = [threading.Thread(target=hold, args=("child%d" % i,)) for i in (1, 2)]
    for c in children: c.start()
    hold("worker")
    for c in children: c.join()
    lease.release()
threads = [threading.Thread(target=hold, args=("host",)), threading.Thread(target=worker)]
for t in threads: t.start()
note("main")
ready.wait()
print(json.dumps({"pid": os.getpid(), "version": tllm_affinity.version(),
                  "library": tllm_affinity.library_path(), "preload": os.environ["LD_PRELOAD"],
                  "threads": seen}), flush=True)
sys.stdin.readline()
stop.set()
for t in threads: t.join()
