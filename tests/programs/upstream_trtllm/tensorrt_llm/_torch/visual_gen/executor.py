"""VisualGen's worker, in upstream's shape: ``run_diffusion_worker(...)`` is a module-level
function (no ``self``). It sets the distributed environment, computes its device, calls
``configure_cpu_affinity(device_id)`` inside a ``try``/``except`` that logs and goes on, builds
the ``DiffusionExecutor`` (the pipeline loads on its intra-op pool; a post-processing thread hands
images back) and serves the request queue until a shutdown request (``None``), then returns.

It runs in its own process normally; under an external launcher rank 0 runs it on a
``threading.Thread`` inside the client's process (``in_client_process=True``; see client.py).
With ``RT_RESWEEP=1`` it also calls upstream's re-sweep helper once its threads are started. Its
parameters are those of the release ``RT_UPSTREAM_SHAPE`` names (``_release.py``);
``worker_arguments`` is how that release's client calls it."""
import contextlib
import os
import queue
import threading

from tensorrt_llm import _native
from tensorrt_llm._release import CONFIGURE_KEYWORD, SHAPE
from tensorrt_llm.executor.ipc import ZeroMqQueue
from tensorrt_llm.llmapi.utils import (_reapply_current_thread_affinity_to_all_threads,
                                       configure_cpu_affinity, get_device_count)
from tensorrt_llm.logger import logger


class DiffusionExecutor:
    """The worker's executor: denoises each request on the intra-op pool of the thread that
    serves, and posts the image from its post-processing thread."""

    def __init__(self, device_id, request_queue, response_queue):
        self.device_id = device_id
        self.request_queue = request_queue
        self.response_queue = response_queue
        self.images = queue.Queue()
        _native.omp_region("visual_omp")  # loading the pipeline
        self.postprocess_thread = threading.Thread(target=self._postprocess,
                                                   name="visual_gen_postprocess",
                                                   daemon=True)
        self.postprocess_thread.start()

    def serve_forever(self):
        while (job := self.request_queue.get()) is not None:
            _native.omp_region("visual_omp")  # the denoising steps
            self.images.put(job)
        self.images.put(None)
        self.postprocess_thread.join(30)

    def _postprocess(self):
        while (job := self.images.get()) is not None:
            request_id, prompt = job
            self.response_queue.put((request_id, {"prompt": prompt,
                                                  "image": f"<{len(prompt)} denoised>"}))


def _set_distributed_environment(rank, world_size, master_addr, master_port, local_rank):
    """Sets the distributed variables; the worker's device."""
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["MASTER_ADDR"] = str(master_addr)
    os.environ["MASTER_PORT"] = str(master_port)
    return local_rank if local_rank is not None else rank % get_device_count()


@contextlib.contextmanager
def _logged(what):
    """Upstream's ``try``/``except`` around the affinity call: logs and goes on."""
    try:
        yield
    except Exception as e:
        logger.warning(f"{what}: {e}")


def _serve(device_id, request_queue_addr, response_queue_addr):
    """Builds the executor and serves until a shutdown request."""
    request_queue = ZeroMqQueue(request_queue_addr, is_server=False)
    response_queue = ZeroMqQueue(response_queue_addr, is_server=False)
    executor = DiffusionExecutor(device_id, request_queue, response_queue)
    if os.environ.get("RT_RESWEEP") == "1":
        _reapply_current_thread_affinity_to_all_threads()
    response_queue.put("ready")
    try:
        executor.serve_forever()
    finally:
        response_queue.put(None)
        request_queue.close()
        response_queue.close()


# Each release's entry function calls configure_cpu_affinity in its own body, as upstream's does.
if SHAPE == "entry-fewer":

    def run_diffusion_worker(rank,
                             world_size,
                             request_queue_addr,
                             response_queue_addr,
                             visual_gen_args,
                             local_rank=None,
                             in_client_process=False):
        device_id = _set_distributed_environment(rank, world_size, "127.0.0.1", 29500, local_rank)
        with _logged("Failed to configure CPU affinity"):
            configure_cpu_affinity(device_id)
        _serve(device_id, request_queue_addr, response_queue_addr)

elif SHAPE == "entry-more":

    def run_diffusion_worker(rank,
                             local_rank,
                             world_size,
                             dist_backend,
                             master_addr,
                             master_port,
                             request_queue_addr,
                             response_queue_addr,
                             visual_gen_args,
                             log_level="warning",
                             req_hmac_key=None,
                             resp_hmac_key=None,
                             in_client_process=False,
                             parent_pid=None,
                             heartbeat_interval=None):
        device_id = _set_distributed_environment(
            rank, world_size, master_addr, master_port, local_rank)
        with _logged("Failed to configure CPU affinity"):
            configure_cpu_affinity(device_id)
        _serve(device_id, request_queue_addr, response_queue_addr)

elif SHAPE == "entry-renamed":

    def run_diffusion_worker(global_rank,
                             num_ranks,
                             dist_addr,
                             dist_port,
                             req_queue_addr,
                             resp_queue_addr,
                             diffusion_args,
                             local_device=None,
                             in_client_process=False):
        device_id = _set_distributed_environment(
            global_rank, num_ranks, dist_addr, dist_port, local_device)
        with _logged("Failed to configure CPU affinity"):
            configure_cpu_affinity(device_id)
        _serve(device_id, req_queue_addr, resp_queue_addr)

else:

    def run_diffusion_worker(rank,
                             world_size,
                             master_addr,
                             master_port,
                             request_queue_addr,
                             response_queue_addr,
                             visual_gen_args,
                             log_level="warning",
                             req_hmac_key=None,
                             resp_hmac_key=None,
                             local_rank=None,
                             in_client_process=False,
                             parent_pid=None):
        device_id = _set_distributed_environment(
            rank, world_size, master_addr, master_port, local_rank)
        with _logged("Failed to configure CPU affinity"):
            if CONFIGURE_KEYWORD:
                configure_cpu_affinity(gpu_index=device_id)
            else:
                configure_cpu_affinity(device_id)
        _serve(device_id, request_queue_addr, response_queue_addr)


def worker_arguments(rank, world_size, master_addr, master_port, request_queue_addr,
                     response_queue_addr, visual_gen_args, local_rank, parent_pid):
    """The keyword arguments this release's ``run_diffusion_worker`` takes, as its client
    passes them."""
    if SHAPE == "entry-fewer":
        return dict(rank=rank, world_size=world_size, request_queue_addr=request_queue_addr,
                    response_queue_addr=response_queue_addr, visual_gen_args=visual_gen_args,
                    local_rank=local_rank, in_client_process=True)
    if SHAPE == "entry-more":
        return dict(rank=rank, local_rank=local_rank, world_size=world_size,
                    dist_backend="gloo", master_addr=master_addr, master_port=master_port,
                    request_queue_addr=request_queue_addr,
                    response_queue_addr=response_queue_addr, visual_gen_args=visual_gen_args,
                    in_client_process=True, parent_pid=parent_pid, heartbeat_interval=5)
    if SHAPE == "entry-renamed":
        return dict(global_rank=rank, num_ranks=world_size, dist_addr=master_addr,
                    dist_port=master_port, req_queue_addr=request_queue_addr,
                    resp_queue_addr=response_queue_addr, diffusion_args=visual_gen_args,
                    local_device=local_rank, in_client_process=True)
    return dict(rank=rank, world_size=world_size, master_addr=master_addr,
                master_port=master_port, request_queue_addr=request_queue_addr,
                response_queue_addr=response_queue_addr, visual_gen_args=visual_gen_args,
                local_rank=local_rank, in_client_process=True, parent_pid=parent_pid)
