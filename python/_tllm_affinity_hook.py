"""The Python start-up hook of tllm-affinity: fixes an unmodified TensorRT-LLM server.

Python runs ``install()`` at start-up, from ``tllm_affinity.pth`` (installed with the package) or
from the ``sitecustomize`` that ``tllm-affinity run`` puts on ``PYTHONPATH``. It costs one
environment lookup: it imports nothing and only adds an import hook, which waits for
``tensorrt_llm.llmapi.utils`` (and each call site's module) to finish executing and then hands
the module to ``tllm_affinity.adapters.trtllm.patch_upstream`` (docs/runtimes.md says what that wraps).

It does nothing when ``TLLM_AFFINITY_PYTHON_HOOKS=0``, or when libtllm_affinity.so is not
preloaded into this process (the adapter checks for the library itself before it changes
anything). It never raises: a failure is one line on stderr and the program runs on as without it.

This module is top-level, not part of the ``tllm_affinity`` package, so that start-up never pays
for importing the package (ctypes, json) in programs that never import TensorRT-LLM.
"""

import os
import sys

# The adapter's WATCHED_MODULES (kept here so that start-up imports nothing; tests/python_hook.rs
# checks that the two agree): upstream's utils, then the module of each call site it covers.
UPSTREAM_MODULES = (
    "tensorrt_llm.llmapi.utils",
    "tensorrt_llm.executor.base_worker",
    "tensorrt_llm.executor.ray.gpu_worker",
    "tensorrt_llm.executor.ray_gpu_worker",
    "tensorrt_llm._torch.visual_gen.executor",
)
SWITCH = "TLLM_AFFINITY_PYTHON_HOOKS"
PREFIX = "[tllm-affinity] "

_installed = False


def _say(line):
    try:
        sys.stderr.write(PREFIX + line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def enabled():
    """False when TLLM_AFFINITY_PYTHON_HOOKS=0; a malformed value keeps the hook on, with a line."""
    value = os.environ.get(SWITCH)
    if value is None or value.strip() in ("", "1"):
        return True
    if value.strip() == "0":
        return False
    _say("%s='%s' is not valid: expected 0 or 1; the Python hook stays on" % (SWITCH, value))
    return True


def _library_may_be_loaded():
    """A cheap hint that libtllm_affinity.so is preloaded; the adapter checks for real later."""
    if "libtllm_affinity" in os.environ.get("LD_PRELOAD", ""):
        return True
    # A container where the library comes through /etc/ld.so.preload (tllm-affinity cdi).
    return os.path.exists("/etc/ld.so.preload")


def _patch(module):
    try:
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
        if _installed or not enabled() or not _library_may_be_loaded():
            return
        _installed = True
        for name in UPSTREAM_MODULES:
            already = sys.modules.get(name)
            if already is not None:
                _patch(already)
        sys.meta_path.insert(0, _UpstreamFinder())
    except Exception as error:
        _say("the Python start-up hook failed: %s: %s" % (type(error).__name__, error))
