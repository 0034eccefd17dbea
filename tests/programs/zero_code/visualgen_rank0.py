"""Deployment 3 of seeds/shared-process-affinity-never-restored.txt as an unmodified app:
external-launch VisualGen, rank 0, under an HTTP server. The main thread first serves with two
LLMs one after the other (single-process TP1 workers, ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` set by
the test), each shut down before the next: two sequential ``BaseWorker``s. Then it builds the
VisualGen client, ``DiffusionRemoteClient`` (its coordinator thread, then the worker thread
running upstream's module-level ``run_diffusion_worker``, which configures CPU affinity) and runs an HTTP loop on loopback (a thread per request, ``ThreadingHTTPServer``); a
request thread, noted req_<name>, asks the executor (over loopback to the coordinator, whose
loop waits for the worker on its executor threads) or, once it is shut down, answers itself, and
holds until the end. The main loop also runs what the app's control thread hands it: the
executor's shutdown happens on the main thread, as a server's lifespan does it.

Phases, printed by the control thread (started first): before (both LLMs shut down, no
executor), during (executor
ready; the test then sends /generate/a), serving (a answered), shutdown (executor shut down on
main; the test then sends /generate/b), after (b answered). Imports only tensorrt_llm, the
test instrumentation and the programs' quiet request handler (quiet_http).
"""
import http.server
import json
import queue
import threading

from phases import note, phase_all, role
from quiet_http import QuietHandler
from runtime_helpers import say
from tensorrt_llm import LLM
from tensorrt_llm._torch.visual_gen.client import DiffusionRemoteClient

let_go = threading.Event()
built = threading.Event()
seen = {"a": threading.Event(), "b": threading.Event()}
state = {}
main_calls = queue.Queue()


def on_main(fn):
    done = threading.Event()
    main_calls.put((fn, done))
    assert done.wait(60), "the main loop never ran it"


class Handler(QuietHandler):

    def do_GET(self):
        name = self.path.rsplit("/", 1)[-1]
        note(f"req_{name}")
        executor = state.get("executor")
        answer = executor.generate(name) if executor else {"prompt": name, "image": None}
        answer["handler_role"] = role(threading.get_native_id())
        seen[name].set()
        let_go.wait(60)
        self.reply(json.dumps(answer).encode())


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = False

    def service_actions(self):
        while not main_calls.empty():
            fn, done = main_calls.get()
            fn()
            done.set()


def control():
    phase_all("before")
    built.set()
    assert state_ready.wait(60)
    phase_all("during")
    assert seen["a"].wait(60)
    phase_all("serving")
    on_main(lambda: state.pop("executor").shutdown())
    phase_all("shutdown")
    assert seen["b"].wait(60)
    phase_all("after")
    let_go.set()
    server.shutdown()


state_ready = threading.Event()
for model in ("stand-in/first", "stand-in/second"):
    llm = LLM(model)
    say("ANSWER", llm.generate("llm").outputs[0].text)
    llm.shutdown()
controller = threading.Thread(target=control, name="control")
controller.start()
assert built.wait(60)
state["executor"] = DiffusionRemoteClient(device_id=0)
server = Server(("127.0.0.1", 0), Handler)
say("PORT", server.server_address[1])
state_ready.set()
server.serve_forever(poll_interval=0.05)
server.server_close()
controller.join(30)
