"""Runs an app of tests/programs/zero_code in an interpreter started with ``-E`` or ``-I``, which
ignore ``PYTHONPATH`` (so ``tllm-affinity run``'s ``sitecustomize`` is never found, and neither are
the test's stand-ins): puts the directories of ``RT_APP_PATH`` (the upstream stand-in, the test
instrumentation) on ``sys.path`` and runs the app as ``__main__``. It runs after start-up: whatever
start-up hook ran, the interpreter found it on its own (an installed package's ``.pth``).

Usage: python -E|-I launch_isolated.py APP.py
"""
import os
import runpy
import sys

sys.path[:0] = [p for p in os.environ.get("RT_APP_PATH", "").split(os.pathsep) if p]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
