"""A stand-in for TensorRT-LLM with upstream's module layout and import style, and no inference.

Written from the description in seeds/shared-process-affinity-never-restored.txt and
seeds/configure-not-idempotent.txt, for tests/zero_code.rs: the apps of tests/programs/zero_code
use it exactly as a user uses TensorRT-LLM (they never import ``tllm_affinity``), so the library's
Python start-up hook meets the same names, call sites and threads it meets in a real server:

* ``tensorrt_llm.llmapi.utils.configure_cpu_affinity(device_id)`` behaves as upstream's: it judges
  "constrained" on the current mask (the self-inflicted bug included), follows the
  ``TLLM_NUMA_AWARE_WORKER_AFFINITY`` table, sweeps every thread of the process through
  ``_set_affinity_all_threads`` and never restores anything;
* its three callers: ``BaseWorker._get_comm_ranks_device_id`` (executor/base_worker.py, reached
  from ``LLM.__init__`` in a single-process TP1 worker and from ``worker_main`` on an
  ``MpiCommSession`` pool thread) and the VisualGen worker thread (_torch/visual_gen/executor.py);
* the threads around them are real ``threading.Thread``s, the engine's intra-op pool a real
  OpenMP (libgomp) pool (``RT_OMP``), MPI/NCCL progress threads real native threads started in a
  ``TLLM_AFFINITY_WORKER_LIBS`` object (``RT_NCCL``, ``RT_SPAWN``); see ``_native``.

The GPU-local CPUs come from the sysfs tree under ``TLLM_AFFINITY_SYSFS_ROOT`` (default ``/``),
where upstream asks NVML; "all CPUs" is that tree's online list, where upstream asks psutil.
"""
from . import _utils  # noqa: F401  (upstream: imports mpi4py, which initialises MPI)
from .llmapi import LLM, MpiCommSession

__all__ = ["LLM", "MpiCommSession"]
