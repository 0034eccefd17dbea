"""TensorRT-LLM's ``configure_cpu_affinity(device_id)`` routed to libtllm_affinity.so.

Upstream's function pins every thread of the process and never restores it (the bugs this project
answers). Nobody has to call this module: the start-up hook (``_tllm_affinity_hook``, installed
by ``tllm-affinity run`` and by the pip package's ``.pth``) hands it ``tensorrt_llm.llmapi.utils``
the moment that module has executed, and :func:`patch_upstream` replaces, there and in every
module that already bound the names:

* ``configure_cpu_affinity(device_id)`` with :func:`_wrap_configure`'s wrapper. Same signature,
  returns None, never raises. Who is calling decides what it does:

  - the main thread, or a thread running an asyncio event loop (the caller is the server itself:
    single-process TP1 under ``trtllm-serve`` builds the LLM on the thread that then serves HTTP):
    a *worker scope* opens. The caller keeps its role and mask; the threads it creates until the
    worker's construction returns (the outermost ``__init__`` of a ``tensorrt_llm`` object on its
    stack, e.g. ``LLM.__init__``) are born workers on the GPU-local set;
  - any other thread (an MpiCommSession pool thread, the VisualGen worker thread), or a main
    thread that is already a worker or runs a worker rank's ``worker_main``: it is the worker's
    own, so it is configured: it and its later threads are workers.

  The lease belongs to the worker object on the caller's stack (the nearest ``self`` in a
  ``tensorrt_llm`` frame that has a ``shutdown`` method) and is released when that object's
  ``shutdown()`` returns; every lease is released at interpreter exit too.
* upstream's all-thread sweeps (``_set_affinity_all_threads(cpus)``,
  ``_reapply_current_thread_affinity_to_all_threads()``), where a version has them, with functions
  that touch no thread: the library already put every worker thread on the set, and new worker
  threads are born on it, while a sweep would pin host threads with masks no release could undo.

``install(target)`` does the same for an explicitly named module or class, for programs that
carry their own copy of the function.
"""

import atexit
import functools
import os
import sys
import threading
import weakref

import tllm_affinity

__all__ = ["install", "uninstall", "patch_upstream", "status", "release_all", "leases"]

CONFIGURE = "configure_cpu_affinity"
SWEEPS = ("_set_affinity_all_threads", "_reapply_current_thread_affinity_to_all_threads")
UPSTREAM_PACKAGE = "tensorrt_llm"
# Upstream functions that run a whole worker rank (executor/worker.py).
WORKER_ENTRY_POINTS = ("worker_main",)
_ORIGINAL = "_tllm_affinity_original"
_LEVELS = {"off": 0, "error": 1, "warn": 2, "info": 3, "debug": 4}

_lock = threading.Lock()
# (Lease, weak reference to the owning worker object or None)
_leases = []
_atexit_registered = False
_said = set()
_status = {"state": "not-imported"}


def _log(level, line, once_key=None):
    """One line on stderr in the library's format, at the library's TLLM_AFFINITY_LOG level."""
    wanted = _LEVELS.get(os.environ.get("TLLM_AFFINITY_LOG", "warn").strip().lower(), 2)
    if _LEVELS[level] > wanted:
        return
    if once_key is not None:
        with _lock:
            if once_key in _said:
                return
            _said.add(once_key)
    try:
        sys.stderr.write("[tllm-affinity] %s: %s\n" % (level, line))
        sys.stderr.flush()
    except Exception:
        pass


def status():
    """What the adapter did in this process: ``{"state": ...}``, with the state one of
    ``not-imported`` (TensorRT-LLM never imported), ``not-loaded`` (library absent),
    ``engaged``, ``not-found`` (no configure_cpu_affinity to wrap) or ``signature`` (one that
    does not take a device id)."""
    return dict(_status)


def _set_status(state, where=None):
    _status["state"] = state
    if where is not None:
        _status["module"] = where
    setter = getattr(tllm_affinity, "_note_adapter", None)
    if setter is not None:
        setter("trtllm", state)


def _device_of(args, kwargs):
    """The device argument however the caller passes it (positional, device_id=, gpu_id=)."""
    if args:
        return args[0]
    for key in ("device_id", "gpu_id", "device"):
        if key in kwargs:
            return kwargs[key]
    return -1


def _accepts_device(function):
    """True when ``function`` can be called with one device id, as upstream's can."""
    try:
        import inspect

        inspect.signature(function).bind(0)
        return True
    except (TypeError, ValueError):
        return False


def _in_upstream(frame):
    name = frame.f_globals.get("__name__", "")
    return name == UPSTREAM_PACKAGE or name.startswith(UPSTREAM_PACKAGE + ".")


def _upstream_frames(frame):
    """The caller's contiguous run of TensorRT-LLM frames, innermost first."""
    run = []
    while frame is not None and _in_upstream(frame):
        run.append(frame)
        frame = frame.f_back
    return run


def _owner(frames):
    """The worker object on the stack: the nearest ``self`` with a ``shutdown`` method."""
    for frame in frames:
        code = frame.f_code
        if not code.co_argcount or code.co_varnames[0] != "self":
            continue
        candidate = frame.f_locals.get("self")
        if callable(getattr(candidate, "shutdown", None)):
            return candidate
    return None


def _construction_frame(frames):
    """The frame whose return ends the worker's construction: the outermost ``__init__`` of a
    TensorRT-LLM object (``LLM.__init__``), else the outermost TensorRT-LLM frame that is not a
    command-line entry point (``trtllm-serve``'s main serves forever)."""
    for frame in reversed(frames):
        if frame.f_code.co_name == "__init__":
            return frame
    for frame in reversed(frames):
        if not frame.f_globals.get("__name__", "").startswith(UPSTREAM_PACKAGE + ".commands"):
            return frame
    return None


def _caller_is_the_server(frames):
    """The main thread, or a thread running an event loop: threads it starts later serve
    requests, so it must not become a worker. Not so when the thread is already a worker (a
    dedicated worker process) or runs a worker rank's entry point (an MPI pool rank's
    ``worker_main`` runs on its process's main thread)."""
    if tllm_affinity.role() == "worker":
        return False
    if any(frame.f_code.co_name in WORKER_ENTRY_POINTS for frame in frames):
        return False
    if threading.current_thread() is threading.main_thread():
        return True
    asyncio = sys.modules.get("asyncio")
    try:
        return asyncio is not None and asyncio._get_running_loop() is not None
    except Exception:
        return False


def _end_scope_when_returns(frame, lease):
    """Ends the worker scope when ``frame`` returns (or unwinds), with a profile function on this
    thread alone. A thread that already has a profiler keeps it, and the scope ends now: its
    worker threads are then born host, which costs placement but never a host thread's mask."""
    if frame is None or sys.getprofile() is not None:
        tllm_affinity.end_worker_scope(lease)
        return

    def profile(current, event, _arg):
        if event == "return" and current is frame:
            sys.setprofile(None)
            tllm_affinity.end_worker_scope(lease)

    sys.setprofile(profile)


def _remember(lease, owner):
    global _atexit_registered
    ref = None
    if owner is not None:
        try:
            ref = weakref.ref(owner)
            _wrap_owner_shutdown(type(owner))
        except Exception:
            ref = None  # released at exit instead
    with _lock:
        _leases.append((lease, ref))
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(release_all)


def _engage(device, caller):
    """Opens the lease for a call of configure_cpu_affinity. A library error (no such device,
    passive library) was already said in one line by the library: nothing is pinned and the
    server runs on."""
    frames = _upstream_frames(caller)
    server = _caller_is_the_server(frames)
    lib = tllm_affinity._require()
    opened = lib.tllm_affinity_begin_worker_scope if server else lib.tllm_affinity_configure
    rc = opened(device)
    if rc < 0:
        _log("debug", "configure_cpu_affinity(%d): %s; no thread pinned"
             % (device, os.strerror(-rc)))
        return
    lease = tllm_affinity.Lease(int(rc), device)
    if server:
        _end_scope_when_returns(_construction_frame(frames), lease)
    _remember(lease, _owner(frames))


def _wrap_configure(original):
    @functools.wraps(original)
    def configure_cpu_affinity(*args, **kwargs):
        try:
            device = int(_device_of(args, kwargs))
        except (TypeError, ValueError):
            _log("warn", "configure_cpu_affinity%r: not a device id; no thread pinned"
                 % (tuple(args),), once_key=("device", repr(args)))
            return None
        if not tllm_affinity.available():
            _log("warn", "libtllm_affinity.so is not preloaded; running the original %s"
                 % getattr(original, "__name__", CONFIGURE), once_key="unavailable")
            return original(*args, **kwargs)
        try:
            _engage(device, sys._getframe(1))
        except Exception as error:  # never into the worker's start-up
            _log("warn", "configure_cpu_affinity(%d): %s: %s; no thread pinned"
                 % (device, type(error).__name__, error))
        return None

    setattr(configure_cpu_affinity, _ORIGINAL, original)
    return configure_cpu_affinity


def _wrap_sweep(original):
    @functools.wraps(original)
    def sweep(*args, **kwargs):
        _log("debug", "%s: left to libtllm_affinity.so, which placed every worker thread and "
             "no host thread" % getattr(original, "__name__", "sweep"),
             once_key=("sweep", getattr(original, "__name__", "")))
        return None

    setattr(sweep, _ORIGINAL, original)
    return sweep


def _wrap_owner_shutdown(cls):
    current = getattr(cls, "shutdown")
    if hasattr(current, _ORIGINAL):
        return

    @functools.wraps(current)
    def shutdown(self, *args, **kwargs):
        try:
            return current(self, *args, **kwargs)
        finally:
            _release_owned_by(self)

    setattr(shutdown, _ORIGINAL, current)
    cls.shutdown = shutdown


def _wrap_shutdown(original):
    @functools.wraps(original)
    def shutdown(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            release_all()

    setattr(shutdown, _ORIGINAL, original)
    return shutdown


def _rebind(replaced):
    """Every loaded module that bound one of the replaced functions by name gets the wrapper."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, (original, wrapper) in replaced.items():
            if namespace.get(name) is original:
                namespace[name] = wrapper


def patch_upstream(module):
    """Wraps ``configure_cpu_affinity`` and the sweeps in ``module`` (tensorrt_llm.llmapi.utils)
    and in every module that imported them; called by the start-up hook. Never raises."""
    where = getattr(module, "__name__", repr(module))
    if not tllm_affinity.available():
        _status["state"] = "not-loaded"
        return
    original = getattr(module, CONFIGURE, None)
    if original is None or not callable(original):
        _set_status("not-found", where)
        _log("warn", "found no %s in %s: the TensorRT-LLM adapter did not engage, and the "
             "server pins threads as it would without tllm-affinity" % (CONFIGURE, where),
             once_key="not-found")
        return
    if hasattr(original, _ORIGINAL):
        return
    if not _accepts_device(original):
        _set_status("signature", where)
        _log("warn", "%s.%s does not take a device id: the TensorRT-LLM adapter did not engage"
             % (where, CONFIGURE), once_key="signature")
        return
    replaced = {CONFIGURE: (original, _wrap_configure(original))}
    for name in SWEEPS:
        sweep = getattr(module, name, None)
        if callable(sweep) and not hasattr(sweep, _ORIGINAL):
            replaced[name] = (sweep, _wrap_sweep(sweep))
    for name, (_, wrapper) in replaced.items():
        setattr(module, name, wrapper)
    _rebind(replaced)
    _set_status("engaged", where)
    _log("debug", "TensorRT-LLM adapter engaged in %s (%s)" % (where, ", ".join(replaced)))


def install(target, name=CONFIGURE, shutdown=None):
    """Replaces ``target.<name>`` (a module, class or object) with the wrapper. ``shutdown``
    names a method or function of ``target`` after which every adapter lease is released.
    Installing twice is a no-op. Returns the wrapper. Raises AttributeError when ``target`` has
    no ``name``."""
    global _atexit_registered
    current = getattr(target, name, None)
    if current is None:
        raise AttributeError("%r has no attribute %r to wrap" % (target, name))
    if not hasattr(current, _ORIGINAL):
        setattr(target, name, _wrap_configure(current))
    if shutdown is not None:
        hook = getattr(target, shutdown, None)
        if hook is None:
            raise AttributeError("%r has no shutdown hook %r" % (target, shutdown))
        if not hasattr(hook, _ORIGINAL):
            setattr(target, shutdown, _wrap_shutdown(hook))
    with _lock:
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(release_all)
    return getattr(target, name)


def uninstall(target, name=CONFIGURE, shutdown=None):
    """Puts back what ``install`` replaced; open leases stay open (see ``release_all``)."""
    for attr in (name, shutdown):
        if attr is None:
            continue
        current = getattr(target, attr, None)
        original = getattr(current, _ORIGINAL, None)
        if original is not None:
            setattr(target, attr, original)


def leases():
    """The leases the adapter opened and has not released yet."""
    with _lock:
        return [lease for lease, _ in _leases if not lease.released]


def _release(taken):
    count = 0
    for lease in taken:
        if not lease.released and not lease.inert:
            count += 1
        try:
            lease.release()
        except Exception as error:
            _log("warn", "releasing lease %s: %s" % (lease.id, error))
    return count


def _release_owned_by(owner):
    with _lock:
        mine = [entry for entry in _leases if entry[1] is not None and entry[1]() is owner]
        for entry in mine:
            _leases.remove(entry)
    return _release([lease for lease, _ in mine])


def release_all():
    """Releases every lease the adapter opened; returns how many were open."""
    with _lock:
        taken = [lease for lease, _ in _leases]
        del _leases[:]
    return _release(taken)
