"""GenerationExecutorProxy: the client of a worker that runs elsewhere (on an MPI session's rank
0). It submits ``worker_main`` to the session, waits for rank 0's ready, sends requests and
dispatches results on its own thread."""
import queue

from ..llmapi.utils import ManagedThread
from .executor import GenerationExecutor, GenerationRequest
from .ipc import ZeroMqQueue
from .worker import worker_main


class GenerationExecutorProxy(GenerationExecutor):

    def __init__(self, worker_kwargs: dict, model_world_size: int = 1, mpi_session=None):
        super().__init__()
        self.model_world_size = model_world_size
        self.mpi_session = mpi_session
        self.request_queue = ZeroMqQueue()
        self.result_queue = ZeroMqQueue()
        self.worker_init_status_queue = ZeroMqQueue()
        addresses = {
            "request": self.request_queue.address,
            "result": self.result_queue.address,
            "init_status": self.worker_init_status_queue.address,
        }
        self.mpi_futures = self.mpi_session.submit(worker_main, **worker_kwargs,
                                                   worker_queues=addresses)
        status = self.worker_init_status_queue.get()
        if status != "ready":
            raise RuntimeError(f"rank 0 failed to start: {status}")
        self._error_queue = queue.Queue()
        self.dispatch_result_thread = ManagedThread(self.dispatch_result_task,
                                                    error_queue=self._error_queue,
                                                    name="proxy_dispatch_result_thread")
        self.dispatch_result_thread.start()

    def submit(self, request: GenerationRequest):
        self.request_queue.put(request)

    def dispatch_result_task(self) -> bool:
        response = self.result_queue.get()
        if response is None:
            return False
        self._handle_response(response)
        return True

    def shutdown(self):
        if self.request_queue is None:
            return
        self.request_queue.put(None)
        self.dispatch_result_thread.join(30)
        for future in self.mpi_futures:
            future.result(30)
        for q in (self.request_queue, self.result_queue, self.worker_init_status_queue):
            q.close()
        self.request_queue = None
