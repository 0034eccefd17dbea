"""A shape-alike of TensorRT-LLM's worker plumbing for the deployment programs
(tests/programs/deploy_*.py, tests/process/deployments.rs): no inference, the same threads.

`Worker.setup_engine()` runs on the thread that owns the worker (base_worker.py): it calls this
module's `configure_cpu_affinity(device_id)` and starts the engine's threads (the executor loop
and the await-response thread), optionally a real OpenMP pool (torch's intra-op pool is
OpenMP). `Worker.shutdown()` stops the engine threads, then calls `shutdown_hook()`.

`MpiSession` is an MPI session's own two-thread pool: rank 0's `worker_main` on one thread, the
session's own work on the other.

`configure_cpu_affinity` here is the server's old function: one sweep that pins every thread of
the process and never restores (seeds/shared-process-affinity-never-restored.txt). The programs
replace it with `tllm_affinity.adapters.trtllm.install(trtllm_shape, shutdown="shutdown_hook")`,
which configures the calling thread's lease and releases it after the shutdown hook; should the
adapter ever not be in place, the old sweep pins the host threads and the tests fail.
"""
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from runtime_helpers import LIB, note


def configure_cpu_affinity(device_id):
    """The old behaviour: every tid of the process onto one CPU."""
    cpu = max(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass


def shutdown_hook():
    """Where the worker's shutdown ends; the adapter releases its leases after it."""


def whoami():
    tid = threading.get_native_id()
    return {"tid": tid, "role": LIB.tllm_affinity_role(tid)}


class Worker:
    def __init__(self, device_id, omp=None):
        self.device_id = device_id
        self.omp = omp
        self.requests = queue.Queue()
        self.responses = queue.Queue()
        self.pending = {}
        self.lock = threading.Lock()
        self.threads = []

    def setup_engine(self):
        configure_cpu_affinity(self.device_id)
        for name, target in (("executor_loop", self._loop), ("await_response", self._await)):
            ready = threading.Event()

            def run(name=name, target=target, ready=ready):
                note(name)
                ready.set()
                target()

            t = threading.Thread(target=run, name=name)
            t.start()
            ready.wait()
            self.threads.append(t)
        if self.omp is not None:
            self.omp.run("engine_omp")

    def _loop(self):
        """The executor loop: runs each request (real work) and hands the answer on."""
        while True:
            item = self.requests.get()
            if item is None:
                self.responses.put(None)
                return
            rid, payload = item
            total = sum(i * i for i in range(20000))
            self.responses.put((rid, {"payload": payload, "total": total, "by": whoami()}))

    def _await(self):
        """The await-response thread: completes the caller's future."""
        while True:
            item = self.responses.get()
            if item is None:
                return
            rid, answer = item
            with self.lock:
                box = self.pending.pop(rid)
            box.put(answer)

    def generate(self, payload):
        """Blocking, from any thread: the engine's answer (who ran it included)."""
        box = queue.Queue(1)
        rid = id(box)
        with self.lock:
            self.pending[rid] = box
        self.requests.put((rid, payload))
        return box.get(timeout=30)

    def shutdown(self):
        self.requests.put(None)
        for t in self.threads:
            t.join(30)
        shutdown_hook()


class MpiSession(ThreadPoolExecutor):
    """The session's two-thread pool, its threads named `<prefix>_0` and `<prefix>_1`. `start`
    runs rank 0's `worker_main` on one (which builds its worker with `rank0_worker` and sets
    `worker_ready` once it serves), and the session's own work on the other (noted
    session_pool1), busy until `hold` is set."""

    def __init__(self, thread_name_prefix):
        super().__init__(max_workers=2, thread_name_prefix=thread_name_prefix)
        self.worker_ready = threading.Event()
        self.hold = threading.Event()
        self._busy = threading.Event()

    def rank0_worker(self, name):
        """From `worker_main` on its pool thread: notes that thread as `name` and builds rank 0's
        worker (its setup_engine configures)."""
        note(name)
        worker = Worker(0)
        worker.setup_engine()
        return worker

    def _session_task(self):
        note("session_pool1")
        self._busy.set()
        self.hold.wait(60)

    def start(self, worker_main):
        """`worker_main`'s future, once it is ready and the session's own work runs."""
        rank0 = self.submit(worker_main)
        self.submit(self._session_task)
        assert self.worker_ready.wait(30) and self._busy.wait(30)
        return rank0
