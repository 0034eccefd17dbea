"""Ray actors under the library (tests/launchers/ray.rs).
Usage: ray_actors.py <library> <sysfs root> <Ray temp dir>

The driver (this process, preloaded by the test as a host process) starts a local cluster with
two GPUs and two actors of one GPU each, whose runtime_env preloads the library into the actor
as a dedicated worker process. Ray assigns CUDA_VISIBLE_DEVICES inside each actor, from Python,
after the library loaded. Each actor reports every thread it has (tid, kernel mask, role) after
starting one more thread of its own; the driver reports its own threads the same way. Prints
`ACTOR <json>` per actor and `DRIVER <json>`."""
import json
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "..", "python")
sys.path.insert(0, PACKAGE)

import ray  # noqa: E402


def threads_seen():
    """Every thread of this process: tid -> [kernel mask list, role]."""
    import tllm_affinity

    seen = {}
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            with open("/proc/self/task/%d/status" % tid) as f:
                mask = next(
                    line.split(":", 1)[1].strip()
                    for line in f
                    if line.startswith("Cpus_allowed_list:")
                )
            with open("/proc/self/task/%d/comm" % tid) as f:
                name = f.read().strip()
        except (OSError, StopIteration):
            continue  # the thread has exited
        seen[tid] = {"mask": mask, "role": tllm_affinity.role(tid), "name": name}
    return seen


@ray.remote(num_gpus=1)
class Probe:
    def look(self, package):
        sys.path.insert(0, package)
        import tllm_affinity

        started = threading.Event()
        stop = threading.Event()

        def own():
            started.set()
            stop.wait()

        t = threading.Thread(target=own, name="actor-own")
        t.start()
        started.wait()
        answer = {
            "pid": os.getpid(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "own_thread": t.native_id,
            "threads": threads_seen(),
            "report": tllm_affinity.report(),
        }
        stop.set()
        t.join()
        return answer


def main():
    library, sysfs, temp_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    ray.init(
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=True,
        _temp_dir=temp_dir,
    )
    env = {
        "LD_PRELOAD": library,
        "TLLM_AFFINITY_PROCESS_ROLE": "worker",
        "TLLM_AFFINITY_SYSFS_ROOT": sysfs,
        "TLLM_AFFINITY_LOG": "info",
    }
    actors = [Probe.options(runtime_env={"env_vars": env}).remote() for _ in range(2)]
    for answer in ray.get([a.look.remote(os.path.abspath(PACKAGE)) for a in actors]):
        print("ACTOR", json.dumps(answer), flush=True)
    print("DRIVER", json.dumps({"pid": os.getpid(), "threads": threads_seen()}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
