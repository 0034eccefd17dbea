"""The demo's population: an HTTP server hosting an inference worker in one process.

Host side: the main thread, a ThreadingHTTPServer thread and the per-request threads it makes, an
asyncio loop thread. Worker side: the engine thread that calls configure, its thread pool, and a
thread the pool starts. The table printed at each moment is read from the kernel
(/proc/self/task/<tid>/status), and `tllm-affinity ps` draws the same process from outside.
"""
import asyncio
import ctypes
import http.server
import os
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

LIB = ctypes.CDLL(None)
if not hasattr(LIB, "tllm_affinity_configure"):
    sys.exit("libtllm_affinity.so is not preloaded: run this through scripts/demo")
LIB.tllm_affinity_configure.restype = ctypes.c_int64
LIB.tllm_affinity_release.argtypes = [ctypes.c_int64]
CLI = sys.argv[1] if len(sys.argv) > 1 else None

names = {}


def label(text):
    """Records the thread's label and gives it a kernel name, so `ps` can tell threads apart."""
    names[threading.get_native_id()] = text
    LIB.prctl(15, ctypes.c_char_p(text.split(" (")[0][:15].encode()), 0, 0, 0)  # PR_SET_NAME


label("main (host)")
stop = threading.Event()


def kernel_mask(tid):
    """The thread's mask as the kernel reports it; None once the thread has exited."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    return line.split(":", 1)[1].strip()
    except FileNotFoundError:
        return None
    return "?"


def show(moment):
    print(f"\n== {moment}")
    print(f"  {'thread':<28} {'tid':>7}  {'role':<7} mask")
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        role = {0: "host", 1: "worker"}.get(LIB.tllm_affinity_role(tid), "unknown")
        mask = kernel_mask(tid)
        if mask is None:
            continue  # a request thread that ended while the table was being read
        print(f"  {names.get(tid, '(runtime thread)'):<28} {tid:>7}  {role:<7} {mask}")
    sys.stdout.flush()


def named(text, target):
    def run():
        label(text)
        target()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        label(f"request {self.path} (host)")
        arrived.set()
        held.wait()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, *args):
        pass


held = threading.Event()
arrived = threading.Event()
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
named("http server (host)", server.serve_forever)
named("event loop (host)", lambda: asyncio.new_event_loop().run_until_complete(asyncio.sleep(3600)))


def request(path):
    """Sends a request from a worker thread and returns once the server's request thread is
    born and labelled (a table read before would show it half-born), with the reply's event."""
    done = threading.Event()
    arrived.clear()

    def get():
        label("http client (worker)")
        urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}{path}").read()
        done.set()

    threading.Thread(target=get, daemon=True).start()
    arrived.wait()
    return done


def engine():
    label("engine (worker)")
    show("before configure: nothing moved")
    lease = LIB.tllm_affinity_configure(0)
    pool = ThreadPoolExecutor(max_workers=2)
    ready = threading.Barrier(3)

    def task(i):
        label(f"engine pool {i} (worker)")
        if i == 0:
            named("started by the pool (worker)", stop.wait)
        ready.wait()

    futures = [pool.submit(task, i) for i in range(2)]
    ready.wait()
    [f.result() for f in futures]
    pending = request("/during")
    show(f"during the lease (lease {lease}): worker threads on the GPU-local CPUs, host threads untouched")
    if CLI:
        print("\n== tllm-affinity ps (the same process, seen from outside)", flush=True)
        subprocess.run([CLI, "ps", str(os.getpid())], check=False)
    held.set()
    pending.wait()
    LIB.tllm_affinity_release(lease)
    show("after release: every mask the library changed is back")
    pool.shutdown()
    stop.set()


t = threading.Thread(target=engine)
t.start()
t.join()
server.shutdown()
