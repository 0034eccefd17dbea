"""GenerationExecutorWorker (``__init__`` sets up the engine; ``start`` starts the
await-response thread) and ``worker_main``, what each rank of an MPI session runs."""
import queue

from .._release import NO_SHUTDOWN, stop
from ..llmapi.utils import ManagedThread
from .base_worker import BaseWorker
from .ipc import ZeroMqQueue


class GenerationExecutorWorker(BaseWorker):

    def __init__(self, engine: str, result_queue=None):
        super().__init__(engine)
        self.result_queue = result_queue
        self._error_queue = queue.Queue()
        self.setup_engine()
        self.await_response_thread = ManagedThread(self.await_response_task,
                                                   error_queue=self._error_queue,
                                                   name="await_response_thread")

    def start(self):
        self.await_response_thread.start()

    def await_response_task(self) -> bool:
        try:
            response = self.engine.await_response(timeout=0.05)
        except queue.Empty:
            return True
        if self.result_queue is not None:
            self.result_queue.put(response)
        else:
            self._handle_response(response)
        return True

    def shutdown(self):
        if self.await_response_thread.is_alive():
            self.await_response_thread.stop()
            self.await_response_thread.join(30)
        stop(super())


def worker_main(engine: str, worker_queues: dict) -> None:
    """Rank 0: builds the worker, reports ready, serves the proxy's requests until None, shuts
    the worker down."""
    request_queue = ZeroMqQueue(worker_queues["request"], is_server=False)
    result_queue = ZeroMqQueue(worker_queues["result"], is_server=False)
    status_queue = ZeroMqQueue(worker_queues["init_status"], is_server=False)
    worker = GenerationExecutorWorker(engine, result_queue=result_queue)
    worker.start()
    status_queue.put("ready")
    while (request := request_queue.get()) is not None:
        worker.submit(request)
    stop(worker)
    result_queue.put(None)
    for q in (request_queue, result_queue, status_queue):
        q.close()


if NO_SHUTDOWN:
    GenerationExecutorWorker.close = GenerationExecutorWorker.shutdown
    del GenerationExecutorWorker.shutdown
