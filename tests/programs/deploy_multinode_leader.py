"""Deployment 4 of seeds/shared-process-affinity-never-restored.txt: the leader process of a
multi-node launch (TLLM_SPAWN_PROXY_PROCESS=1). The main thread initialises "MPI", which starts
a native progress thread (mpi_progress) from the host thread; the session server thread
(RemoteMpiCommSessionServer.serve(), ZMQ in the server; a loopback TCP server here) is a host
thread; the session's two-thread pool runs rank 0's worker_main on one thread, which builds the
worker (setup_engine configures through the adapter) and initialises "NCCL" (nccl_progress).

Native progress threads are started with progress_threads.c's spawn_progress from whichever
thread asks, with their start routine in libnccl.so.2 (tests/programs/nccl.c), a TLLM_AFFINITY_WORKER_LIBS
object: they are workers whoever made them. During the lease the session server, asked over
loopback, starts one more (late_progress); after shutdown, one more (after_progress).

Phases, printed by the main thread: before, during, serving, shutdown (worker_main returned and
released; its pool thread and the progress threads live on), after.
Env: RT_NCCL (libnccl.so.2), RT_SPAWN (libprogress_threads.so.2), PYTHONPATH with tllm_affinity.
"""
import ctypes
import os
import socket
import threading

import trtllm_shape
from runtime_helpers import note, phase, start, stop
from tllm_affinity.adapters import trtllm

trtllm.install(trtllm_shape, shutdown="shutdown_hook")

nccl = ctypes.CDLL(os.environ["RT_NCCL"])
spawner = ctypes.CDLL(os.environ["RT_SPAWN"])
spawner.spawn_progress.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
nccl.fake_nccl_set_note.argtypes = [ctypes.c_void_p]
nccl.fake_nccl_set_note(ctypes.cast(spawner.rt_note, ctypes.c_void_p))
progress_fn = ctypes.cast(nccl.fake_nccl_progress, ctypes.c_void_p)


def spawn_progress(name):
    tid = spawner.spawn_progress(progress_fn, name.encode())
    assert tid > 0, tid
    note(name, tid)


listener = socket.create_server(("127.0.0.1", 0))
session_port = listener.getsockname()[1]


def serve():
    """The session server: one command per connection."""
    while True:
        conn, _ = listener.accept()
        with conn:
            command = conn.makefile().readline().split()
            if command[0] == "quit":
                return
            if command[0] == "spawn":
                spawn_progress(command[1])
            conn.sendall(b"ok\n")


def ask_server(*words):
    with socket.create_connection(("127.0.0.1", session_port), timeout=30) as s:
        s.sendall(" ".join(words).encode() + b"\n")
        if words[0] != "quit":
            assert s.makefile().readline().strip() == "ok"


worker_stop = threading.Event()
session = trtllm_shape.MpiSession("session")


def worker_main():
    worker = session.rank0_worker("leader_worker")
    spawn_progress("nccl_progress")
    answer = worker.generate("warmup")
    assert answer["by"]["role"] == 1, answer
    session.worker_ready.set()
    assert worker_stop.wait(30)
    worker.shutdown()
    return "worker_main done"


note("main")
spawn_progress("mpi_progress")
server = threading.Thread(target=lambda: (note("session_server"), serve()), name="server")
server.start()
ask_server("ping")
phase("before")

rank0 = session.start(worker_main)
phase("during")

ask_server("spawn", "late_progress")
phase("serving")

worker_stop.set()
assert rank0.result(30) == "worker_main done"
phase("shutdown")

ask_server("spawn", "after_progress")
phase("after")
session.hold.set()
ask_server("quit")
server.join(30)
session.shutdown()
stop.set()
