"""One process mixed like a real server (tests/process/runtimes.rs): the main thread serves HTTP on
loopback (stdlib ThreadingHTTPServer, a thread per request), while a worker thread imports numpy
(OpenBLAS starts its pool from the importing thread), configures, runs a real OpenMP region
(libgomp starts a pool for the worker thread) and BLAS work, and finally releases.

The main thread ran an OpenMP region of its own before anything else: its pool is the host's.
Requests come from the test (GET /hold/<name>[?omp]); a handler notes its thread, runs an
OpenMP region from it when asked (a pool started by a host thread during the lease), and holds
until the worker lets every held request go at the end.

Phases, each printed by the worker thread after the requests the test sent since the last one
have arrived: before (one request held), configured, lease (a request made during the lease,
with its own OpenMP pool), released, after (a request after release; the worker's pool runs
again). Env: RT_OMP = libopenmp_region.so.2; the test sets OMP_NUM_THREADS and OMP_WAIT_POLICY.
"""
import http.server
import json
import threading

from quiet_http import Arrivals, QuietHandler
from runtime_helpers import LIB, Omp, blas_work, configure, import_numpy, note, phase, release, say

omp = Omp()
seen = Arrivals()
let_go = threading.Event()
answered = threading.Semaphore(0)


class Handler(QuietHandler):
    def do_GET(self):
        path, _, query = self.path.partition("?")
        name = path.rsplit("/", 1)[-1]
        note(name)
        if query == "omp":
            omp.run(f"{name}_omp")
        tid = threading.get_native_id()
        seen.arrived(name, tid)
        let_go.wait(30)
        self.reply(json.dumps({"tid": tid, "role": LIB.tllm_affinity_role(tid)}).encode())
        answered.release()


def worker():
    note("worker")
    numpy, blas = import_numpy("blas")
    say("BLAS", len(blas))
    blas_work(numpy)
    phase("before")
    seen.wait_for("req_before")
    lease = configure(0)
    omp.run("worker_omp")
    blas_work(numpy)
    phase("configured")
    seen.wait_for("req_during")
    phase("lease")
    release(lease)
    phase("released")
    seen.wait_for("req_after")
    omp.run("worker_omp")
    blas_work(numpy)
    phase("after")
    let_go.set()
    for _ in range(len(seen)):
        assert answered.acquire(timeout=30), "a held request was never answered"
    server.shutdown()


note("main")
omp.run("host_omp")
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
say("PORT", server.server_address[1])
threading.Thread(target=worker, name="worker").start()
server.serve_forever(poll_interval=0.05)
server.server_close()
