from ..llmapi.utils import configure_cpu_affinity


class BaseWorker:
    """The call site with another signature than the adapter knows (``(self, rank)``)."""

    def _get_comm_ranks_device_id(self, rank):
        configure_cpu_affinity(rank)
        return [rank], rank

    def shutdown(self):
        pass
