"""Route a TensorRT-LLM-style ``configure_cpu_affinity(device_id)`` to ``tllm_affinity``.

The server's own function pins every thread of the process and never restores (the bugs this
project answers). ``install`` replaces it, on the module or object that *calls* it, with one that
makes only the calling thread and its descendants workers and keeps the lease::

    import tensorrt_llm.executor.base_worker as base_worker
    from tllm_affinity.adapters import trtllm

    trtllm.install(base_worker)                       # base_worker.configure_cpu_affinity(...)
    trtllm.install(WorkerClass, shutdown="shutdown")  # also release when WorkerClass.shutdown runs

Shutdown: every lease the adapter opens is released by ``release_all()``, which runs
  * after the method named by ``shutdown=`` when one is given (the worker's shutdown hook),
  * at interpreter exit (``atexit``) in any case.
``release_all`` closes every lease the adapter opened in the process, whichever worker opened it;
the library restores masks when the last lease closes.

When libtllm_affinity.so is not preloaded, the wrapper warns once and calls the original
function, so installing the adapter never changes a program that runs without the library.
"""

import atexit
import functools
import threading
import warnings

import tllm_affinity

__all__ = ["install", "uninstall", "release_all", "leases"]

_ORIGINAL = "_tllm_affinity_original"
_lock = threading.Lock()
_leases = []
_atexit_registered = False
_warned = False


def _device_of(args, kwargs):
    """The device argument however the caller passes it (positional, gpu_id=, device_id=)."""
    if args:
        return args[0]
    for key in ("device_id", "gpu_id", "device"):
        if key in kwargs:
            return kwargs[key]
    return -1


def _wrap_configure(original):
    @functools.wraps(original)
    def configure_cpu_affinity(*args, **kwargs):
        global _warned
        if not tllm_affinity.available():
            if not _warned:
                _warned = True
                warnings.warn(
                    "tllm_affinity adapter: libtllm_affinity.so is not preloaded; calling the "
                    "original %s" % getattr(original, "__name__", "function"),
                    RuntimeWarning,
                    stacklevel=2,
                )
            return original(*args, **kwargs)
        lease = tllm_affinity.configure(int(_device_of(args, kwargs)))
        with _lock:
            _leases.append(lease)
        return lease

    setattr(configure_cpu_affinity, _ORIGINAL, original)
    return configure_cpu_affinity


def _wrap_shutdown(original):
    @functools.wraps(original)
    def shutdown(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            release_all()

    setattr(shutdown, _ORIGINAL, original)
    return shutdown


def install(target, name="configure_cpu_affinity", shutdown=None):
    """Replaces ``target.<name>`` with a wrapper that calls ``tllm_affinity.configure``.

    ``target`` is a module, class or object holding the function. ``shutdown`` names a method or
    function of ``target`` after which the adapter's leases are released. Installing twice is a
    no-op. Returns the wrapper. Raises AttributeError when ``target`` has no ``name``.
    """
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


def uninstall(target, name="configure_cpu_affinity", shutdown=None):
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
        return [lease for lease in _leases if not lease.released]


def release_all():
    """Releases every lease the adapter opened; returns how many were open."""
    with _lock:
        taken = list(_leases)
        del _leases[:]
    count = 0
    for lease in taken:
        if not lease.released and not lease.inert:
            count += 1
        lease.release()
    return count
