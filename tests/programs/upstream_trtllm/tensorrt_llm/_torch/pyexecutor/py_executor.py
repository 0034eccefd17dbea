"""PyExecutor, the engine: its executor loop runs on its own thread, started by the thread that
sets the engine up; the loop starts the stats thread at its first request and runs each forward
step on its own intra-op (OpenMP) pool.

With ``RT_ENGINE_LOOP=1`` (scripts/bench --server) the loop steps without pause, like an
in-flight batching engine: each iteration takes every request queued since the last one, runs one
forward step in native code (openmp_region.c's parallel region, called through ctypes, so the GIL is
released while it computes) and answers the batch; ``iterations`` counts the steps."""
import os
import queue
import threading

from ... import _native
from ...executor.executor import GenerationRequest, GenerationResponse
from ...llmapi.utils import get_executor_loop_cpus
from ...logger import logger


class PyExecutor:

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.request_queue = queue.Queue()
        self.response_queue = queue.Queue()
        self.stats_thread = None
        self._stop = threading.Event()
        self.iterations = 0
        self.loop_tid = None
        self.loop_cpus = []
        self.worker_thread = threading.Thread(target=self._event_loop_wrapper,
                                              name="executor_loop",
                                              daemon=True)
        self.worker_thread.start()

    def enqueue_request(self, request: GenerationRequest):
        self.request_queue.put(request)

    def await_response(self, timeout=None) -> GenerationResponse:
        return self.response_queue.get(timeout=timeout)

    def _event_loop_wrapper(self):
        self.loop_tid = threading.get_native_id()
        self.loop_cpus = get_executor_loop_cpus(self.device_id)
        if self.loop_cpus:
            os.sched_setaffinity(0, self.loop_cpus)
            logger.info(f"Executor loop pinned to CPUs {self.loop_cpus}")
        if os.environ.get("RT_ENGINE_LOOP") == "1":
            return self._continuous_loop()
        while (request := self.request_queue.get()) is not None:
            if self.stats_thread is None:
                self.stats_thread = threading.Thread(target=self._stop.wait,
                                                     name="stats_thread",
                                                     daemon=True)
                self.stats_thread.start()
            _native.omp_region("loop_omp")
            total = sum(i * i for i in range(20000))
            self.response_queue.put(GenerationResponse(request.id, f"{request.prompt}:{total}"))

    def _continuous_loop(self):
        stopping = False
        while not stopping:
            batch = []
            while True:
                try:
                    request = self.request_queue.get_nowait()
                except queue.Empty:
                    break
                if request is None:
                    stopping = True
                else:
                    batch.append(request)
            _native.omp_region("loop_omp")
            self.iterations += 1
            for request in batch:
                self.response_queue.put(GenerationResponse(request.id, request.prompt[:32]))

    def shutdown(self):
        self.request_queue.put(None)
        self.worker_thread.join(30)
        self._stop.set()
        if self.stats_thread is not None:
            self.stats_thread.join(30)
