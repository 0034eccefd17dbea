"""The loopback HTTP side of the server-shaped test programs (host_and_worker.py,
http_server_with_pools.py, deploy_tp1_server.py, deploy_visualgen.py,
zero_code/visualgen_rank0.py): `QuietHandler`, a request handler that logs nothing and answers
with `reply(body)`, and `Arrivals`, the requests that have come so far, which a program waits for
by name. Imports nothing of the library or of the test instrumentation (no thread of its own)."""
import http.server
import threading


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A request handler without the access log on stderr; subclasses give `do_GET`."""

    def reply(self, body):
        """A 200 with `body` (bytes) and its Content-Length."""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def log_message(self, *args):
        pass


class Arrivals:
    """What each request that came left (`seen`, by name), under a condition to wait on."""

    def __init__(self):
        self.seen = {}
        self._cond = threading.Condition()

    def arrived(self, name, value=None):
        with self._cond:
            self.seen[name] = value
            self._cond.notify_all()

    def wait_for(self, name, timeout=30):
        with self._cond:
            came = self._cond.wait_for(lambda: name in self.seen, timeout)
        assert came, f"request {name} never came"

    def __len__(self):
        with self._cond:
            return len(self.seen)
