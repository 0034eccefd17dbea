"""VisualGen's worker, in upstream's shape: ``run_diffusion_worker(...)`` is a module-level
function (no ``self``). It sets the distributed environment, computes its device, calls
``configure_cpu_affinity(device_id)`` inside a ``try``/``except`` that logs and goes on, builds
the ``DiffusionExecutor`` (the pipeline loads on its intra-op pool; a post-processing thread hands
images back) and serves the request queue until a shutdown request (``None``), then returns.

It runs in its own process normally; under an external launcher rank 0 runs it on a
``threading.Thread`` inside the client's process (``in_client_process=True``; see client.py).
With ``RT_RESWEEP=1`` it also calls upstream's re-sweep helper once its threads are started."""
import os
import queue
import threading

from tensorrt_llm import _native
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
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["MASTER_ADDR"] = str(master_addr)
    os.environ["MASTER_PORT"] = str(master_port)
    device_id = local_rank if local_rank is not None else rank % get_device_count()
    try:
        configure_cpu_affinity(device_id)
    except Exception as e:
        logger.warning(f"Failed to configure CPU affinity: {e}")
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
