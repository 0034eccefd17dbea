"""Deployment 1 of seeds/shared-process-affinity-never-restored.txt: a single-process TP1 worker
inside the HTTP server's process (trtllm-serve with TLLM_WORKER_USE_SINGLE_PROCESS=1), shaped
like uvicorn/FastAPI: the main thread runs the asyncio event loop serving HTTP on loopback; sync
endpoint code runs on a host thread pool the loop grows on demand (anyio-like); a background
task holds one pool thread. The executor's thread (started by the server at startup) builds the
worker: setup_engine() configures through the adapter, the engine starts its threads and a real
OpenMP pool; the worker's shutdown releases.

Requests come from the test: GET /generate/<name> runs on a host pool thread, which notes
itself as req_<name>, has the engine answer (or answers itself when the engine is gone), and
holds until the program ends. Phases, printed by the executor thread: before, during (the test
then sends /generate/a), serving, shutdown (the test then sends /generate/b), after.
Env: RT_OMP (libopenmp_region.so.2), PYTHONPATH with the tllm_affinity package.
"""
import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import trtllm_shape
from quiet_http import Arrivals
from runtime_helpers import Omp, note, phase, say
from tllm_affinity.adapters import trtllm

trtllm.install(trtllm_shape, shutdown="shutdown_hook")
omp = Omp()
seen = Arrivals()
let_go = threading.Event()
bg_ready = threading.Event()
engine = {}
handled = []


def background_task():
    note("host_pool0")
    bg_ready.set()
    let_go.wait(60)


def generate(name):
    note(f"req_{name}")
    worker = engine.get("worker")
    answer = worker.generate(name) if worker else {"payload": name, "by": None}
    seen.arrived(name, answer)
    let_go.wait(60)
    return answer


async def handle(reader, writer):
    line = (await reader.readline()).decode()
    while (await reader.readline()).strip():
        pass
    name = line.split()[1].rsplit("/", 1)[-1]
    answer = await asyncio.get_running_loop().run_in_executor(None, generate, name)
    body = json.dumps(answer).encode()
    writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    writer.close()
    handled.append(name)


def executor_main(loop, done):
    note("executor")
    bg_ready.wait(30)
    phase("before")
    worker = trtllm_shape.Worker(0, omp)
    worker.setup_engine()
    engine["worker"] = worker
    phase("during")
    seen.wait_for("a")
    phase("serving")
    del engine["worker"]
    worker.shutdown()
    phase("shutdown")
    seen.wait_for("b")
    phase("after")
    let_go.set()
    loop.call_soon_threadsafe(done.set)


async def main():
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=8, thread_name_prefix="anyio"))
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    say("PORT", server.sockets[0].getsockname()[1])
    loop.run_in_executor(None, background_task)
    done = asyncio.Event()
    executor = threading.Thread(target=executor_main, args=(loop, done), name="executor")
    executor.start()
    await done.wait()
    for _ in range(3000):
        if len(handled) == len(seen):
            break
        await asyncio.sleep(0.01)
    server.close()
    await server.wait_closed()
    await loop.run_in_executor(None, executor.join)


note("main")
asyncio.run(main())
