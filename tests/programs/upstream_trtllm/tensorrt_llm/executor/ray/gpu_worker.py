"""Ray's worker, in upstream's shape: ``RayWorkerWrapper`` is a real ``@ray.remote`` actor class;
``setup_distributed_env_and_worker`` builds ``RayGPUWorker`` inside it, whose
``_get_comm_ranks_device_id`` (after two ``all_gather_object``s upstream) calls
``configure_cpu_affinity(self.device_id)``. A sync actor's methods run on the actor process's
main thread; the process serves one GPU.

The device follows upstream: Ray's physical GPU id, ``int(ray.get_gpu_ids()[0])``, mapped to a
local index through ``CUDA_VISIBLE_DEVICES`` when that is set (``physical_to_local_id``);
upstream's comment expects ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (every GPU visible
to each actor), where the physical id is the local index.

The actor's body is ``WorkerWrapperBody``, which the older layout (``ray_gpu_worker.py``) shares:
each layout's ``RayWorkerWrapper`` names its own ``RayGPUWorker`` (``worker_class``)."""
import os

import ray

from ..._release import CONFIGURE_KEYWORD
from ...llmapi.utils import configure_cpu_affinity
from ..base_worker import BaseWorker
from ..executor import GenerationRequest


def physical_to_local_id(physical_id: int) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return physical_id
    ids = [int(d) for d in visible.split(",") if d.strip()]
    return ids.index(physical_id)


class RayGPUWorker(BaseWorker):

    def __init__(self, device_id: int, engine: str, global_rank: int = 0):
        super().__init__(engine)
        self.device_id = device_id
        self.global_rank = global_rank
        self.doing_shutdown = False

    def _get_comm_ranks_device_id(self):
        # torch.distributed.all_gather_object(...) twice upstream: ranks and device ids.
        if CONFIGURE_KEYWORD:
            configure_cpu_affinity(gpu_index=self.device_id)
        else:
            configure_cpu_affinity(self.device_id)
        return [self.global_rank], self.device_id

    def shutdown(self):
        if self.doing_shutdown:
            return
        self.doing_shutdown = True
        super().shutdown()

    def __del__(self):
        self.shutdown()


class WorkerWrapperBody:
    """``RayWorkerWrapper`` but for ``ray.remote`` and the ``RayGPUWorker`` it builds."""

    worker_class = None

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank = rank
        self.world_size = world_size
        self.physical_id = int(ray.get_gpu_ids()[0])
        self.device_id = physical_to_local_id(self.physical_id)
        self.worker = None

    def setup_distributed_env_and_worker(self, engine: str):
        self.worker = self.worker_class(device_id=self.device_id, engine=engine,
                                        global_rank=self.rank)

    def setup_engine(self):
        self.worker.setup_engine()

    def generate(self, prompt: str) -> str:
        self.worker.submit(GenerationRequest(1, prompt))
        return self.worker.engine.await_response(timeout=60).text

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()


@ray.remote
class RayWorkerWrapper(WorkerWrapperBody):
    worker_class = RayGPUWorker
