"""One engine of the upstream stand-in (tests/programs/upstream_trtllm) for one GPU: a worker
thread calls ``configure_cpu_affinity(GPU)`` and builds a ``PyExecutor``, whose executor loop
thread pins itself with upstream's ``get_executor_loop_cpus`` when ``TLLM_EXECUTOR_LOOP_PIN=1``.
Run under the library and its Python hook (``tllm-affinity run``), with the stand-in on
``PYTHONPATH``.

Usage: loop_pin_server.py GPU
Prints one JSON line once the loop answered a request (so its pin is in place)
  {"pid": p, "host": tid, "worker": tid, "loop": tid, "loop_cpus": [...]}
then waits until stdin closes, shuts the engine down and exits.
"""

import json
import os
import sys
import threading

from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm.executor.executor import GenerationRequest
from tensorrt_llm.llmapi.utils import configure_cpu_affinity


def main():
    gpu = int(sys.argv[1])
    seen = {"pid": os.getpid(), "host": threading.get_native_id()}
    ready = threading.Event()
    done = threading.Event()

    def worker():
        seen["worker"] = threading.get_native_id()
        configure_cpu_affinity(gpu)
        engine = PyExecutor(gpu)
        engine.enqueue_request(GenerationRequest(1, "ping"))
        engine.await_response(timeout=120)
        seen["loop"] = engine.loop_tid
        seen["loop_cpus"] = engine.loop_cpus
        ready.set()
        done.wait()
        engine.shutdown()

    thread = threading.Thread(target=worker, name="worker")
    thread.start()
    ready.wait(180)
    print(json.dumps(seen), flush=True)
    sys.stdin.read()
    done.set()
    thread.join(60)


if __name__ == "__main__":
    main()
