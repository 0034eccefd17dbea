"""Exercises the tllm_affinity Python module with real threads; prints one JSON line.

Usage: py_api.py SCENARIO, where SCENARIO is
  api             configure/Lease/worker()/role/report/errors under the preloaded library
  step            pin_step_thread/pin_result_thread (run with TLLM_AFFINITY_STEP_CORE=<cpu>)
  passive         the library went passive (run with a malformed variable)
  unavailable     the library is not preloaded
  report-at-exit  a worker thread holds a lease when the process exits (TLLM_AFFINITY_REPORT)
"""

import errno
import json
import os
import sys
import threading
import warnings

import tllm_affinity


def mask():
    """The calling thread's mask, from the kernel."""
    return sorted(os.sched_getaffinity(0))


def status_mask(tid):
    with open("/proc/self/task/%d/status" % tid) as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return None


def thread_mask(tid):
    return sorted(os.sched_getaffinity(tid))


def in_thread(fn):
    """Runs fn in a new thread and returns its result (re-raising its exception)."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: B902 - handed back to the caller
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def errno_of(fn):
    try:
        fn()
    except OSError as e:
        return e.errno
    return None


def api():
    out = {"available": tllm_affinity.available(), "version": tllm_affinity.version(),
           "main_role": tllm_affinity.role(), "main_tid": threading.get_native_id()}
    # A host thread that lives across the whole lease, like an HTTP server's.
    stop = threading.Event()
    host_started = threading.Event()
    host = {}

    def host_body():
        host["tid"] = threading.get_native_id()
        host_started.set()
        stop.wait()

    host_thread = threading.Thread(target=host_body)
    host_thread.start()
    host_started.wait()
    out["host_tid"] = host["tid"]
    out["host_mask_before"] = thread_mask(host["tid"])

    def worker_body():
        w = {"tid": threading.get_native_id()}
        with tllm_affinity.worker(0) as lease:
            w["lease"] = lease.id
            w["lease_repr"] = repr(lease)
            w["role"] = tllm_affinity.role()
            w["mask"] = mask()
            w["status_mask"] = status_mask(w["tid"])

            def child():
                return {"tid": threading.get_native_id(), "role": tllm_affinity.role(),
                        "mask": mask()}

            w["child"] = in_thread(child)
            # A second configure for the same device: nothing moves; closing it restores nothing.
            again = tllm_affinity.configure(0)
            w["again_lease"] = again.id
            w["mask_after_again"] = mask()
            again.release()
            w["mask_after_again_release"] = mask()
            w["host_role"] = tllm_affinity.role(host["tid"])
            w["host_mask_during"] = thread_mask(host["tid"])
            w["report"] = tllm_affinity.report()
        w["mask_after_release"] = mask()
        w["released"] = lease.released
        lease.release()  # idempotent
        w["role_after"] = tllm_affinity.role()
        w["release_by_id_errno"] = errno_of(lambda: tllm_affinity.release(lease.id))
        return w

    out["worker"] = in_thread(worker_body)
    out["host_mask_after"] = thread_mask(host["tid"])
    out["unknown_role"] = tllm_affinity.role(1)
    out["bad_device_errno"] = errno_of(lambda: tllm_affinity.configure(7))
    out["step_off"] = in_thread(lambda: tllm_affinity.pin_step_thread(0))
    # Lease as a context manager, for symmetry with worker().
    with in_thread(lambda: tllm_affinity.configure(0)) as lease:
        out["context_lease_open"] = not lease.released
    out["context_lease_released"] = lease.released
    stop.set()
    host_thread.join()
    return out


def step():
    def pinned(fn):
        def body():
            rc = fn(0)
            return {"rc": rc, "tid": threading.get_native_id(), "mask": mask(),
                    "role": tllm_affinity.role()}
        return in_thread(body)

    return {"step": pinned(tllm_affinity.pin_step_thread),
            "result": pinned(tllm_affinity.pin_result_thread),
            "main_mask": mask()}


def passive():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lease = tllm_affinity.configure(0)
    lease.release()
    lease.release()
    return {"available": tllm_affinity.available(), "inert": lease.inert, "id": lease.id,
            "warnings": [str(w.message) for w in caught],
            "categories": [w.category.__name__ for w in caught],
            "role": tllm_affinity.role(), "state": tllm_affinity.report()["state"],
            "mask": mask()}


def unavailable():
    calls = {
        "configure": lambda: tllm_affinity.configure(0),
        "worker": lambda: tllm_affinity.worker(0).__enter__(),
        "role": tllm_affinity.role,
        "report": tllm_affinity.report,
        "pin_step_thread": tllm_affinity.pin_step_thread,
        "pin_result_thread": tllm_affinity.pin_result_thread,
        "version": tllm_affinity.version,
    }
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = None
        except tllm_affinity.TllmAffinityUnavailable as e:
            raised[name] = {"message": str(e), "runtime_error": isinstance(e, RuntimeError)}
    return {"available": tllm_affinity.available(), "raised": raised}


def report_at_exit():
    ready = threading.Event()
    w = {}

    def worker_body():
        w["tid"] = threading.get_native_id()
        w["lease"] = tllm_affinity.configure(0).id
        ready.set()
        threading.Event().wait()  # alive, and still holding the lease, when the process exits

    threading.Thread(target=worker_body, daemon=True).start()
    ready.wait()
    return {"main": threading.get_native_id(), "worker": w["tid"], "lease": w["lease"],
            "worker_mask": thread_mask(w["tid"])}


def main():
    scenario = sys.argv[1]
    fn = {"api": api, "step": step, "passive": passive, "unavailable": unavailable,
          "report-at-exit": report_at_exit}[scenario]
    print(json.dumps(fn()), flush=True)


if __name__ == "__main__":
    main()
