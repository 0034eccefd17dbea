"""Put on PYTHONPATH by ``tllm-affinity run``, so that every Python interpreter the command starts
(directly, through mpirun, srun, shell wrappers or multiprocessing) runs the tllm-affinity
start-up hook (``_tllm_affinity_hook``), then the ``sitecustomize`` this one shadows (Debian's,
a site's own), exactly as Python would have run it.
"""

import os
import sys


def _run_tllm_affinity_hook(here):
    # The directory holding the tllm_affinity package and the hook module, appended (never
    # prepended) so that nothing of the program's own path is shadowed.
    home = os.path.dirname(os.path.dirname(here))
    if home not in sys.path and os.path.exists(os.path.join(home, "_tllm_affinity_hook.py")):
        sys.path.append(home)
    try:
        import _tllm_affinity_hook
    except ImportError:
        return
    _tllm_affinity_hook.install()


def _is_here(entry, here):
    if os.path.basename(entry.rstrip("/")) != os.path.basename(here):
        return False
    return os.path.realpath(entry) == here


def _chain(here):
    """Runs the next ``sitecustomize`` on sys.path, as site.py would have."""
    try:
        # importlib's own bootstrap modules, always loaded: importlib.util would cost an import.
        from importlib._bootstrap import module_from_spec
        from importlib._bootstrap_external import PathFinder
    except ImportError:
        return
    me = sys.modules.get(__name__)
    rest = [p for p in sys.path if not _is_here(p, here)]
    try:
        spec = PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        module = module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as err:
        # site.py's own words for a failing sitecustomize: one line, and start-up goes on.
        if me is not None:
            sys.modules["sitecustomize"] = me
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                             "%s: %s\n" % (err.__class__.__name__, err))


def _main():
    here = os.path.dirname(os.path.realpath(__file__))
    try:
        _run_tllm_affinity_hook(here)
    except Exception as err:
        sys.stderr.write("[tllm-affinity] the Python start-up hook failed: %s: %s\n"
                         % (err.__class__.__name__, err))
    _chain(here)


_main()
