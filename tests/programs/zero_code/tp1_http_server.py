"""Deployment 1 of seeds/shared-process-affinity-never-restored.txt as an unmodified app: a
single-process TP1 worker inside an HTTP server's process (TLLM_WORKER_USE_SINGLE_PROCESS=1, set
by the test). The main thread builds ``LLM(...)``, then runs an asyncio HTTP server on loopback
whose sync handlers run on the loop's default ThreadPoolExecutor (created lazily: its threads are
born after the LLM), then shuts the LLM down, on the main thread. A user thread (user_metrics)
runs from the start.

GET /generate/<name> (from the test) runs on an executor thread, noted req_<name>, which asks
the LLM (or answers itself once the LLM is shut down) and holds until the end, so that the next
request needs a new thread. Phases, all printed by the main thread: before (no LLM), during (LLM
built; the loop is paused here and the test's request a waits in the backlog), serving (a
answered), shutdown (LLM shut down; the test then sends b), after (b answered).
Imports only tensorrt_llm and the test instrumentation.
"""
import asyncio
import json
import threading

from phases import note, phase_all, role
from runtime_helpers import say
from tensorrt_llm import LLM

let_go = threading.Event()
state = {}


def user_metrics():
    let_go.wait(120)


def generate(name, loop, seen):
    note(f"req_{name}")
    llm = state.get("llm")
    if llm is not None:
        answer = {"text": llm.generate(name).outputs[0].text, "engine": True}
    else:
        answer = {"text": None, "engine": False}
    answer["handler_role"] = role(threading.get_native_id())
    loop.call_soon_threadsafe(seen[name].set)
    let_go.wait(60)
    return answer


async def serve(llm):
    loop = asyncio.get_running_loop()
    state["llm"] = llm
    seen = {"a": asyncio.Event(), "b": asyncio.Event()}
    done = []

    async def handle(reader, writer):
        line = (await reader.readline()).decode()
        while (await reader.readline()).strip():
            pass
        name = line.split()[1].rsplit("/", 1)[-1]
        answer = await loop.run_in_executor(None, generate, name, loop, seen)
        body = json.dumps(answer).encode()
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()
        done.append(name)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    say("PORT", server.sockets[0].getsockname()[1])
    phase_all("during")
    await asyncio.wait_for(seen["a"].wait(), 60)
    phase_all("serving")
    del state["llm"]
    llm.shutdown()
    phase_all("shutdown")
    await asyncio.wait_for(seen["b"].wait(), 60)
    phase_all("after")
    let_go.set()
    for _ in range(3000):
        if len(done) == 2:
            break
        await asyncio.sleep(0.01)
    server.close()
    await server.wait_closed()


threading.Thread(target=user_metrics, name="user_metrics", daemon=True).start()
phase_all("before")
asyncio.run(serve(LLM("stand-in/tp1", tensor_parallel_size=1)))
