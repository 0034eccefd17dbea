"""TensorRT-LLM's ``configure_cpu_affinity(device_id)`` routed to libtllm_affinity.so.

Upstream's function pins every thread of the process and never restores it (the bugs this project
answers). Nobody has to call this module: the start-up hook (``_tllm_affinity_hook``, installed
by ``tllm-affinity run`` and by the pip package's ``.pth``) hands it ``tensorrt_llm.llmapi.utils``
the moment that module has executed, and :func:`patch_upstream` replaces, there and in every
module that already bound them under any name (and, through the original function objects
themselves, wherever a reference was stored before: :func:`_replace_everywhere`):

* ``configure_cpu_affinity(device_id)`` with :func:`_wrap_configure`'s wrapper. Same signature,
  returns None, never raises. The call site it is called from (the caller's module and function)
  is looked up in :data:`CALL_SITES`, the one table of the upstream call sites the adapter covers;
  the row decides how the worker is placed (:func:`_placement`) and when its lease ends (the
  owner's ``shutdown()``, or the entry function's return or raise). A caller the table does not
  know gets the thread rule of :func:`_placement` and a lease that ends at exit;
* whatever the adapter cannot fully place (a caller, parameter list, owner or function kind it
  does not know) still goes through the library, never through upstream's own function and its
  all-thread sweeps: those run only where the library is not loaded;
* the entry functions of the table (VisualGen's module-level ``run_diffusion_worker``), wrapped
  in their module at import with ``try``/``finally``, and the worker methods that are themselves
  the affinity call in older layouts (``RayGPUWorker._configure_affinity``);
* ``get_executor_loop_cpus(device_id)`` (``TLLM_EXECUTOR_LOOP_PIN=1``), under
  ``TLLM_AFFINITY_SLICE=gpu``, with :func:`_wrap_loop_pin`'s wrapper: the loop stays inside its
  GPU's slice (:func:`executor_loop_cpus` decides);
* upstream's all-thread sweeps (``_set_affinity_all_threads(cpus)``,
  ``_reapply_current_thread_affinity_to_all_threads()``), where a version has them, with functions
  that touch no thread: the library already put every worker thread on the set, and new worker
  threads are born on it, while a sweep would pin host threads with masks no release could undo.

``install(target)`` does the same for an explicitly named module or class, for programs that
carry their own copy of the function.
"""

import atexit
import collections
import functools
import inspect
import os
import sys
import threading
import types
import weakref

import tllm_affinity

__all__ = ["install", "uninstall", "patch_upstream", "status", "summary", "release_all",
           "leases", "CALL_SITES"]

CONFIGURE = "configure_cpu_affinity"
SWEEPS = ("_set_affinity_all_threads", "_reapply_current_thread_affinity_to_all_threads")
# Upstream's choice of CPUs for its executor loop under TLLM_EXECUTOR_LOOP_PIN=1 (the loop pins
# itself to what it returns).
LOOP_PIN = "get_executor_loop_cpus"
UPSTREAM_PACKAGE = "tensorrt_llm"
UTILS = "tensorrt_llm.llmapi.utils"
_ORIGINAL = "_tllm_affinity_original"
_LEVELS = {"off": 0, "error": 1, "warn": 2, "info": 3, "debug": 4}

# How a lease ends, per row.
OWNER_SHUTDOWN = "owner-shutdown"  # the worker object's shutdown() returns or raises
ENTRY_RETURN = "entry-return"      # the entry function returns or raises on that thread
AT_EXIT = "exit"                   # a caller the table does not know

# How the adapter reaches a row's call.
VIA_CONFIGURE = "configure"  # the row's function calls llmapi.utils.configure_cpu_affinity
VIA_ENTRY = "entry"          # the row's function is wrapped; its configure call is inside
VIA_METHOD = "method"        # the row's function is itself the affinity call (older layout)

# How a worker is placed (_placement).
PROCESS = "process"  # a dedicated worker process: configured whole, from its main thread
THREAD = "thread"    # the caller is the worker's own thread: it and its threads are workers
SCOPE = "scope"      # the caller goes on serving host work: threads it starts meanwhile are


CallSite = collections.namedtuple("CallSite", "name module qualname via ends dedicated")
CallSite.__doc__ = """One upstream call site: ``module`` and ``qualname`` of the function that
calls configure_cpu_affinity (or is the call, ``via``), how its lease ends and the rule that says
whether its process is dedicated (docs/runtimes.md has the table). No parameter list: the
wrappers take ``*args, **kwargs``, so a release that adds, drops or renames parameters is placed
the same way."""

# The one table of upstream call sites the adapter covers (docs/runtimes.md, "TensorRT-LLM call
# sites"). Every placement and lease-lifetime decision goes through it.
CALL_SITES = (
    CallSite("base_worker", "tensorrt_llm.executor.base_worker",
             "BaseWorker._get_comm_ranks_device_id", VIA_CONFIGURE, OWNER_SHUTDOWN,
             "worker_main on the stack: a worker rank (on the main thread, an MPI pool rank or a "
             "leader's rank > 0: the process; on a session's pool thread: that thread); "
             "otherwise the thread rule (TP1 under trtllm-serve or a script: not dedicated)"),
    CallSite("ray_gpu_worker", "tensorrt_llm.executor.ray.gpu_worker",
             "RayGPUWorker._get_comm_ranks_device_id", VIA_CONFIGURE, OWNER_SHUTDOWN,
             "always: a Ray actor process serves one GPU (on its main thread: the process)"),
    CallSite("ray_gpu_worker_legacy", "tensorrt_llm.executor.ray_gpu_worker",
             "RayGPUWorker._configure_affinity", VIA_METHOD, OWNER_SHUTDOWN,
             "always, as ray_gpu_worker (the older layout, before llmapi.utils had the function)"),
    CallSite("visual_gen", "tensorrt_llm._torch.visual_gen.executor",
             "run_diffusion_worker", VIA_ENTRY, ENTRY_RETURN,
             "its own process when on the main thread; rank 0 of an external launch runs it on "
             "a thread of the client's process: that thread"),
)
_BY_MODULE = {}
for _site in CALL_SITES:
    _BY_MODULE.setdefault(_site.module, []).append(_site)
# Module names the start-up hook hands over: utils and every call site's module.
WATCHED_MODULES = (UTILS,) + tuple(_BY_MODULE)

_lock = threading.Lock()
# (Lease, weak reference to the owning worker object or None, call site name, entry token)
_leases = []
_atexit_registered = False
_said = set()
_status = {"state": "not-imported"}
# Per call site: "not-imported", "found", "missing"; leases opened, closed.
_sites = {site.name: {"state": "not-imported", "opened": 0, "closed": 0} for site in CALL_SITES}
_sites["unknown"] = {"state": "caller", "opened": 0, "closed": 0}
# The entry calls running on this thread (innermost last), each a list of its leases.
_entries = threading.local()


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
    ``engaged`` or ``not-found`` (no configure_cpu_affinity to wrap);
    ``version`` (``tensorrt_llm.__version__``) and ``sites``: per row of :data:`CALL_SITES` whose
    module was imported (``found``, ``missing``), and ``unknown``
    callers once they opened one, its state and the leases it opened and closed."""
    with _lock:
        out = dict(_status)
        out["sites"] = {name: dict(site) for name, site in _sites.items()
                        if site["state"] != "not-imported" and site["opened"] + (name != "unknown")}
    out["version"] = _upstream_version()
    return out


def _upstream_version():
    package = sys.modules.get(UPSTREAM_PACKAGE)
    version = getattr(package, "__version__", None)
    return None if version is None else str(version)


def _set_status(state, where=None):
    _status["state"] = state
    if where is not None:
        _status["module"] = where
    _publish()


def _publish():
    """The report's ``adapters.trtllm`` (the state word) and ``adapter_details.trtllm`` (the line
    of :func:`summary`: the version, each call site found or missing, its leases)."""
    setter = getattr(tllm_affinity, "_note_adapter", None)
    if setter is not None:
        setter("trtllm", _status["state"])
    detail = getattr(tllm_affinity, "_note_adapter_detail", None)
    if detail is not None:
        detail("trtllm", summary())


def summary():
    """One line of what engaged: ``tensorrt_llm 1.2.0; base_worker found 2/2; visual_gen
    missing``: the version, then each row whose module was imported, with its leases
    opened/closed."""
    parts = ["tensorrt_llm %s" % (_upstream_version() or "?")]
    with _lock:
        for name, site in _sites.items():
            if site["state"] == "not-imported" or (name == "unknown" and not site["opened"]):
                continue
            part = "%s %s" % (name, site["state"])
            if site["opened"]:
                part += " %d/%d" % (site["opened"], site["closed"])
            parts.append(part)
    return "; ".join(parts)


def _site_state(site, state):
    with _lock:
        _sites[site.name]["state"] = state
    _publish()


def _count(name, key):
    with _lock:
        _sites[name][key] += 1


# The names upstream's releases and callers gave the device parameter.
DEVICE_PARAMETERS = ("device_id", "gpu_id", "device", "device_index", "gpu", "local_rank")


def _device_of(args, kwargs):
    """The device argument however the caller passes it: positional, by one of
    :data:`DEVICE_PARAMETERS`, or the one keyword of a renamed parameter; -1 (the library's own
    choice: ``TLLM_AFFINITY_GPU``, else the launcher's local rank) when there is none."""
    if args:
        return args[0]
    for key in DEVICE_PARAMETERS:
        if key in kwargs:
            return kwargs[key]
    if len(kwargs) == 1:
        return next(iter(kwargs.values()))
    return -1


def _takes_device(function):
    """True when ``function`` takes one device id positionally, as upstream's does."""
    try:
        inspect.signature(function).bind(0)
        return True
    except (TypeError, ValueError):
        return False


def _qualname(frame):
    """The qualified name of the function ``frame`` runs (``co_qualname`` from Python 3.11)."""
    code = frame.f_code
    qualname = getattr(code, "co_qualname", None)
    if qualname is not None:
        return qualname
    owner = frame.f_locals.get("self") if code.co_argcount else None
    for cls in type(owner).__mro__ if owner is not None else ():
        function = cls.__dict__.get(code.co_name)
        if getattr(function, "__code__", None) is code:
            return "%s.%s" % (cls.__name__, code.co_name)
    return code.co_name


def _site_of(frame):
    """The row of :data:`CALL_SITES` whose function ``frame`` runs, or None."""
    if frame is None:
        return None
    for site in _BY_MODULE.get(frame.f_globals.get("__name__", ""), ()):
        if site.qualname == _qualname(frame):
            return site
    return None


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


def _construction_frame(frames):
    """The frame whose return ends a worker scope: the outermost ``__init__`` of a TensorRT-LLM
    object (``LLM.__init__``), else the outermost TensorRT-LLM frame that is not a command-line
    entry point (``trtllm-serve``'s main serves forever)."""
    for frame in reversed(frames):
        if frame.f_code.co_name == "__init__":
            return frame
    for frame in reversed(frames):
        if not frame.f_globals.get("__name__", "").startswith(UPSTREAM_PACKAGE + ".commands"):
            return frame
    return None


def _runs_event_loop():
    asyncio = sys.modules.get("asyncio")
    try:
        return asyncio is not None and asyncio._get_running_loop() is not None
    except Exception:
        return False


def _worker_rank_on_stack(frame):
    """A worker rank's entry point (executor/worker.py's ``worker_main``) on the stack."""
    while frame is not None:
        if (frame.f_code.co_name == "worker_main"
                and frame.f_globals.get("__name__", "").startswith(UPSTREAM_PACKAGE + ".")):
            return True
        frame = frame.f_back
    return False


def _placement(site, frame):
    """How the worker of a configure call is placed (SPEC §10), from its row's rule:

    * ``PROCESS``: a dedicated worker process (a Ray actor, an MPI pool rank or a leader's rank
      > 0 running ``worker_main``, VisualGen in its own process), the call on its main thread:
      the caller is promoted with every thread of the process, as a dedicated worker at load;
    * ``THREAD``: the worker's own thread in a shared process (a session's pool thread, rank 0
      of VisualGen on a thread of the client): it and its threads are workers;
    * ``SCOPE``: the main thread of trtllm-serve or of a user's script, or an event-loop thread,
      which go on serving host work: a worker scope.

    A caller the table does not know, or an already dedicated one, gets the thread rule."""
    main = threading.current_thread() is threading.main_thread()
    if tllm_affinity.role() == "worker":
        return PROCESS if main else THREAD
    if site is not None and site.name == "base_worker" and _worker_rank_on_stack(frame):
        return PROCESS if main else THREAD
    if site is not None and site.name in ("ray_gpu_worker", "ray_gpu_worker_legacy"):
        return PROCESS if main else THREAD
    if site is not None and site.name == "visual_gen":
        return PROCESS if main else THREAD
    if main or _runs_event_loop():
        return SCOPE
    return THREAD


def _end_scope_when_returns(frame, lease):
    """Ends the worker scope when ``frame`` returns (or unwinds), with a profile function on this
    thread alone, removed then. A thread that already has a profiler keeps it, and the scope
    ends now: its worker threads are then born host, which costs placement but never a host
    thread's mask."""
    if frame is None or sys.getprofile() is not None:
        tllm_affinity.end_worker_scope(lease)
        return

    def profile(current, event, _arg):
        if event == "return" and current is frame:
            sys.setprofile(None)
            tllm_affinity.end_worker_scope(lease)

    sys.setprofile(profile)


def _remember(lease, owner, site_name, entry):
    global _atexit_registered
    ref = None
    if owner is not None:
        if callable(getattr(type(owner), "shutdown", None)):
            try:
                ref = weakref.ref(owner)
                _wrap_owner_shutdown(type(owner))
            except Exception:
                ref = None  # not weakly referable: released at exit instead
        else:
            _log("warn", "%s (%s) has no shutdown(): its worker's lease ends at exit"
                 % (type(owner).__qualname__, site_name),
                 once_key=("no-shutdown", type(owner).__qualname__))
    with _lock:
        _leases.append((lease, ref, site_name, entry))
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(release_all)


def _engage(device, caller, site=None, owner=None):
    """Opens the lease for a call of configure_cpu_affinity from ``caller`` (the frame of the
    function that called it; ``site`` and ``owner`` given by a VIA_METHOD wrapper). A library
    error (no such device, passive library) was already said in one line by the library:
    nothing is pinned and the server runs on."""
    if site is None:
        site = _site_of(caller)
    placement = _placement(site, caller)
    lib = tllm_affinity._require()
    scope = placement == SCOPE
    opened = lib.tllm_affinity_begin_worker_scope if scope else lib.tllm_affinity_configure
    rc = opened(device)
    if rc < 0:
        _log("debug", "configure_cpu_affinity(%d): %s; no thread pinned"
             % (device, os.strerror(-rc)))
        return
    lease = tllm_affinity.Lease(int(rc), device)
    name = site.name if site is not None else "unknown"
    _count(name, "opened")
    try:
        _follow(lease, device, caller, site, owner, scope, placement, name)
    except Exception as error:
        # The lease is open: a scope left open would make the caller's later threads (an HTTP
        # server's) workers, so it ends now; the lease itself ends at exit.
        if scope:
            tllm_affinity.end_worker_scope(lease)
        _remember(lease, None, name, None)
        _log("warn", "configure_cpu_affinity(%d): %s: %s; its lease ends at exit"
             % (device, type(error).__name__, error))
    _publish()


def _follow(lease, device, caller, site, owner, scope, placement, name):
    """Arranges the end of an opened lease: the scope's construction frame, the owner's
    ``shutdown()``, the entry function's return, else exit."""
    _log("debug", "configure_cpu_affinity(%d) from %s: %s, lease %d ends at %s"
         % (device, name, placement, lease.id, site.ends if site is not None else AT_EXIT))
    if scope:
        _end_scope_when_returns(_construction_frame(_upstream_frames(caller)), lease)
    entry = None
    if site is not None and site.ends == OWNER_SHUTDOWN and owner is None:
        owner = caller.f_locals.get("self")
    if site is not None and site.ends == ENTRY_RETURN:
        running = getattr(_entries, "stack", None)
        entry = running[-1] if running else None
    _remember(lease, owner if site is not None and site.ends == OWNER_SHUTDOWN else None,
              name, entry)
    if entry is not None:
        entry.append(lease)


def _wrap_configure(original):
    @functools.wraps(original)
    def configure_cpu_affinity(*args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_code in _TRAMPOLINES:  # called through a reference to the original
            caller = caller.f_back
        site = _site_of(caller)
        if site is not None and _sites[site.name]["state"] == "not-imported":
            # Its module was imported before the hook: checked now, once.
            patch_upstream(sys.modules.get(site.module))
        return _configure(original, args, kwargs, caller, site, None)

    setattr(configure_cpu_affinity, _ORIGINAL, original)
    return configure_cpu_affinity


def _configure(original, args, kwargs, caller, site, owner):
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
        _engage(device, caller, site, owner)
    except Exception as error:  # never into the worker's start-up
        _log("warn", "configure_cpu_affinity(%d): %s: %s; no thread pinned"
             % (device, type(error).__name__, error))
    return None


def _wrap_method_call(original, site):
    """A worker method that is itself the affinity call (``RayGPUWorker._configure_affinity(self,
    device_id)`` of the older layout): the lease belongs to ``self``. A coroutine method gets a
    coroutine that places the worker when awaited, as the method would have."""
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def method(self, *args, **kwargs):
            return _configure(functools.partial(original, self), args, kwargs,
                              sys._getframe(1), site, self)
    else:
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            return _configure(functools.partial(original, self), args, kwargs,
                              sys._getframe(1), site, self)

    setattr(method, _ORIGINAL, original)
    return method


class _Entry:
    """One call of an entry function on this thread: the leases it opened, ended at its return
    or raise; never raises into the worker's own exit."""

    def __init__(self, site):
        self.site = site
        self.leases = []
        try:
            self.stack = _entries.__dict__.setdefault("stack", [])
            self.stack.append(self.leases)
        except Exception:
            self.stack = None

    def end(self):
        try:
            if self.stack is not None and self.stack and self.stack[-1] is self.leases:
                self.stack.pop()
            _release_entry(self.leases)
        except Exception as error:
            _log("warn", "ending %s's lease: %s: %s" % (self.site.qualname,
                                                       type(error).__name__, error))


def _wrap_entry(original, site):
    """An entry function whose return or raise on this thread ends the leases it opened: a
    ``try``/``finally``, no profiler (one would run on every call of the serving loop);
    ``functools.wraps`` keeps the name and qualname, so pickle (spawn) still finds it in its
    module. Any parameters pass through. A generator's or coroutine's body runs when it is
    iterated or awaited, so the wrapper is one too; an async generator's leases end at exit."""
    if inspect.isasyncgenfunction(original):
        return None
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def entry(*args, **kwargs):
            call = _Entry(site)
            try:
                return await original(*args, **kwargs)
            finally:
                call.end()
    elif inspect.isgeneratorfunction(original):
        @functools.wraps(original)
        def entry(*args, **kwargs):
            call = _Entry(site)
            try:
                return (yield from original(*args, **kwargs))
            finally:
                call.end()
    else:
        @functools.wraps(original)
        def entry(*args, **kwargs):
            call = _Entry(site)
            try:
                return original(*args, **kwargs)
            finally:
                call.end()

    setattr(entry, _ORIGINAL, original)
    return entry


def _wrap_sweep(original):
    @functools.wraps(original)
    def sweep(*args, **kwargs):
        _log("debug", "%s: left to libtllm_affinity.so, which placed every worker thread and "
             "no host thread" % getattr(original, "__name__", "sweep"),
             once_key=("sweep", getattr(original, "__name__", "")))
        return None

    setattr(sweep, _ORIGINAL, original)
    return sweep


def executor_loop_cpus(wanted, slice_cpus, step_core):
    """Where the executor loop goes under slicing: upstream's ``wanted`` CPUs when they lie inside
    the GPU's slice (``slice_cpus``, a set; None when slicing is off), else the slice's step core
    (``step_core``, or the whole slice where it has none). ``(cpus, why)``; ``why`` is None where
    upstream's choice stands untouched (no pin asked for, or no slice)."""
    wanted = list(wanted or [])
    if not wanted or slice_cpus is None:
        return wanted, None
    if set(wanted) <= slice_cpus:
        return wanted, "upstream's CPUs %s lie inside the GPU's slice" % wanted
    outside = sorted(set(wanted) - slice_cpus)
    if step_core:
        return sorted(step_core), ("upstream's CPUs %s leave the GPU's slice (%s outside it): "
                                   "on the slice's step core instead" % (wanted, outside))
    return sorted(slice_cpus), ("upstream's CPUs %s leave the GPU's slice (%s outside it), which "
                                "has no step core: on the whole slice instead" % (wanted, outside))


def _cpu_list(text):
    """A kernel CPU list (``0-3,8``) as a set."""
    cpus = set()
    for part in filter(None, (text or "").split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _lease_slice(device):
    """(slice, step core) of this process's newest open lease on ``device`` (the index
    configure_cpu_affinity was given), as sets; (None, None) when it was opened without slicing."""
    for lease in reversed(tllm_affinity.report().get("leases", [])):
        if lease.get("gpu") == device and "slice" in lease:
            return _cpu_list(lease["slice"]), _cpu_list(lease.get("slice_step_core"))
    return None, None


def _wrap_loop_pin(original):
    @functools.wraps(original)
    def get_executor_loop_cpus(*args, **kwargs):
        wanted = original(*args, **kwargs)
        if not wanted:
            return wanted
        try:
            device = int(_device_of(args, kwargs))
            cpus, why = executor_loop_cpus(wanted, *_lease_slice(device))
        except Exception as error:  # never into the executor's start-up
            _log("warn", "%s: %s: %s; upstream's CPUs %s stand"
                 % (LOOP_PIN, type(error).__name__, error, list(wanted)))
            return wanted
        if why is not None:
            _log("info", "executor loop of GPU %d on CPUs %s: %s" % (device, cpus, why))
        return cpus

    setattr(get_executor_loop_cpus, _ORIGINAL, original)
    return get_executor_loop_cpus


def _wrap_owner_shutdown(cls):
    current = getattr(cls, "shutdown")
    if hasattr(current, _ORIGINAL):
        return

    if inspect.iscoroutinefunction(current):
        @functools.wraps(current)
        async def shutdown(self, *args, **kwargs):
            try:
                return await current(self, *args, **kwargs)
            finally:
                _release_owned_by(self)
    else:
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
    """Every loaded module that bound one of the replaced functions, under its own name or any
    other (``from ..utils import configure_cpu_affinity as pin``), gets the wrapper."""
    wrappers = {id(original): wrapper for original, wrapper in replaced.values()}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        try:
            for name, value in list(namespace.items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None and value is not wrapper:
                    namespace[name] = wrapper
        except Exception:
            continue  # a module whose namespace is not a plain mapping of names


# Where a redirected function finds its wrapper: a dict in the function's own module namespace,
# by qualified name (the trampoline's code looks it up as a global).
_REDIRECTS = "__tllm_affinity_redirects__"
# The trampolines' code objects: a wrapper called through one looks one frame further back.
_TRAMPOLINES = set()


def _detached(function):
    """A copy of ``function`` (same code, globals, defaults, closure) for the wrapper to call, so
    that the function object itself can then be redirected to the wrapper; None where it cannot
    be: not a plain Python function, or one with free variables (a nested or decorated function:
    its code cannot be swapped for a trampoline without any)."""
    if type(function) is not types.FunctionType or function.__closure__:
        return None
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = dict(function.__kwdefaults__) if function.__kwdefaults__ else None
    copy.__dict__.update(function.__dict__)
    for attribute in ("__qualname__", "__module__", "__doc__", "__annotations__"):
        setattr(copy, attribute, getattr(function, attribute))
    return copy


def _redirect(function, copy, wrapper):
    """Makes ``function`` itself run ``wrapper``: its code becomes a trampoline that calls the
    wrapper, so every reference taken before the adapter arrived (an alias under any name, a list,
    a dict, a ``functools.partial``, a default argument, a class attribute) reaches it. The
    wrapper calls ``copy`` (:func:`_detached`), the original's own code. ``inspect`` still shows
    the original's signature (``__wrapped__``)."""
    key = function.__qualname__
    targets = function.__globals__.setdefault(_REDIRECTS, {})
    targets[key] = wrapper
    scope = {}
    source = ("def trampoline(*args, **kwargs):\n"
              "    return %s[%r](*args, **kwargs)\n" % (_REDIRECTS, key))
    exec(compile(source, function.__code__.co_filename, "exec"), scope)
    code = scope["trampoline"].__code__.replace(co_name=function.__code__.co_name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=function.__code__.co_qualname)
    _TRAMPOLINES.add(code)
    function.__code__ = code
    function.__wrapped__ = copy
    setattr(function, _ORIGINAL, copy)


def _replace_everywhere(module, wrapped):
    """``wrapped``: name -> (original, make), ``make(callable)`` building the wrapper around the
    function it is to call. Replaces each in ``module`` and in every module that bound it, and
    redirects the original function object itself to its wrapper where it can (:func:`_redirect`),
    so that references stored before the adapter arrived reach the wrapper too."""
    replaced = {}
    redirects = []
    for name, (original, make) in wrapped.items():
        copy = _detached(original)
        wrapper = make(copy if copy is not None else original)
        replaced[name] = (original, wrapper)
        if copy is not None:
            redirects.append((original, copy, wrapper))
        else:
            _log("debug", "%s.%s cannot be redirected (%s): references to it stored before the "
                 "adapter arrived keep it" % (getattr(module, "__name__", "?"), name,
                                              type(original).__name__),
                 once_key=("no-redirect", name))
    _replace(module, replaced)
    for original, copy, wrapper in redirects:
        try:
            _redirect(original, copy, wrapper)
        except Exception as error:
            _log("debug", "redirecting %s: %s: %s" % (original.__qualname__,
                                                      type(error).__name__, error))
    return replaced


def _lookup(module, qualname):
    """(holder, attribute name, function) for ``qualname`` in ``module``, or None."""
    holder = module
    *path, name = qualname.split(".")
    for part in path:
        holder = getattr(holder, part, None)
        if holder is None:
            return None
    function = inspect.getattr_static(holder, name, None) if path else getattr(holder, name, None)
    if function is None or not callable(function):
        return None
    return holder, name, function


def _patch_site(module, site):
    """Checks one call site in its module just imported, and wraps it when ``via`` says so."""
    found = _lookup(module, site.qualname)
    if found is None:
        _site_state(site, "missing")
        _log("info", "%s has no %s: its callers get the library's thread rule, their leases "
             "ending at exit (a moved or renamed upstream)" % (site.module, site.qualname),
             once_key=("missing", site.name))
        return
    holder, name, function = found
    if hasattr(function, _ORIGINAL):
        return
    if site.via == VIA_ENTRY:
        wrapper = _wrap_entry(function, site)
        if wrapper is None:
            _log("warn", "%s.%s is an async generator function: its worker's lease ends at "
                 "exit" % (site.module, site.qualname), once_key=("asyncgen", site.name))
        else:
            setattr(holder, name, wrapper)
            _rebind({name: (function, wrapper)})
    elif site.via == VIA_METHOD:
        setattr(holder, name, _wrap_method_call(function, site))
        if _status.get("state") != "engaged":
            # The older layout's own method is the affinity call: the adapter is engaged there.
            _set_status("engaged", site.module)
    _site_state(site, "found")


def patch_upstream(module):
    """Wraps ``configure_cpu_affinity`` and the sweeps in ``module`` (tensorrt_llm.llmapi.utils)
    and in every module that imported them, or checks and wraps the call sites of a call site's
    module; called by the start-up hook. Never raises."""
    where = getattr(module, "__name__", repr(module))
    try:
        if not tllm_affinity.available():
            _status["state"] = "not-loaded"
            return
        if where in _BY_MODULE:
            for site in _BY_MODULE[where]:
                _patch_site(module, site)
            return
        _patch_utils(module, where)
    except Exception as error:
        # Upstream's sweeps would pin host threads: where they can still be turned off, they are.
        try:
            _replace_everywhere(module, _sweeps_of(module))
        except Exception:
            pass
        _log("warn", "the TensorRT-LLM adapter could not patch %s: %s: %s; it is not covered, "
             "and upstream's all-thread sweeps there touch no thread"
             % (where, type(error).__name__, error))


def _sweeps_of(module):
    """Upstream's all-thread sweeps in ``module``, each with how to make its wrapper, one that
    touches no thread (see :func:`_replace_everywhere`)."""
    found = {}
    for name in SWEEPS:
        sweep = getattr(module, name, None)
        if callable(sweep) and not hasattr(sweep, _ORIGINAL):
            found[name] = (sweep, _wrap_sweep)
    return found


def _replace(module, replaced):
    for name, (_, wrapper) in replaced.items():
        setattr(module, name, wrapper)
    _rebind(replaced)


def _patch_utils(module, where):
    original = getattr(module, CONFIGURE, None)
    if original is None or not callable(original):
        # A renamed function would still call the sweeps: they touch no thread either.
        _replace_everywhere(module, _sweeps_of(module))
        _set_status("not-found", where)
        _log("warn", "found no %s in %s: the TensorRT-LLM adapter did not engage (adapter "
             "inactive). A release from before the all-thread pin does not pin threads itself, "
             "and tllm-affinity changes no mask in it unless the program calls tllm_affinity; "
             "upstream's all-thread sweeps, where present, touch no thread"
             % (CONFIGURE, where), once_key="not-found")
        return
    if hasattr(original, _ORIGINAL):
        return
    if not _takes_device(original):
        _log("warn", "%s.%s%s does not take a device id as the adapter knows it: the library "
             "places the caller's worker threads for the device its callers pass (else "
             "TLLM_AFFINITY_GPU or the launcher's local rank); host threads are left alone"
             % (where, CONFIGURE, _signature_text(original)), once_key="signature")
    wrapped = {CONFIGURE: (original, _wrap_configure)}
    loop_pin = getattr(module, LOOP_PIN, None)
    if callable(loop_pin) and not hasattr(loop_pin, _ORIGINAL):
        wrapped[LOOP_PIN] = (loop_pin, _wrap_loop_pin)
    wrapped.update(_sweeps_of(module))
    replaced = _replace_everywhere(module, wrapped)
    _set_status("engaged", where)
    _log("debug", "TensorRT-LLM adapter engaged in %s (%s)" % (where, ", ".join(replaced)))


def _signature_text(function):
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(...)"


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
        return [entry[0] for entry in _leases if not entry[0].released]


def _release(taken):
    """Releases ``taken`` ((lease, owner, site, entry) rows); counts them per site."""
    count = 0
    for lease, _, site_name, _ in taken:
        if not lease.released and not lease.inert:
            count += 1
            _count(site_name, "closed")
        try:
            lease.release()
        except Exception as error:
            _log("warn", "releasing lease %s: %s" % (lease.id, error))
    if taken:
        _publish()
    return count


def _take(keep):
    with _lock:
        mine = [entry for entry in _leases if not keep(entry)]
        _leases[:] = [entry for entry in _leases if keep(entry)]
    return mine


def _release_owned_by(owner):
    return _release(_take(lambda e: e[1] is None or e[1]() is not owner))


def _release_entry(opened):
    """The leases an entry call opened, at its return or raise."""
    if opened:
        _release(_take(lambda e: e[3] is not opened))


def release_all():
    """Releases every lease the adapter opened; returns how many were open."""
    return _release(_take(lambda e: False))
