"""The VisualGen client of an external launch (torchrun, srun), rank 0: its process serves the
clients over its ``_serve_forever`` coordinator thread (its own asyncio loop and socket server;
ZMQ upstream), started *first*; then rank 0's worker, ``executor.run_diffusion_worker``, runs on
a ``threading.Thread`` inside this process (``in_client_process=True``)."""
import asyncio
import itertools
import json
import os
import socket
import threading

from tensorrt_llm.executor.ipc import ZeroMqQueue

from .executor import run_diffusion_worker, worker_arguments


class DiffusionRemoteClient:

    def __init__(self, visual_gen_args=None, device_id: int = 0):
        self.request_queue = ZeroMqQueue()
        self.response_queue = ZeroMqQueue()
        self.address = None
        self._loop = None
        self._stopping = None
        self._ids = itertools.count(1)
        self._relay_lock = threading.Lock()
        self._coordinator_ready = threading.Event()
        self.coordinator_thread = threading.Thread(target=self._serve_forever,
                                                   name="visual_gen_coordinator",
                                                   daemon=True)
        self.coordinator_thread.start()
        self._coordinator_ready.wait(30)
        self.worker_thread = threading.Thread(
            target=run_diffusion_worker,
            kwargs=worker_arguments(rank=0,
                                    world_size=1,
                                    master_addr="127.0.0.1",
                                    master_port=29500,
                                    request_queue_addr=self.request_queue.address,
                                    response_queue_addr=self.response_queue.address,
                                    visual_gen_args=visual_gen_args or {},
                                    local_rank=device_id,
                                    parent_pid=os.getpid()),
            name="visual_gen_worker",
            daemon=True)
        self.worker_thread.start()
        ready = self.response_queue.get()
        if ready != "ready":
            raise RuntimeError(f"the VisualGen worker did not start: {ready!r}")

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
        with self._relay_lock:
            request_id = next(self._ids)
            self.request_queue.put((request_id, prompt))
            answered, image = self.response_queue.get()
            assert answered == request_id, (answered, request_id)
            return image

    # The client's API.

    def generate(self, prompt: str) -> dict:
        with socket.create_connection(self.address, timeout=60) as s:
            s.sendall(prompt.encode() + b"\n")
            return json.loads(s.makefile().readline())

    def shutdown(self):
        if self.worker_thread.is_alive():
            self.request_queue.put(None)
            self.worker_thread.join(30)
        if self.coordinator_thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self.coordinator_thread.join(30)
        for q in (self.request_queue, self.response_queue):
            q.close()
