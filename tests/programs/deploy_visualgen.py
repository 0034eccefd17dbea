"""Deployment 3 of seeds/shared-process-affinity-never-restored.txt: external-launch VisualGen,
rank 0, under an HTTP server. The main thread serves HTTP on loopback (a thread per request);
the _serve_forever coordinator thread, started before the worker thread, runs its own asyncio
loop with a loopback socket server (ZMQ in the server) and hands blocking waits to its loop's
executor; then the worker thread builds the diffusion worker (setup_engine configures through
the adapter) and denoises on a real OpenMP pool.

A request: GET /generate/<name> (from the test) → the request thread (req_<name>) sends it over
loopback TCP to the coordinator → the coordinator queues it for the worker and waits for the
answer on a thread of its executor (coord_pool) → the worker denoises (OpenMP) → the answer
goes back the same way. The request thread holds until the program ends.

Phases, printed by the worker thread: before, during (the test then sends /generate/a),
serving, shutdown (the worker shut down and released; it lives on, idle), after (a request
answered by the coordinator alone). Env: RT_OMP, PYTHONPATH with the tllm_affinity package.
"""
import asyncio
import http.server
import json
import queue
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import trtllm_shape
from quiet_http import Arrivals, QuietHandler
from runtime_helpers import Omp, note, phase, say
from tllm_affinity.adapters import trtllm

trtllm.install(trtllm_shape, shutdown="shutdown_hook")
omp = Omp()
jobs = queue.Queue()
answers = queue.Queue()
seen = Arrivals()
let_go = threading.Event()
coordinator_port = []
coordinator_up = threading.Event()
worker_live = threading.Event()


def serve_forever():
    """The coordinator: its own event loop and socket server."""
    note("coordinator")

    def wait_answer(name):
        note(f"coord_pool_{name}")
        return answers.get(timeout=30)

    async def handle(reader, writer):
        name = (await reader.readline()).decode().strip()
        loop = asyncio.get_running_loop()
        if worker_live.is_set():
            jobs.put(name)
            answer = await loop.run_in_executor(None, wait_answer, name)
        else:
            answer = {"payload": name, "by": None}
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
        writer.close()

    def housekeeping():
        note("coord_pool0")
        coordinator_up.set()
        let_go.wait(60)

    async def main():
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=4, thread_name_prefix="coordinator")
        )
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        coordinator_port.append(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, housekeeping)
        server.close()

    asyncio.run(main())


class Handler(QuietHandler):
    def do_GET(self):
        name = self.path.rsplit("/", 1)[-1]
        note(f"req_{name}")
        with socket.create_connection(("127.0.0.1", coordinator_port[0]), timeout=30) as s:
            s.sendall(name.encode() + b"\n")
            answer = s.makefile().readline()
        seen.arrived(name, answer)
        let_go.wait(60)
        self.reply(answer.encode())


def worker_thread():
    note("worker")
    phase("before")
    worker = trtllm_shape.Worker(0, omp)
    worker.setup_engine()
    worker_live.set()
    phase("during")

    def denoise():
        name = jobs.get(timeout=30)
        omp.run("engine_omp")
        answers.put({"payload": name, "by": trtllm_shape.whoami()})

    denoise()
    seen.wait_for("a")
    phase("serving")
    worker_live.clear()
    worker.shutdown()
    phase("shutdown")
    seen.wait_for("b")
    phase("after")
    let_go.set()
    server.shutdown()


note("main")
coordinator = threading.Thread(target=serve_forever, name="coordinator")
coordinator.start()
assert coordinator_up.wait(30)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = False
say("PORT", server.server_address[1])
threading.Thread(target=worker_thread, name="worker").start()
server.serve_forever(poll_interval=0.05)
server.server_close()
coordinator.join(30)
