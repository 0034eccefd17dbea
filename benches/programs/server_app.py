"""The server of `scripts/bench --server`: a single-process TP1 deployment as `trtllm-serve` runs
it, over the stand-in TensorRT-LLM package of tests/programs/upstream_trtllm (PYTHONPATH).

The main thread constructs ``LLM(...)`` (TLLM_WORKER_USE_SINGLE_PROCESS=1, set by the bench), so
upstream's ``configure_cpu_affinity`` runs on it, then serves HTTP with uvicorn + FastAPI on
127.0.0.1:<port>. The engine (RT_ENGINE_LOOP=1) steps without pause in native code that releases
the GIL. ``POST /generate`` is an async handler on the event loop (the main thread), as
trtllm-serve's OpenAI endpoints are: it parses the JSON body (pydantic), tokenises the prompt in
Python, submits the request to the engine (``generate_async``), awaits the step that answers it
(``aresult``) and returns JSON. ``GET /stats`` gives the engine's step count and a clock, and the
CPU masks of the main thread, the engine loop thread and a thread of FastAPI's pool (where sync
handlers such as this one run; born after the LLM), so the bench can say where each mode put
them.

It imports nothing of tllm_affinity: the same file runs under plain ``python`` and under
``tllm-affinity run``. Usage: server_app.py <port>
"""
import os
import re
import sys
import threading
import time

try:
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel
except ImportError as e:  # the bench checks first; this is for a hand run
    sys.exit(f"server_app.py: {e} (scripts/setup installs uvicorn and fastapi)")

from tensorrt_llm import LLM

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
    return {"iterations": engine.iterations, "clock": time.monotonic(),
            "main": mask(threading.main_thread().native_id), "engine": mask(engine.loop_tid),
            "pool": mask(0)}


if __name__ == "__main__":
    try:
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                    access_log=False)
    finally:
        llm.shutdown()
