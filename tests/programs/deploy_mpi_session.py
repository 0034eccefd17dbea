"""Deployment 2 of seeds/shared-process-affinity-never-restored.txt: an externally supplied
MpiCommSession, rank 0. The user's script owns the process: its main thread runs the user's
asyncio event loop (with the loop's default executor), the proxy's dispatch and result threads
(ZMQ in the server; plain threads and queues here) carry requests and answers, and the
session's own two-thread pool runs rank 0's worker_main on one thread while the other serves
the session. worker_main builds the worker (setup_engine configures through the adapter),
serves the proxy's requests, and shuts the worker down (the adapter releases) when the script
says so.

Phases, printed by the script's main thread: before (the script's threads, before the session
runs anything), during (worker_main configured), serving (a request went through the proxy,
and the user's loop grew its executor during the lease), shutdown (worker_main returned; its
pool thread lives on, idle), after (the session pool and the user's loop run more work).
Env: PYTHONPATH with the tllm_affinity package.
"""
import asyncio
import queue
from concurrent.futures import ThreadPoolExecutor

import trtllm_shape
from runtime_helpers import note, phase, start, stop
from tllm_affinity.adapters import trtllm

trtllm.install(trtllm_shape, shutdown="shutdown_hook")

to_worker = queue.Queue()  # the proxy's dispatch socket
from_worker = queue.Queue()  # the proxy's result socket
user_requests = queue.Queue()
session = trtllm_shape.MpiSession("mpi_session")


def worker_main():
    """Rank 0's worker, on the session's pool."""
    worker = session.rank0_worker("session_worker")
    session.worker_ready.set()
    while True:
        item = to_worker.get()
        if item is None:
            break
        from_worker.put(worker.generate(item))
    worker.shutdown()
    return "worker_main done"


def dispatch():
    while True:
        item = user_requests.get()
        to_worker.put(item)
        if item is None:
            return


def results(loop, answers):
    while True:
        item = from_worker.get()
        loop.call_soon_threadsafe(answers.put_nowait, item)


def user_work(name, wait=False):
    note(name)
    if wait:
        session.hold.wait(60)
    return name


async def script():
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=4, thread_name_prefix="user"))
    await loop.run_in_executor(None, user_work, "user_pool0")
    start("proxy_dispatch", dispatch)
    answers = asyncio.Queue()
    start("proxy_result", lambda: results(loop, answers))
    phase("before")

    rank0 = session.start(worker_main)
    phase("during")

    user_requests.put("prompt")
    answer = await asyncio.wait_for(answers.get(), 30)
    assert answer["by"]["role"] == 1, answer
    # The user's loop runs two blocking calls at once: its executor grows during the lease.
    held = loop.run_in_executor(None, user_work, "user_pool_held", True)
    await loop.run_in_executor(None, user_work, "user_pool_grown")
    phase("serving")

    user_requests.put(None)
    assert rank0.result(30) == "worker_main done"
    phase("shutdown")

    session.hold.set()
    await held
    session.submit(note, "session_after").result(30)
    await loop.run_in_executor(None, user_work, "user_after")
    phase("after")
    session.shutdown()
    stop.set()


note("main")
asyncio.run(script())
