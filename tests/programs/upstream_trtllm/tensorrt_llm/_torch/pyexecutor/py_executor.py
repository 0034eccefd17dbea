"""PyExecutor, the engine: its executor loop runs on its own thread, started by the thread that
sets the engine up; the loop starts the stats thread at its first request and runs each forward
step on its own intra-op (OpenMP) pool."""
import queue
import threading

from ... import _native
from ...executor.executor import GenerationRequest, GenerationResponse


class PyExecutor:

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.request_queue = queue.Queue()
        self.response_queue = queue.Queue()
        self.stats_thread = None
        self._stop = threading.Event()
        self.worker_thread = threading.Thread(target=self._event_loop_wrapper,
                                              name="executor_loop",
                                              daemon=True)
        self.worker_thread.start()

    def enqueue_request(self, request: GenerationRequest):
        self.request_queue.put(request)

    def await_response(self, timeout=None) -> GenerationResponse:
        return self.response_queue.get(timeout=timeout)

    def _event_loop_wrapper(self):
        while (request := self.request_queue.get()) is not None:
            if self.stats_thread is None:
                self.stats_thread = threading.Thread(target=self._stop.wait,
                                                     name="stats_thread",
                                                     daemon=True)
                self.stats_thread.start()
            _native.omp_region("loop_omp")
            total = sum(i * i for i in range(20000))
            self.response_queue.put(GenerationResponse(request.id, f"{request.prompt}:{total}"))

    def shutdown(self):
        self.request_queue.put(None)
        self.worker_thread.join(30)
        self._stop.set()
        if self.stats_thread is not None:
            self.stats_thread.join(30)
