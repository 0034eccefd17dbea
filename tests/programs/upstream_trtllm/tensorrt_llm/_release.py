"""Which upstream release the stand-in is shaped like (``RT_UPSTREAM_SHAPE``), for the tests of
an upstream the adapter only half-knows (tests/zero_code.rs). Unset: the current layout.

* ``entry-fewer``: ``run_diffusion_worker`` of an earlier release, without the distributed
  address, the HMAC keys and ``parent_pid``;
* ``entry-more``: one with more parameters, some of them before the ones the adapter knew;
* ``entry-renamed``: one whose parameters were renamed (``global_rank``, ``req_queue_addr``, ...);
* ``configure-keyword``: ``configure_cpu_affinity(*, gpu_index)``, keyword-only under another name,
  and every caller passing ``gpu_index=``;
* ``no-shutdown``: the worker object that configures has no ``shutdown()``; it stops with
  ``close()``.
"""
import os

SHAPE = os.environ.get("RT_UPSTREAM_SHAPE", "")
CONFIGURE_KEYWORD = SHAPE == "configure-keyword"
NO_SHUTDOWN = SHAPE == "no-shutdown"


def stop(executor):
    """Stops a worker object however this release names it."""
    shutdown = getattr(executor, "shutdown", None)
    (shutdown if shutdown is not None else executor.close)()
