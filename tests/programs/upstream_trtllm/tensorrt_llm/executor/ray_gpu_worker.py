"""Ray's worker in upstream's older layout (before configure_cpu_affinity moved into
``llmapi.utils``): the same ``RayWorkerWrapper`` actor and ``RayGPUWorker``, but
``RayGPUWorker.__init__`` sets its engine up itself (RPC off), and ``_get_comm_ranks_device_id``
calls the worker's own method ``self._configure_affinity(self.device_id)``, which pins every
thread of the process (one ``/proc/self/task`` snapshot) to the GPU's NUMA-local CPUs and
restores nothing. The actor's body is the current layout's (``WorkerWrapperBody``)."""
import os

import ray

from .. import _native
from .._torch.pyexecutor.py_executor import PyExecutor
from ..llmapi.utils import get_numa_aware_cpu_affinity
from .executor import GenerationExecutor, GenerationRequest
from .ray.gpu_worker import WorkerWrapperBody


class RayGPUWorker(GenerationExecutor):

    def __init__(self, device_id: int, engine: str, global_rank: int = 0):
        super().__init__()
        self.device_id = device_id
        self.global_rank = global_rank
        self.engine = None
        self.doing_shutdown = False
        # Without RPC the worker sets its engine up at construction.
        self.setup_engine()

    def _configure_affinity(self, device_id):
        cpus = get_numa_aware_cpu_affinity(device_id)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass  # exited meanwhile

    def _get_comm_ranks_device_id(self):
        self._configure_affinity(self.device_id)
        return [self.global_rank], self.device_id

    def setup_engine(self):
        _, self.device_id = self._get_comm_ranks_device_id()
        _native.omp_region("engine_omp")
        self.engine = PyExecutor(self.device_id)

    def submit(self, request: GenerationRequest):
        self.engine.enqueue_request(request)

    def shutdown(self):
        if self.doing_shutdown:
            return
        self.doing_shutdown = True
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def __del__(self):
        self.shutdown()


@ray.remote
class RayWorkerWrapper(WorkerWrapperBody):
    worker_class = RayGPUWorker

    def setup_engine(self):
        pass  # done at construction in this layout
