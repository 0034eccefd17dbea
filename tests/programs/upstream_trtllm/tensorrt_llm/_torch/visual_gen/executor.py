"""VisualGen, external launch, rank 0 in the client's process (``in_client_process``): the
executor starts the ``_serve_forever`` coordinator thread (its own asyncio loop and socket
server; ZMQ upstream) *before* the worker thread, which configures CPU affinity and then denoises
on its own intra-op pool, handing images to its post-processing thread."""
import asyncio
import json
import queue
import socket
import threading

from tensorrt_llm import _native
from tensorrt_llm.llmapi.utils import configure_cpu_affinity


class DiffusionExecutor:

    def __init__(self, device_id: int = 0, in_client_process: bool = True):
        self.device_id = device_id
        self.in_client_process = in_client_process
        self.jobs = queue.Queue()
        self.images = queue.Queue()
        self.address = None
        self._loop = None
        self._stopping = None
        self._coordinator_ready = threading.Event()
        self._worker_ready = threading.Event()
        self.coordinator_thread = threading.Thread(target=self._serve_forever,
                                                   name="visual_gen_coordinator",
                                                   daemon=True)
        self.coordinator_thread.start()
        self._coordinator_ready.wait(30)
        self.worker_thread = threading.Thread(target=self._worker_main,
                                              name="visual_gen_worker",
                                              daemon=True)
        self.worker_thread.start()
        self._worker_ready.wait(30)

    # The coordinator.

    def _serve_forever(self):
        asyncio.run(self._coordinate())

    async def _coordinate(self):
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = server.sockets[0].getsockname()[:2]
        self._coordinator_ready.set()
        await self._stopping.wait()
        server.close()
        await server.wait_closed()

    async def _handle(self, reader, writer):
        prompt = (await reader.readline()).decode().strip()
        # The wait for the worker is blocking: on the loop's executor.
        image = await self._loop.run_in_executor(None, self._relay, prompt)
        writer.write(json.dumps(image).encode() + b"\n")
        await writer.drain()
        writer.close()

    def _relay(self, prompt):
        box = queue.Queue(1)
        self.jobs.put((prompt, box))
        return box.get(timeout=60)

    # The worker thread.

    def _worker_main(self):
        configure_cpu_affinity(self.device_id)
        _native.omp_region("visual_omp")  # loading the pipeline
        self.postprocess_thread = threading.Thread(target=self._postprocess,
                                                   name="visual_gen_postprocess",
                                                   daemon=True)
        self.postprocess_thread.start()
        self._worker_ready.set()
        while (job := self.jobs.get()) is not None:
            _native.omp_region("visual_omp")  # the denoising steps
            self.images.put(job)
        self.images.put(None)
        self.postprocess_thread.join(30)

    def _postprocess(self):
        while (job := self.images.get()) is not None:
            prompt, box = job
            box.put({"prompt": prompt, "image": f"<{len(prompt)} denoised>"})

    # The client's API.

    def generate(self, prompt: str) -> dict:
        with socket.create_connection(self.address, timeout=60) as s:
            s.sendall(prompt.encode() + b"\n")
            return json.loads(s.makefile().readline())

    def shutdown(self):
        if self.worker_thread.is_alive():
            self.jobs.put(None)
            self.worker_thread.join(30)
        if self.coordinator_thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self.coordinator_thread.join(30)
