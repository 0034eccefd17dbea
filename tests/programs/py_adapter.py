"""The TensorRT-LLM-style adapter on a fake worker module; prints one JSON line.

Usage: py_adapter.py preloaded|unavailable
"""

import json
import os
import sys
import threading
import types

import tllm_affinity
from tllm_affinity.adapters import trtllm


def mask():
    return sorted(os.sched_getaffinity(0))


def fake_module():
    calls = {"configure": [], "shutdown": 0}

    def configure_cpu_affinity(gpu_id):
        calls["configure"].append(gpu_id)
        return "original"

    def shutdown():
        calls["shutdown"] += 1

    module = types.SimpleNamespace(configure_cpu_affinity=configure_cpu_affinity,
                                   shutdown=shutdown)
    return module, calls, configure_cpu_affinity


def preloaded():
    module, calls, original = fake_module()
    wrapper = trtllm.install(module, shutdown="shutdown")
    out = {"same_on_reinstall": trtllm.install(module, shutdown="shutdown") is wrapper,
           "wrapped_name": module.configure_cpu_affinity.__name__}
    stop = threading.Event()
    w = {}
    configured = threading.Event()

    def worker_main():
        w["tid"] = threading.get_native_id()
        w["returned"] = repr(module.configure_cpu_affinity(0))
        w["leases"] = [lease.id for lease in trtllm.leases()]
        w["role"] = tllm_affinity.role()
        w["mask"] = mask()
        w["returned_again"] = repr(module.configure_cpu_affinity(gpu_id=0))
        w["leases_again"] = [lease.id for lease in trtllm.leases()]
        configured.set()
        stop.wait()
        w["mask_after_shutdown"] = mask()

    t = threading.Thread(target=worker_main)
    t.start()
    configured.wait()
    out["main_role"] = tllm_affinity.role()
    out["main_mask"] = mask()
    out["open_before_shutdown"] = len(trtllm.leases())
    module.shutdown()
    out["open_after_shutdown"] = len(trtllm.leases())
    out["original_calls"] = calls
    stop.set()
    t.join()
    out["worker"] = w
    out["release_all_again"] = trtllm.release_all()
    trtllm.uninstall(module, shutdown="shutdown")
    out["restored"] = module.configure_cpu_affinity is original
    out["atexit_registered"] = trtllm._atexit_registered
    try:
        trtllm.install(types.SimpleNamespace(), "configure_cpu_affinity")
        out["missing_raises"] = False
    except AttributeError:
        out["missing_raises"] = True
    return out


def unavailable():
    module, calls, _ = fake_module()
    trtllm.install(module)
    first = module.configure_cpu_affinity(3)
    second = module.configure_cpu_affinity(4)
    return {"available": tllm_affinity.available(), "results": [first, second],
            "original_calls": calls}


if __name__ == "__main__":
    print(json.dumps({"preloaded": preloaded, "unavailable": unavailable}[sys.argv[1]]()),
          flush=True)
