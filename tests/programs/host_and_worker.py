"""A worker living as a guest in an HTTP server's process (seeds/shared-process-affinity-never-
restored.txt, deployment 1): host threads must never be touched, the worker's threads are placed,
and release puts every mask back."""
import asyncio
import http.server
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from phases import LIB, note, phase, start, stop
from quiet_http import QuietHandler

hold_request = threading.Event()
request_seen = {}


class Handler(QuietHandler):
    def do_GET(self):
        name = self.path.strip("/")
        note(name)
        request_seen[name].set()
        hold_request.wait()
        self.reply(b"ok")


note("main")
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
port = server.server_address[1]
start("http", server.serve_forever)
start("loop", lambda: asyncio.new_event_loop().run_until_complete(asyncio.sleep(0)))


def request(name):
    """Starts a request whose handler thread stays alive (held) until `hold_request` is set."""
    request_seen[name] = threading.Event()
    client = threading.Thread(
        target=lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/{name}").read(),
        daemon=True,
    )
    client.start()
    request_seen[name].wait()
    return client


done = threading.Event()


def worker():
    note("worker")
    lease = LIB.tllm_affinity_configure(0)
    assert lease > 0, lease
    pool = ThreadPoolExecutor(max_workers=2)
    barrier = threading.Barrier(2)

    def pool_task(i):
        note(f"pool{i}")
        barrier.wait()

    list(pool.map(pool_task, range(2)))
    grandchild_started = threading.Event()
    start("child", lambda: (start("grandchild"), grandchild_started.set()))
    grandchild_started.wait()
    client = request("request")
    phase("configured")
    hold_request.set()
    client.join()
    assert LIB.tllm_affinity_release(lease) == 0
    assert LIB.tllm_affinity_release(lease) == -2
    phase("released")
    hold_request.clear()
    late = request("late_request")
    start("late_worker_child")
    phase("after")
    hold_request.set()
    late.join()
    pool.shutdown()
    done.set()


threading.Thread(target=worker, name="worker").start()
done.wait()
stop.set()
server.shutdown()
