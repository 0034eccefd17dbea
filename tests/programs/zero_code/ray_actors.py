"""A Ray deployment as an unmodified app: the driver starts a local cluster
(``ray.init(num_cpus=2, num_gpus=2)``) and two ``RayWorkerWrapper`` actors of ``RT_NUM_GPUS``
GPUs each (default 1), builds each actor's ``RayGPUWorker`` (``setup_distributed_env_and_worker``),
sets its engine up (``setup_engine``: configure_cpu_affinity on the actor's main thread), asks
it once, shuts it down. No ``TLLM_AFFINITY_PROCESS_ROLE`` anywhere: the library and the start-up
hook reach the actors through the environment the driver passes on.

After setup_engine and after shutdown it prints ``ACTORS <json>``: per actor, its pid, Ray's GPU
ids, CUDA_VISIBLE_DEVICES, and every thread of its process (name, tid, kernel mask, role), read
inside the actor by ``__ray_call__``; then ``DRIVER <json>``. Usage: ray_actors.py <temp dir>.
``RT_RAY_LAYOUT=legacy`` takes upstream's older ``executor/ray_gpu_worker.py`` instead;
``RT_RAY_ADDRESS`` joins a cluster started beforehand with ``ray start``, passing the job's
runtime_env from ``RT_RAY_RUNTIME_ENV`` (JSON).
Imports only ray, tensorrt_llm and the test instrumentation."""
import json
import os
import sys

import ray

if os.environ.get("RT_RAY_LAYOUT") == "legacy":
    # Upstream's older layout: executor/ray_gpu_worker.py, the worker's own _configure_affinity.
    from tensorrt_llm.executor.ray_gpu_worker import RayWorkerWrapper
else:
    from tensorrt_llm.executor.ray.gpu_worker import RayWorkerWrapper


def threads_of_this_process():
    from phases import census, role

    seen = {}
    for name, tid in census().items():
        try:
            with open("/proc/self/task/%d/status" % tid) as f:
                mask = next(line.split(":", 1)[1].strip() for line in f
                            if line.startswith("Cpus_allowed_list:"))
        except (OSError, StopIteration):
            continue  # exited meanwhile
        seen[name] = {"tid": tid, "mask": mask, "role": role(tid)}
    return seen


def look(wrapper):
    return {
        "pid": os.getpid(),
        "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
        "device_id": wrapper.device_id,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": threads_of_this_process(),
    }


def main():
    gpus = float(os.environ.get("RT_NUM_GPUS", "1"))
    address = os.environ.get("RT_RAY_ADDRESS")
    if address:
        # A cluster started beforehand (`ray start`): what the job passes on is its runtime_env.
        ray.init(address=address, runtime_env=json.loads(os.environ.get("RT_RAY_RUNTIME_ENV", "null")))
    else:
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=sys.argv[1])
    actors = [RayWorkerWrapper.options(num_gpus=gpus).remote(rank=i, world_size=2)
              for i in range(2)]
    ray.get([a.setup_distributed_env_and_worker.remote("stand-in/ray") for a in actors])
    ray.get([a.setup_engine.remote() for a in actors])
    print("ANSWERS", json.dumps(ray.get([a.generate.remote("hi") for a in actors])), flush=True)
    print("SETUP", json.dumps(ray.get([a.__ray_call__.remote(look) for a in actors])),
          flush=True)
    ray.get([a.shutdown.remote() for a in actors])
    print("SHUTDOWN", json.dumps(ray.get([a.__ray_call__.remote(look) for a in actors])),
          flush=True)
    print("DRIVER", json.dumps({"pid": os.getpid(), "threads": threads_of_this_process()}),
          flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
