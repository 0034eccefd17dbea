"""BaseWorker: ``setup_engine`` runs on the thread that builds the worker; it configures CPU
affinity (``_get_comm_ranks_device_id``), then the engine starts its threads, and the newer
upstream's re-sweep spreads the caller's mask over the threads started since."""
from .. import _native
from .._release import CONFIGURE_KEYWORD, NO_SHUTDOWN
from .._torch.pyexecutor.py_executor import PyExecutor
from .._utils import global_mpi_rank
from ..llmapi.utils import (_reapply_current_thread_affinity_to_all_threads,
                            configure_cpu_affinity, get_device_count)
from .executor import GenerationExecutor, GenerationRequest


class BaseWorker(GenerationExecutor):

    def __init__(self, engine: str):
        super().__init__()
        self._engine_name = engine
        self.global_rank = global_mpi_rank()
        self.device_id = None
        self.engine = None

    def _get_comm_ranks_device_id(self):
        device_id = self.global_rank % get_device_count()
        # torch.cuda.set_device(device_id)
        if CONFIGURE_KEYWORD:
            configure_cpu_affinity(gpu_index=device_id)
        else:
            configure_cpu_affinity(device_id)
        return [self.global_rank], device_id

    def setup_engine(self):
        _, self.device_id = self._get_comm_ranks_device_id()
        # Loading the model: torch's intra-op pool starts on this thread; NCCL's communicator.
        _native.omp_region("engine_omp")
        _native.progress_thread("nccl_progress")
        self.engine = PyExecutor(self.device_id)
        _reapply_current_thread_affinity_to_all_threads()

    def submit(self, request: GenerationRequest):
        self.engine.enqueue_request(request)

    def shutdown(self):
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


if NO_SHUTDOWN:
    BaseWorker.close = BaseWorker.shutdown
    del BaseWorker.shutdown
