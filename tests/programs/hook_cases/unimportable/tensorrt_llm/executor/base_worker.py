# Binds the name at import, as upstream's executor/base_worker.py does.
from ..llmapi.utils import configure_cpu_affinity  # noqa: F401
