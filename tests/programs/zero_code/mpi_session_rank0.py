"""Deployment 2 of seeds/shared-process-affinity-never-restored.txt as an unmodified app: an
externally supplied MpiCommSession, rank 0. The user's script owns the process: its main thread
and its event-loop thread (user_loop, whose default executor threads are asyncio_N) were there
first; the script builds ``MpiCommSession(n_workers=2)`` and ``LLM(..., mpi_session=session)``,
whose proxy (dispatch thread) submits ``worker_main``: rank 0's worker runs on the session's
first pool thread. The script uses the LLM from its loop while a blocking call holds the loop's
first executor thread (the executor grows during the lease), and runs a task of its own on the
session (its second pool thread), then shuts the LLM down and goes on using both.

Phases, printed by the main thread: before (no session), during (LLM built), serving (the
user's requests answered), shutdown (LLM shut down: worker_main returned, its pool thread lives
on, idle), after (the session and the loop ran more work). Imports only tensorrt_llm and the
test instrumentation.
"""
import asyncio
import os
import threading

from phases import note, phase_all
from runtime_helpers import say
from tensorrt_llm import LLM
from tensorrt_llm.llmapi import MpiCommSession

loop = asyncio.new_event_loop()
hold = threading.Event()
holding = threading.Event()


def on_loop(coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


def user_work(name, wait=False):
    note(name)
    if wait:
        holding.set()
        hold.wait(60)
    return name


async def in_executor(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def finished(future):
    return await future


threading.Thread(target=loop.run_forever, name="user_loop", daemon=True).start()
on_loop(in_executor(user_work, "user_pool0"))
phase_all("before")

session = MpiCommSession(n_workers=2)
llm = LLM("stand-in/tp2", tensor_parallel_size=2, mpi_session=session)
phase_all("during")


async def serve():
    held = asyncio.ensure_future(in_executor(user_work, "user_pool_held", True))
    while not holding.is_set():  # the blocking call holds the executor's idle thread
        await asyncio.sleep(0.01)
    text = await in_executor(lambda: (note("user_pool_grown"), llm.generate("prompt"))[1])
    return held, text.outputs[0].text


held, text = on_loop(serve())
say("ANSWER", text)
say("SESSION", session.submit_sync(os.getpid))
phase_all("serving")

llm.shutdown()
phase_all("shutdown")

hold.set()
on_loop(finished(held))
say("SESSION", session.submit_sync(os.getpid))
on_loop(in_executor(user_work, "user_after"))
phase_all("after")
session.shutdown()
loop.call_soon_threadsafe(loop.stop)
