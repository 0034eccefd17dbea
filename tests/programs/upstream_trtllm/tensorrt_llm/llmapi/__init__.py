from .llm import LLM, RequestOutput
from .mpi_session import MpiCommSession

__all__ = ["LLM", "MpiCommSession", "RequestOutput"]
