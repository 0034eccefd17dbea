"""GenerationExecutor: requests, results, and ``create``, which builds the worker inline (single
process, TP1) or a proxy over an MPI session whose rank 0 runs ``worker_main``."""
import asyncio
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .._release import NO_SHUTDOWN
from ..llmapi.utils import enable_worker_single_process_for_tp1


@dataclass
class GenerationRequest:
    id: int
    prompt: str


@dataclass
class GenerationResponse:
    id: int
    text: str


class GenerationResult:

    def __init__(self, request: GenerationRequest):
        self.request = request
        self._future = Future()

    def set(self, response: GenerationResponse):
        self._future.set_result(response)

    def result(self, timeout=60) -> GenerationResponse:
        return self._future.result(timeout)

    async def aresult(self) -> GenerationResponse:
        """Upstream's ``await result.aresult()``, what the OpenAI server's async handlers use."""
        return await asyncio.wrap_future(self._future)


class GenerationExecutor:

    def __init__(self):
        self._results = {}
        self._results_lock = threading.Lock()
        self._ids = itertools.count(1)

    def submit(self, request: GenerationRequest):
        raise NotImplementedError

    def generate_async(self, prompt: str) -> GenerationResult:
        result = GenerationResult(GenerationRequest(next(self._ids), prompt))
        with self._results_lock:
            self._results[result.request.id] = result
        self.submit(result.request)
        return result

    def generate(self, prompt: str) -> GenerationResponse:
        return self.generate_async(prompt).result()

    def _handle_response(self, response: GenerationResponse):
        with self._results_lock:
            result = self._results.pop(response.id)
        result.set(response)

    def shutdown(self):
        pass

    @staticmethod
    def create(engine, model_world_size: int = 1, mpi_session=None, **kwargs):
        from .proxy import GenerationExecutorProxy
        from .worker import GenerationExecutorWorker

        worker_kwargs = {"engine": engine}
        if model_world_size == 1 and mpi_session is None and enable_worker_single_process_for_tp1():
            # The user's process is the worker's (gather_generation_logits also lands here).
            worker = GenerationExecutorWorker(**worker_kwargs)
            worker.start()
            return worker
        if mpi_session is None:
            raise NotImplementedError(
                "stand-in: dedicated worker processes (MpiPoolSession) are not simulated; pass "
                "mpi_session= or set TLLM_WORKER_USE_SINGLE_PROCESS=1")
        return GenerationExecutorProxy(worker_kwargs,
                                       model_world_size=model_world_size,
                                       mpi_session=mpi_session)


if NO_SHUTDOWN:
    GenerationExecutor.close = GenerationExecutor.shutdown
    del GenerationExecutor.shutdown
