"""An MPI worker rank's entry function, upstream's ``worker_main`` (executor/worker.py), run as a
pool rank runs it: on the main thread of its own process, under ``tllm-affinity run`` with nothing
of the library imported and no ``TLLM_AFFINITY_PROCESS_ROLE``. Rank 0 of one visible GPU, so
``_get_comm_ranks_device_id`` configures CUDA device 0: the GPU the launcher's
``CUDA_VISIBLE_DEVICES`` names. Before the call the main thread first-touches 64 MiB on node 0
(memory_buffer.py); a thread of its own plays the proxy: it reads ``PAGES after`` once the rank
said ready, then shuts it down.

Lines: memory_buffer.py's; ``DEVICE <CUDA_VISIBLE_DEVICES>``.
"""
import os
import threading

from memory_buffer import touched_on_node0
from tensorrt_llm.executor.ipc import ZeroMqQueue
from tensorrt_llm.executor.worker import worker_main

after = touched_on_node0(int(os.environ["CUDA_VISIBLE_DEVICES"]))
# The proxy's server ends, as GenerationExecutorProxy makes them.
requests, results, status = ZeroMqQueue(), ZeroMqQueue(), ZeroMqQueue()


def proxy():
    assert status.get() == "ready"
    after()
    requests.put(None)
    assert results.get() is None


driver = threading.Thread(target=proxy, name="proxy")
driver.start()
worker_main("stand-in/tp1", {"request": requests.address, "result": results.address,
                             "init_status": status.address})
driver.join()
