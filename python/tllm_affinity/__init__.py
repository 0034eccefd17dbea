"""Python access to libtllm_affinity.so, role-aware CPU affinity for GPU inference servers.

Pure Python over ctypes: nothing to build. The library itself must be preloaded into the process
(it interposes ``pthread_create`` from the first thread on), so start the program under it::

    tllm-affinity run -- python serve.py
    LD_PRELOAD=/abs/path/libtllm_affinity.so python serve.py

then::

    import tllm_affinity

    with tllm_affinity.worker(device_id=0):      # this thread and its threads become workers
        engine.run()                              # masks are restored on exit

    lease = tllm_affinity.configure(0)            # or keep a lease open explicitly
    ...
    lease.release()                               # idempotent

    with tllm_affinity.worker_scope(0) as lease:  # this thread stays a host; the threads it
        engine = build_engine()                   # starts in here are workers
    serve_http(engine)                            # threads started here are hosts
    lease.release()                               # the scope's lease restores like any other

Errors:

* the library is not preloaded: ``available()`` is False and every other call raises
  :class:`TllmAffinityUnavailable` (a ``RuntimeError``) saying how to preload it;
* a call returns ``-errno``: :class:`OSError` with that errno — except ``configure`` and
  ``begin_worker_scope`` answering ``ENOTSUP`` (the library is passive after a bad setting, or
  disabled: secure execution, ``TLLM_AFFINITY_DISABLE=1``), which warn with ``warnings.warn`` and return an inert :class:`Lease` (``id`` is None,
  ``release`` does nothing), so a server keeps running exactly as it would without the library.
"""

import contextlib
import ctypes
import errno
import json
import os
import threading
import warnings

__all__ = [
    "Lease",
    "TllmAffinityUnavailable",
    "available",
    "begin_worker_scope",
    "configure",
    "end_worker_scope",
    "include_dir",
    "library_path",
    "pin_result_thread",
    "pin_step_thread",
    "release",
    "report",
    "role",
    "version",
    "worker",
    "worker_scope",
]

# The workspace's version (Cargo.toml); scripts/wheel and tests/process/wheel.rs check that they agree.
__version__ = "0.1.0"

LIBRARY = "libtllm_affinity.so"


class TllmAffinityUnavailable(RuntimeError):
    """libtllm_affinity.so is not loaded in this process."""


_UNAVAILABLE = (
    LIBRARY + " is not loaded in this process: start the program under it, with "
    "`tllm-affinity run -- python ...` or LD_PRELOAD=/abs/path/" + LIBRARY + " python ... "
    "(it must be preloaded, not loaded later, to see every thread being created)"
)

# The C ABI's prototypes (include/tllm_affinity.h), the names without their `tllm_affinity_`,
# grouped by signature: (return type, argument types, names).
_PROTOTYPES = (
    (ctypes.c_int64, [ctypes.c_int32], ("configure", "begin_worker_scope")),
    (ctypes.c_int32, [ctypes.c_int64], ("release", "end_worker_scope")),
    (ctypes.c_int32, [ctypes.c_int32], ("role", "pin_step_thread", "pin_result_thread")),
    (ctypes.c_int64, [ctypes.c_char_p, ctypes.c_uint64], ("report",)),
    (ctypes.c_char_p, [], ("version",)),
    (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_char_p], ("note_adapter", "note_adapter_detail")),
)
# An older library has none of these.
_OPTIONAL = {"note_adapter_detail"}

_lib_lock = threading.Lock()
_lib = None
_lib_checked = False


def _load():
    """The process's own symbol table when the library's functions are in it, else None."""
    global _lib, _lib_checked
    with _lib_lock:
        if _lib_checked:
            return _lib
        try:
            lib = ctypes.CDLL(None)
            lib.tllm_affinity_configure  # raises AttributeError when not preloaded
        except (OSError, AttributeError):
            lib = None
        if lib is not None:
            for restype, argtypes, names in _PROTOTYPES:
                for name in names:
                    if name in _OPTIONAL and not hasattr(lib, "tllm_affinity_" + name):
                        continue
                    function = getattr(lib, "tllm_affinity_" + name)
                    function.restype, function.argtypes = restype, argtypes
        _lib = lib
        _lib_checked = True
        return lib


def _require():
    lib = _load()
    if lib is None:
        raise TllmAffinityUnavailable(_UNAVAILABLE)
    return lib


def _raise_errno(rc, call):
    code = -int(rc)
    raise OSError(code, "%s: %s" % (call, os.strerror(code)))


_HERE = os.path.dirname(os.path.abspath(__file__))


def library_path():
    """The absolute path of the libtllm_affinity.so installed with this package (the wheel ships
    it in ``tllm_affinity/_lib/``), or None when the package was installed without it (from
    ``python/`` alone). This is what ``tllm-affinity run`` preloads; ``LD_PRELOAD`` takes it too.
    """
    path = os.path.join(_HERE, "_lib", LIBRARY)
    return path if os.path.isfile(path) else None


def include_dir():
    """The directory of the installed C header ``tllm_affinity.h``, or None without it."""
    path = os.path.join(_HERE, "include")
    return path if os.path.isfile(os.path.join(path, "tllm_affinity.h")) else None


def available():
    """True when libtllm_affinity.so is loaded in this process (it was preloaded)."""
    return _load() is not None


def _note_adapter(name, state):
    """Records in the library's report what an adapter did (``adapters`` in docs/report.md)."""
    lib = _load()
    if lib is not None:
        lib.tllm_affinity_note_adapter(name.encode(), state.encode())


def _note_adapter_detail(name, detail):
    """Records in the library's report one line of what an adapter engaged (``adapter_details``).
    """
    lib = _load()
    setter = getattr(lib, "tllm_affinity_note_adapter_detail", None) if lib is not None else None
    if setter is not None:
        line = detail.encode("ascii", "replace")[:512]
        setter(name.encode(), line)


def version():
    """The library's version string."""
    return _require().tllm_affinity_version().decode()


class Lease:
    """An open configuration of worker threads for one device (docs/reference.md, "Leases and
    restoration").

    ``id`` is the library's lease id (> 0), or None for an inert lease (the library was passive).
    ``release()`` closes it; only the last open lease restores masks. Releasing twice is fine. A
    lease is not released when garbage-collected: close it, or use it as a context manager.
    """

    __slots__ = ("id", "device_id", "_released", "_lock")

    def __init__(self, lease_id, device_id):
        self.id = lease_id
        self.device_id = device_id
        self._released = lease_id is None
        self._lock = threading.Lock()

    @property
    def inert(self):
        """True for the lease of a passive library, which changed nothing."""
        return self.id is None

    @property
    def released(self):
        return self._released

    def release(self):
        """Closes the lease; a no-op when it is already closed or inert."""
        with self._lock:
            if self._released:
                return
            self._released = True
        rc = _require().tllm_affinity_release(self.id)
        # ENOENT: the lease was closed through the C ABI already, which is what we want;
        # ENOTSUP: the library is off (TLLM_AFFINITY_DISABLE=1), nothing to close.
        if rc < 0 and rc not in (-errno.ENOENT, -errno.ENOTSUP):
            _raise_errno(rc, "tllm_affinity_release(%d)" % self.id)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release()
        return False

    def __repr__(self):
        state = "inert" if self.inert else ("released" if self._released else "open")
        return "Lease(id=%r, device_id=%r, %s)" % (self.id, self.device_id, state)


def _open(call, device_id):
    """Opens a lease with ``tllm_affinity_<call>``; ENOTSUP gives a warning and an inert Lease."""
    device_id = int(device_id)
    rc = getattr(_require(), "tllm_affinity_" + call)(device_id)
    if rc == -errno.ENOTSUP:
        warnings.warn(
            LIBRARY + " is passive or disabled in this process (a bad setting was reported at "
            "load, secure execution, or TLLM_AFFINITY_DISABLE=1): %s(%d) changed nothing"
            % (call, device_id),
            RuntimeWarning,
            stacklevel=3,
        )
        return Lease(None, device_id)
    if rc < 0:
        _raise_errno(rc, "tllm_affinity_%s(%d)" % (call, device_id))
    return Lease(int(rc), device_id)


def configure(device_id=-1):
    """Makes the calling thread a worker, with its live descendants, and applies the policy.

    ``device_id`` is a CUDA device number as torch.cuda counts them, or -1 for TLLM_AFFINITY_GPU,
    else the launcher's local rank. Returns a :class:`Lease`.
    """
    return _open("configure", device_id)


def begin_worker_scope(device_id=-1):
    """Opens a worker scope: the calling thread keeps its role, the threads it creates until
    :func:`end_worker_scope` are workers (and so are theirs). The policy applies as for
    :func:`configure`. Returns a :class:`Lease`, which stays open after the scope ends.
    """
    return _open("begin_worker_scope", device_id)


def end_worker_scope(lease):
    """Ends the worker scope of ``lease`` (a :class:`Lease` or a lease id) without releasing it.

    A no-op for an inert lease, or a scope already ended or released.
    """
    if isinstance(lease, Lease):
        if lease.inert:
            return
        lease = lease.id
    rc = _require().tllm_affinity_end_worker_scope(int(lease))
    # ENOENT: no open scope has this lease any more, which is what we want; ENOTSUP: off.
    if rc < 0 and rc not in (-errno.ENOENT, -errno.ENOTSUP):
        _raise_errno(rc, "tllm_affinity_end_worker_scope(%d)" % int(lease))


def release(lease):
    """Closes ``lease`` (a :class:`Lease` or a lease id); idempotent for Lease objects."""
    if isinstance(lease, Lease):
        lease.release()
        return
    rc = _require().tllm_affinity_release(int(lease))
    if rc < 0:
        _raise_errno(rc, "tllm_affinity_release(%d)" % int(lease))


@contextlib.contextmanager
def worker(device_id=-1):
    """Configures the calling thread as a worker for ``device_id`` and releases on exit."""
    lease = configure(device_id)
    try:
        yield lease
    finally:
        lease.release()


@contextlib.contextmanager
def worker_scope(device_id=-1):
    """A worker scope for the block: threads the calling thread starts in it are workers.

    Yields the :class:`Lease`; the scope ends at exit but the lease stays open (docs/reference.md,
    "Python API"), so the workers stay placed until ``lease.release()``.
    """
    lease = begin_worker_scope(device_id)
    try:
        yield lease
    finally:
        end_worker_scope(lease)


def role(tid=None):
    """``"host"`` or ``"worker"`` for a thread the library knows, else None.

    ``tid`` is a kernel thread id (``threading.get_native_id()``); None means the caller.
    """
    rc = _require().tllm_affinity_role(0 if tid is None else int(tid))
    if rc == 0:
        return "host"
    if rc == 1:
        return "worker"
    if rc in (-errno.ENOENT, -errno.ENOTSUP):
        return None
    _raise_errno(rc, "tllm_affinity_role(%s)" % tid)


def report():
    """The library's JSON snapshot of the process (schema in docs/report.md), as a dict."""
    lib = _require()
    size = lib.tllm_affinity_report(None, 0)
    while True:
        buf = ctypes.create_string_buffer(size + 1)
        needed = lib.tllm_affinity_report(buf, size + 1)
        if needed <= size:
            return json.loads(buf.value.decode())
        size = needed  # a thread was born between the two calls: ask again


def pin_step_thread(device_id=-1):
    """Pins the calling thread as ``device_id``'s step thread (TLLM_AFFINITY_STEP_CORE).

    Returns the number of CPUs pinned to; 0 when the setting is off or the pool is too small
    (the library warns why).
    """
    rc = _require().tllm_affinity_pin_step_thread(int(device_id))
    if rc < 0:
        _raise_errno(rc, "tllm_affinity_pin_step_thread(%d)" % int(device_id))
    return int(rc)


def pin_result_thread(device_id=-1):
    """Pins the calling thread as ``device_id``'s result thread; returns like pin_step_thread."""
    rc = _require().tllm_affinity_pin_result_thread(int(device_id))
    if rc < 0:
        _raise_errno(rc, "tllm_affinity_pin_result_thread(%d)" % int(device_id))
    return int(rc)
