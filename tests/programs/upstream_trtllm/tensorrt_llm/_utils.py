"""MPI helpers. Upstream imports mpi4py here, and ``MPI_Init`` starts the MPI library's progress
thread from the importing thread (the main thread): with ``RT_NCCL`` set, so does this stand-in.
There is one rank in this process: rank 0 (the other ranks of a launch live elsewhere)."""
from . import _native

_native.progress_thread("mpi_progress")


def mpi_rank() -> int:
    return 0


def global_mpi_rank() -> int:
    return 0
