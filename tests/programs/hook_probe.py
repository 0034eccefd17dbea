"""What the start-up hook did to this interpreter, as one JSON line (tests/process/python_hook.rs).

An unmodified program: it imports `tensorrt_llm.executor.base_worker` (one of the
tests/programs/hook_cases packages, on PYTHONPATH), which binds `configure_cpu_affinity` at import
as upstream does, and calls it on a thread of its own, never touching `tllm_affinity`.

Usage: hook_probe.py probe DEVICE   the hook as the interpreter started
       hook_probe.py spawn DEVICE   the same, from a multiprocessing "spawn" child
       hook_probe.py late DEVICE    tensorrt_llm imported first, the hook installed afterwards
       hook_probe.py sites DEVICE   the call sites of hook_cases/bad_sites, each on a thread
       hook_probe.py renamed DEVICE hook_cases/renamed's renamed function, on a thread
       hook_probe.py stored DEVICE  upstream's function and sweep held, before the adapter
                                    arrives, under an alias, in containers, a partial and a
                                    default argument: each called (configure on a thread of
                                    its own), then the start-up hook installed (a no-op where
                                    it already ran at start-up)
"""
import builtins
import json
import os
import sys
import threading


def call_on_a_thread(configure, device):
    seen = {}

    def run():
        try:
            seen["result"] = repr(configure(device))
        except BaseException as error:  # the wrapper must never raise; show it if it does
            seen["raised"] = "%s: %s" % (type(error).__name__, error)
        seen["mask"] = sorted(os.sched_getaffinity(0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen


def probe(device):
    out = {
        "pid": os.getpid(),
        "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
        "user_sitecustomize": getattr(builtins, "USER_SITECUSTOMIZE_RAN", False),
    }
    try:
        from tensorrt_llm.executor import base_worker
        from tensorrt_llm.llmapi import utils
    except ImportError as error:
        out["import_error"] = str(error)
        return out
    configure = base_worker.configure_cpu_affinity
    out["wrapped"] = hasattr(configure, "_tllm_affinity_original")
    out["wrapped_in_utils"] = hasattr(utils.configure_cpu_affinity, "_tllm_affinity_original")
    sweep = getattr(utils, "_set_affinity_all_threads", None)
    out["sweep_wrapped"] = hasattr(sweep, "_tllm_affinity_original") if sweep else None
    if callable(configure):
        try:
            out["thread"] = call_on_a_thread(configure, device)
        except TypeError as error:
            out["thread"] = {"raised": str(error)}
    out["calls"] = utils.CALLS
    out["main_mask"] = sorted(os.sched_getaffinity(0))
    adapter = sys.modules.get("tllm_affinity.adapters.trtllm")
    out["adapter"] = adapter.status() if adapter else None
    # `tllm-affinity ps` of this very process, while it lives, when the test names the CLI.
    cli = os.environ.get("HOOK_PROBE_PS")
    if cli:
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        out["ps"] = subprocess.run([cli, "ps", "--no-color", str(os.getpid())], env=env,
                                   capture_output=True, text=True, timeout=60).stdout
    return out


def bad_sites(device):
    from tensorrt_llm._torch.visual_gen import executor
    from tensorrt_llm.executor.base_worker import BaseWorker
    from tensorrt_llm.llmapi import utils

    out = {"entry_wrapped": hasattr(executor.run_diffusion_worker, "_tllm_affinity_original")}
    out["base_worker"] = call_on_a_thread(lambda d: BaseWorker()._get_comm_ranks_device_id(d),
                                          device)

    def serve_once(d):
        """The generator's mask while it serves (its lease ends when it is exhausted)."""
        steps = executor.run_diffusion_worker(d, 1, "127.0.0.1", 0, None, None, {})
        next(steps)
        during = sorted(os.sched_getaffinity(0))
        list(steps)
        return during

    out["visual_gen"] = call_on_a_thread(serve_once, device)
    out["calls"] = utils.CALLS
    out["main_mask"] = sorted(os.sched_getaffinity(0))
    out["adapter"] = sys.modules["tllm_affinity.adapters.trtllm"].status()
    return out


def renamed(device):
    """The renamed function the adapter does not know, which still calls upstream's sweep."""
    from tensorrt_llm.llmapi import utils

    out = {"thread": call_on_a_thread(utils.configure_worker_cpu_affinity, device)}
    out["sweep_wrapped"] = hasattr(utils._set_affinity_all_threads, "_tllm_affinity_original")
    out["calls"] = utils.CALLS
    out["main_mask"] = sorted(os.sched_getaffinity(0))
    return out


def stored(device):
    """Each way a program can hold upstream's function or sweep, taken before the adapter arrives
    when the test starts the interpreter without the hook (TLLM_AFFINITY_PYTHON_HOOKS=0)."""
    import functools

    from tensorrt_llm.llmapi import utils as u
    from tensorrt_llm.llmapi.utils import _set_affinity_all_threads as sweep_alias
    from tensorrt_llm.llmapi.utils import configure_cpu_affinity as pin

    held = {
        "module alias": lambda d: u.configure_cpu_affinity(d),
        "name alias": pin,
        "list": [u.configure_cpu_affinity][0],
        "dict": {"configure": u.configure_cpu_affinity}["configure"],
        "partial": functools.partial(u.configure_cpu_affinity),
    }

    def with_default(d, configure=u.configure_cpu_affinity):
        return configure(d)

    held["default argument"] = with_default
    sweeps = [sweep_alias, u._set_affinity_all_threads]
    if os.environ.get("TLLM_AFFINITY_PYTHON_HOOKS") == "0":
        os.environ["TLLM_AFFINITY_PYTHON_HOOKS"] = "1"
        import _tllm_affinity_hook

        _tllm_affinity_hook.install()
    out = {"threads": {name: call_on_a_thread(configure, device) for name, configure in held.items()}}
    top = {max(os.sched_getaffinity(0))}
    for sweep in sweeps:
        sweep(top)
    out["calls"] = u.CALLS
    out["main_mask"] = sorted(os.sched_getaffinity(0))
    adapter = sys.modules.get("tllm_affinity.adapters.trtllm")
    out["adapter"] = adapter.status() if adapter else None
    return out


def spawned(queue, device):
    queue.put(probe(device))


def main():
    mode, device = sys.argv[1], int(sys.argv[2])
    if mode == "probe":
        out = probe(device)
    elif mode == "spawn":
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=spawned, args=(queue, device))
        child.start()
        out = queue.get(timeout=60)
        child.join(60)
        out["parent_pid"] = os.getpid()
    elif mode == "late":
        from tensorrt_llm.executor import base_worker  # noqa: F401 (bound before the hook)

        os.environ["TLLM_AFFINITY_PYTHON_HOOKS"] = "1"
        import _tllm_affinity_hook

        _tllm_affinity_hook.install()
        out = probe(device)
    elif mode == "sites":
        out = bad_sites(device)
    elif mode == "renamed":
        out = renamed(device)
    elif mode == "stored":
        out = stored(device)
    else:
        raise SystemExit("unknown mode " + mode)
    print(json.dumps(out, separators=(",", ":")), flush=True)  # short: mpirun splits long lines


if __name__ == "__main__":
    main()
