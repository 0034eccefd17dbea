from tensorrt_llm.llmapi.utils import configure_cpu_affinity


def run_diffusion_worker(rank, world_size, master_addr, master_port, request_queue_addr,
                         response_queue_addr, visual_gen_args, **kwargs):
    """A generator where upstream has a plain function."""
    configure_cpu_affinity(rank)
    yield "served"
