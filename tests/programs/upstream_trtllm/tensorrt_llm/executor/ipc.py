"""ZeroMqQueue, over ``multiprocessing.connection`` on loopback: the server end binds at once and
accepts its one peer at first use; the client end connects to ``address`` (picklable, so a task
sent to another process can carry it)."""
import threading
from multiprocessing.connection import Client, Listener


class ZeroMqQueue:

    def __init__(self, address=None, is_server: bool = True):
        self.is_server = is_server
        self._listener = Listener(("127.0.0.1", 0)) if is_server else None
        self.address = self._listener.address if is_server else tuple(address)
        self._conn = None
        self._open_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    def _connection(self):
        with self._open_lock:
            if self._conn is None:
                self._conn = self._listener.accept() if self.is_server else Client(self.address)
            return self._conn

    def put(self, obj):
        conn = self._connection()
        with self._send_lock:
            conn.send(obj)

    def get(self):
        conn = self._connection()
        with self._recv_lock:
            return conn.recv()

    def close(self):
        if self._conn is not None:
            self._conn.close()
        if self._listener is not None:
            self._listener.close()
