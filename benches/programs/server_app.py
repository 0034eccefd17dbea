"""The server of `scripts/bench --server`: a single-process TP1 deployment as `trtllm-serve` runs
it, over the stand-in TensorRT-LLM package of tests/programs/upstream_trtllm (PYTHONPATH).

The main thread constructs ``LLM(...)`` (TLLM_WORKER_USE_SINGLE_PROCESS=1, set by the bench), so
upstream's ``configure_cpu_affinity`` runs on it, then serves HTTP with uvicorn + FastAPI on
127.0.0.1:<port>. The engine's loop (RT_ENGINE_LOOP=1) turns without pause; its forward step is
benches/programs/engine_step.c (RT_ENGINE_STEP: the built shared object), whose first call starts
a native step thread from the loop thread. That thread does a fixed amount of CPU work per step,
continuously, without the GIL; each loop turn waits (GIL released) for the step in progress to
end, then answers the batch it took. ``POST /generate`` is an async handler on the event loop
(the main thread), as trtllm-serve's OpenAI endpoints are: it parses the JSON body (pydantic),
tokenises the prompt in Python, submits the request to the engine (``generate_async``), awaits
the step that answers it (``aresult``) and returns JSON. ``GET /stats`` gives the step thread's
counters (steps, their CPU and wall time), the loop's turns, a clock, and the CPU masks of the
main thread, the step thread and a thread of FastAPI's pool (where sync handlers such as this one
run; born after the LLM), so the bench can say where each mode put them.

It imports nothing of tllm_affinity: the same file runs under plain ``python`` and under
``tllm-affinity run``. Usage: server_app.py <port>
"""
import ctypes
import os
import re
import sys
import threading

try:
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel
except ImportError as e:  # the bench checks first; this is for a hand run
    sys.exit(f"server_app.py: {e} (scripts/setup installs uvicorn and fastapi)")

from tensorrt_llm import LLM, _native

ENGINE = ctypes.CDLL(os.environ["RT_ENGINE_STEP"])
ENGINE.engine_wait.restype = ctypes.c_long
_plain_region = _native.omp_region


def forward_step(prefix):
    """The stand-in loop's per-iteration native call ("loop_omp") becomes a wait for the native
    engine's step; the model-loading region on the main thread stays what it was."""
    if prefix != "loop_omp":
        return _plain_region(prefix)
    ENGINE.engine_wait()
    return []


_native.omp_region = forward_step

_WORD = re.compile(r"\w+|[^\w\s]")
# A fixed vocabulary: the 2000 most common ASCII letter pairs and triples of a generated corpus
# stand in for BPE merges; a word not in it is split greedily into the longest known pieces.
_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"
VOCAB = {}
for a in _LETTERS:
    VOCAB.setdefault(a, len(VOCAB))
    for b in _LETTERS:
        VOCAB.setdefault(a + b, len(VOCAB))
        for c in _LETTERS[:6]:
            VOCAB.setdefault(a + b + c, len(VOCAB))


def tokenize(text):
    ids = []
    for word in _WORD.findall(text.lower()):
        if word in VOCAB:
            ids.append(VOCAB[word])
            continue
        i = 0
        while i < len(word):
            for j in range(min(len(word), i + 3), i, -1):
                piece = word[i:j]
                if piece in VOCAB:
                    ids.append(VOCAB[piece])
                    i = j
                    break
            else:
                ids.append(len(VOCAB) + ord(word[i]) % 256)
                i += 1
    return ids


class GenerateRequest(BaseModel):
    prompt: str
    max_tokens: int = 16


def mask(tid):
    try:
        return sorted(os.sched_getaffinity(tid))
    except OSError:
        return None


llm = LLM("stand-in/tp1", tensor_parallel_size=1)
engine = llm._executor.engine
app = FastAPI()


@app.post("/generate")
async def generate(req: GenerateRequest):
    ids = tokenize(req.prompt)
    out = await llm.generate_async(req.prompt).aresult()
    return {"text": out.text, "prompt_tokens": len(ids), "token_ids": ids[:256],
            "max_tokens": req.max_tokens}


@app.get("/stats")
def stats():
    out = (ctypes.c_int64 * 8)()
    ENGINE.engine_stats(out)
    tid, steps, cpu_ns, wall_ns, now_ns, turns = out[:6]
    return {"steps": steps, "cpu_ns": cpu_ns, "wall_ns": wall_ns, "clock_ns": now_ns,
            "turns": turns, "main": mask(threading.main_thread().native_id),
            "loop": mask(engine.loop_tid), "step": mask(tid), "pool": mask(0)}


if __name__ == "__main__":
    try:
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                    access_log=False)
    finally:
        llm.shutdown()
