"""Several engines on one node, each for its own GPU: one process per GPU of a written tree,
each ``loop_pin_server.py`` under ``tllm-affinity run`` with upstream's
``TLLM_EXECUTOR_LOOP_PIN=1`` (offset 0, one CPU: GPU g of a node asks for the node's CPU g), all
started at once (nothing coordinates them). Phase ``sliced`` runs them with ``--slice gpu``,
phase ``whole`` without.

Usage: slice_servers.py CLI PYTHON PROGRAMS_DIR TREE_ROOT GPUS
Prints one JSON line per phase:
  {"phase": "sliced", "servers": [{"gpu": g, "pid": p, "loop_cpus": [...],
   "masks": {"host": cpulist, "worker": cpulist, "loop": cpulist},
   "plan": <plan --gpu g --json>, "stderr": "..."}], "ps": <ps --json>, "metrics": "..."}
Exits 0 when every step ran, whatever it found.
"""

import json
import os
import subprocess
import sys
import tempfile


def kernel_mask(pid, tid):
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return None


def main():
    cli, python, programs, tree, gpus = sys.argv[1:6]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TLLM_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
    }
    env.update(
        TLLM_AFFINITY_NVML="0",
        TLLM_EXECUTOR_LOOP_PIN="1",
        TLLM_EXECUTOR_LOOP_PIN_OFFSET="0",
        TLLM_EXECUTOR_LOOP_PIN_NCORES="1",
        PYTHONPATH=os.pathsep.join([os.path.join(programs, "upstream_trtllm"), programs]),
    )
    for phase, slice_args, plan_env in (("sliced", ["--slice", "gpu"], {"TLLM_AFFINITY_SLICE": "gpu"}),
                                        ("whole", [], {})):
        started = []
        for gpu in range(int(gpus)):
            cmd = [cli, "run", *slice_args, "--log", "info", "--sysfs-root", tree, "--",
                   python, os.path.join(programs, "loop_pin_server.py"), str(gpu)]
            err = tempfile.TemporaryFile()
            p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=err, text=True)
            started.append((gpu, p, err))
        rows = []
        for gpu, p, err in started:
            line = p.stdout.readline()
            info = json.loads(line) if line.strip() else {}
            masks = {t: kernel_mask(p.pid, info[t]) for t in ("host", "worker", "loop")
                     if info.get(t)}
            plan = subprocess.run([cli, "plan", "--gpu", str(gpu), "--json", "--sysfs-root", tree],
                                  env=dict(env, **plan_env), capture_output=True, text=True)
            rows.append({"gpu": gpu, "pid": p.pid, "loop_cpus": info.get("loop_cpus"),
                         "masks": masks, "plan": json.loads(plan.stdout or "null")})
        ps = subprocess.run([cli, "ps", "--json", "--sysfs-root", tree], env=env,
                            capture_output=True, text=True)
        metrics = subprocess.run([cli, "metrics", "--sysfs-root", tree], env=env,
                                 capture_output=True, text=True)
        for (gpu, p, err), row in zip(started, rows):
            p.stdin.close()
            p.wait(timeout=120)
            err.seek(0)
            row["stderr"] = err.read().decode(errors="replace")
        print(json.dumps({"phase": phase, "servers": rows, "ps": json.loads(ps.stdout or "null"),
                          "metrics": metrics.stdout + metrics.stderr}), flush=True)


if __name__ == "__main__":
    main()
