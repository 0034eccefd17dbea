"""Deployment 4 of seeds/shared-process-affinity-never-restored.txt as an unmodified app: the
leader process of a multi-node launch (TLLM_SPAWN_PROXY_PROCESS=1). Importing tensorrt_llm
initialises MPI on the main thread (a native progress thread, mpi_progress); the main thread then
runs ``RemoteMpiCommSessionServer.serve()``, whose session-server thread runs the tasks the proxy
process sends on the session: rank 0's ``worker_main`` on the session's first pool thread (which
configures CPU affinity and initialises NCCL: nccl_progress), the proxy's own tasks on its
second. Every submission goes through MPI, which progresses it on a native thread started by the
session server (mpi_req1 before the worker configures, mpi_req2 during its life, mpi_req3 after).
Progress threads start in libnccl.so.2 (RT_NCCL), a TLLM_AFFINITY_WORKER_LIBS object.

The proxy is another process (leader_proxy.py), driven by this app's control thread (started
first): it builds ``LLM(...)`` over a ``RemoteMpiCommSessionClient``. Phases, printed by the
control thread: before (session server up, no worker), during (LLM built), serving (a request
and a session task went through), shutdown (LLM shut down: worker_main returned, its pool thread
and the progress threads live on), after (one more session task). Imports only tensorrt_llm and
the test instrumentation.
"""
import os
import subprocess
import sys
import threading
import time

from phases import phase_all
from runtime_helpers import say
from tensorrt_llm.llmapi.mpi_session import RemoteMpiCommSessionServer

server = RemoteMpiCommSessionServer(n_workers=2, addr=("127.0.0.1", 0))


def ask(proxy, command):
    proxy.stdin.write(command + "\n")
    proxy.stdin.flush()
    line = proxy.stdout.readline().strip()
    assert line.startswith("OK"), f"proxy: {command} -> {line!r}"
    say("PROXY", command, line)


def control():
    while server.thread is None or not server.thread.is_alive():
        time.sleep(0.01)  # serve() is starting the session server
    phase_all("before")
    host, port = server.addr
    proxy = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "leader_proxy.py"),
         f"{host}:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proxy.stdout.readline().strip() == "READY", "the proxy never built its LLM"
    phase_all("during")
    ask(proxy, "generate")
    ask(proxy, "session")
    phase_all("serving")
    ask(proxy, "shutdown")
    phase_all("shutdown")
    ask(proxy, "session")
    phase_all("after")
    ask(proxy, "quit")
    assert proxy.wait(30) == 0


controller = threading.Thread(target=control, name="control")
controller.start()
server.serve()
server.shutdown()
controller.join(30)
