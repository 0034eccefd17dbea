"""VisualGen's worker entry function, upstream's module-level ``run_diffusion_worker``, run as
upstream runs it, under ``tllm-affinity run`` with nothing of the library imported: on the main
thread of its own process (``main``: a dedicated worker) or on a thread of a process that goes on
serving (``thread``: rank 0 in the client). Before the call the main thread first-touches 64 MiB
on node 0 (memory_buffer.py).

Lines: memory_buffer.py's, ``PAGES after`` once the worker said ready; ``DEVICE <n>`` (argv[2],
default 0).
"""
import sys
import threading

from memory_buffer import touched_on_node0
from tensorrt_llm._torch.visual_gen.executor import run_diffusion_worker
from tensorrt_llm.executor.ipc import ZeroMqQueue


def main():
    where = sys.argv[1]
    device = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    after = touched_on_node0(device)
    requests, responses = ZeroMqQueue(), ZeroMqQueue()

    def worker():
        run_diffusion_worker(rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                             request_queue_addr=requests.address,
                             response_queue_addr=responses.address, visual_gen_args={},
                             local_rank=device, in_client_process=where == "thread")

    def drive():
        assert responses.get() == "ready"
        after()
        requests.put(None)
        assert responses.get() is None

    if where == "main":
        driver = threading.Thread(target=drive, name="driver")
        driver.start()
        worker()
        driver.join()
    else:
        thread = threading.Thread(target=worker, name="visual_gen_worker")
        thread.start()
        drive()
        thread.join()


main()
