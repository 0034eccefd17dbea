"""MPI sessions. ``MpiCommSession.submit`` sends the other ranks' share to the MPI pool and runs
rank 0's on the session's own two-thread ``ThreadPoolExecutor``, in the submitting process;
``RemoteMpiCommSessionServer`` (the leader of a multi-node launch with
``TLLM_SPAWN_PROXY_PROCESS=1``) runs the tasks a ``RemoteMpiCommSessionClient`` (the proxy process)
sends over loopback (ZMQ upstream; ``multiprocessing.connection`` here) on such a session."""
import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Client, Listener
from typing import Callable, List

from .. import _native

_requests = itertools.count(1)


class MpiSession:

    def submit(self, task: Callable, *args, **kwargs) -> List[Future]:
        raise NotImplementedError

    def submit_sync(self, task: Callable, *args, **kwargs) -> list:
        return [f.result() for f in self.submit(task, *args, **kwargs)]

    def shutdown(self, wait=True):
        pass


class _MPICommExecutor:
    """mpi4py.futures.MPICommExecutor's pool over ranks 1..n-1. Those ranks live in other
    processes; here each submission only goes through the MPI library, which progresses the
    request on a native thread it starts from the submitting thread."""

    def __init__(self, comm, n_remote):
        self.n_remote = n_remote

    def submit(self, task, *args, **kwargs) -> Future:
        _native.progress_thread(f"mpi_req{next(_requests)}")
        future = Future()
        future.set_result(None)
        return future


class MpiCommSession(MpiSession):

    def __init__(self, comm=None, n_workers: int = 1):
        if n_workers <= 0:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        self.comm = comm
        self.n_workers = n_workers
        self.thread_pool = None
        self.mpi_pool = None
        self._start_mpi_pool()

    def submit(self, task: Callable, *args, **kwargs) -> List[Future]:
        assert self.mpi_pool is not None, "MPI session not started"
        worker_futures = [
            self.mpi_pool.submit(task, *args, **kwargs) for _ in range(self.n_workers - 1)
        ]
        rank0_future = self.thread_pool.submit(task, *args, **kwargs)
        return [rank0_future] + worker_futures

    def shutdown(self, wait=True):
        if self.thread_pool is not None:
            self.thread_pool.shutdown(wait=wait)
            self.thread_pool = None

    def _start_mpi_pool(self):
        self.thread_pool = ThreadPoolExecutor(max_workers=2)
        self.mpi_pool = _MPICommExecutor(self.comm, self.n_workers - 1)


def _address(addr):
    if isinstance(addr, str):
        host, _, port = addr.rpartition(":")
        return host, int(port)
    return tuple(addr)


class RemoteMpiCommSessionClient(MpiSession):
    """The proxy's end: each task is pickled to the leader's session server."""

    def __init__(self, addr):
        self.addr = _address(addr)
        self._conn = Client(self.addr)
        self._lock = threading.Lock()

    def _call(self, task, args, kwargs, sync):
        with self._lock:
            self._conn.send((task, args, kwargs, sync))
            return self._conn.recv()

    def submit(self, task: Callable, *args, **kwargs) -> List[Future]:
        self._call(task, args, kwargs, False)
        return []

    def submit_sync(self, task: Callable, *args, **kwargs) -> list:
        return self._call(task, args, kwargs, True)

    def shutdown(self, wait=True):
        with self._lock:
            if self._conn is not None:
                self._conn.send(None)
                self._conn.close()
                self._conn = None


class RemoteMpiCommSessionServer:
    """The leader's session server: ``serve()`` runs it on its own thread until the client shuts
    down, and waits for it."""

    def __init__(self, n_workers: int = 1, addr=("127.0.0.1", 0), comm=None):
        self.session = MpiCommSession(comm=comm, n_workers=n_workers)
        self.listener = Listener(_address(addr))
        self.addr = self.listener.address
        self.thread = None

    def serve(self):
        self.thread = threading.Thread(target=self._serve_forever,
                                       name="session_server",
                                       daemon=True)
        self.thread.start()
        self.thread.join()

    def _serve_forever(self):
        conn = self.listener.accept()
        with conn:
            while True:
                try:
                    message = conn.recv()
                except EOFError:
                    break
                if message is None:
                    break
                task, args, kwargs, sync = message
                futures = self.session.submit(task, *args, **kwargs)
                conn.send([f.result() for f in futures] if sync else None)
        self.listener.close()

    def shutdown(self):
        self.session.shutdown()
