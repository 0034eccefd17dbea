"""The Python start-up hook of tllm-affinity: fixes an unmodified TensorRT-LLM server.

Python runs ``install()`` at start-up, from ``tllm_affinity.pth`` (installed with the package) or
from the ``sitecustomize`` that ``tllm-affinity run`` puts on ``PYTHONPATH``. It imports nothing
of the package: it adds an import hook, which waits for ``tensorrt_llm.llmapi.utils`` (and each
call site's module) to finish executing and then hands the module to
``tllm_affinity.adapters.trtllm.patch_upstream`` (docs/runtimes.md says what that wraps).

Whether libtllm_affinity.so is in the process is asked of the process itself, never of a file
name: its exported function ``tllm_affinity_configure`` is in the process's global symbol scope
(a renamed or versioned copy, a module system's path, ``/etc/ld.so.preload``, a program that
loaded it before starting Python: all the same). It is asked once at start-up, so that the hook
can tell the library it runs in this interpreter (the library says so, once, in a process whose
interpreter started without the hook: ``-S``, the package not installed where ``-E``/``-I`` look),
and again when a watched module is imported, which is when it matters. The finder is installed
either way: it answers for five module names and lets every other import go past.

It does nothing when ``TLLM_AFFINITY_PYTHON_HOOKS=0`` or ``TLLM_AFFINITY_DISABLE=1``, and the adapter is never imported in a
process without the library. It never raises: a failure is one line on stderr and the program
runs on as without it.

This module is top-level, not part of the ``tllm_affinity`` package, so that start-up never pays
for importing the package (ctypes, json): it loads ``_ctypes`` alone, the C extension under
ctypes (about half a millisecond), to look the symbol up.
"""

import os
import sys

# The adapter's WATCHED_MODULES (kept here so that start-up imports nothing; tests/process/python_hook.rs
# checks that the two agree): upstream's utils, then the module of each call site it covers.
UPSTREAM_MODULES = (
    "tensorrt_llm.llmapi.utils",
    "tensorrt_llm.executor.base_worker",
    "tensorrt_llm.executor.ray.gpu_worker",
    "tensorrt_llm.executor.ray_gpu_worker",
    "tensorrt_llm._torch.visual_gen.executor",
)
SWITCH = "TLLM_AFFINITY_PYTHON_HOOKS"
# The library's off switch: at 1 the library is inert and the hook steps aside, so upstream's own
# configure_cpu_affinity runs unwrapped, as without the library. Any other value leaves the hook
# on; the library says, once, that a malformed one is not "disabled".
OFF_SWITCH = "TLLM_AFFINITY_DISABLE"
PREFIX = "[tllm-affinity] "

_installed = False


def _say(line):
    try:
        sys.stderr.write(PREFIX + line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def enabled():
    """False when TLLM_AFFINITY_PYTHON_HOOKS=0 or TLLM_AFFINITY_DISABLE=1; a malformed
    TLLM_AFFINITY_PYTHON_HOOKS keeps the hook on, with a line."""
    # Trimmed as the library trims (ASCII white space but \v), so both judge a value alike.
    if os.environ.get(OFF_SWITCH, "").strip(" \t\n\r\f") == "1":
        return False
    value = os.environ.get(SWITCH)
    if value is None or value.strip() in ("", "1"):
        return True
    if value.strip() == "0":
        return False
    _say("%s='%s' is not valid: expected 0 or 1; the Python hook stays on" % (SWITCH, value))
    return True


# Exported by libtllm_affinity.so under any file name (include/tllm_affinity.h): the first says
# the library is in the process; the second is how this hook tells it that it ran.
LIBRARY_SYMBOL = "tllm_affinity_configure"
NOTE_SYMBOL = "tllm_affinity_note_adapter"
# The note that says so: adapter "python", state "hook".
HOOK_NOTE = (b"python", b"hook")

_library_found = False
_registered = False


def _symbol(name):
    """The address of ``name`` in this process's global symbol scope (what the dynamic loader
    resolves against: the program, its libraries, whatever was preloaded), or None."""
    import _ctypes

    try:
        return _ctypes.dlsym(_ctypes.dlopen(None), name)
    except OSError:
        return None


def library_loaded():
    """True when libtllm_affinity.so is in this process, whatever file it came from. Asked anew
    until it is found (a program may load it after start-up); never raises."""
    global _library_found
    if not _library_found:
        try:
            _library_found = _symbol(LIBRARY_SYMBOL) is not None
        except Exception:
            return False
    return _library_found


def _register():
    """Tells the library that this interpreter runs the hook (``tllm_affinity_note_adapter
    ("python", "hook")``), once; a process whose interpreter started without it gets one line from
    the library. Called through ``_ctypes`` alone: importing ``ctypes`` would cost every
    interpreter under the library ten times more."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        import _ctypes

        address = _symbol(NOTE_SYMBOL)
        if address is None:
            return

        class _Int(_ctypes._SimpleCData):
            _type_ = "i"

        class _Note(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL
            _restype_ = _Int

        _Note(address)(*HOOK_NOTE)
    except Exception:
        pass  # the library then says the hook did not run; the adapter still works


def _patch(module):
    if not library_loaded():
        return
    try:
        _register()
        from tllm_affinity.adapters import trtllm

        trtllm.patch_upstream(module)
    except Exception as error:  # never into the server's import
        _say("the TensorRT-LLM adapter could not be installed: %s: %s; the server runs "
             "unchanged" % (type(error).__name__, error))


class _PatchingLoader:
    """Runs the real loader, then the adapter; puts the real loader back on the module."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        _patch(module)


class _UpstreamFinder:
    """Answers for one module name only; every other import goes straight past it."""

    def find_spec(self, name, path=None, target=None):
        if name not in UPSTREAM_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec

    def invalidate_caches(self):
        pass


def install():
    """Installs the import hook once per interpreter; never raises."""
    global _installed
    try:
        if _installed or not enabled():
            return
        _installed = True
        if library_loaded():
            _register()
        for name in UPSTREAM_MODULES:
            already = sys.modules.get(name)
            if already is not None:
                _patch(already)
        sys.meta_path.insert(0, _UpstreamFinder())
    except Exception as error:
        _say("the Python start-up hook failed: %s: %s" % (type(error).__name__, error))
