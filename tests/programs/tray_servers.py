"""Four servers on one tray: one process per GPU of a written GB200 tray, each
`host_view_target.py` under `tllm-affinity run --step-core auto`, then the host view of the four;
then every thread of each server pinned to its GPU's whole Grace node, as upstream's
`configure_cpu_affinity` pins every tid of the process, and the host view again.

Usage: tray_servers.py CLI PYTHON PROGRAMS_DIR TRAY_ROOT NVML_DIR
(TRAY_ROOT holds the tree under sys/ and NVML's answer in `nvml`; NVML_DIR the test double).
Prints one JSON line per phase:
  {"phase": "auto", "servers": [{"gpu": g, "pid": p, "rc": {...}, "masks": {thread: cpulist},
   "plan": <plan --gpu g --json with TLLM_AFFINITY_STEP_CORE=auto>}], "ps": <ps --json>}
  {"phase": "process-wide", "servers": [...], "ps": <ps --json>}
Each server's stderr is in "stderr". Exits 0 when every step ran, whatever it found.
"""

import json
import os
import subprocess
import sys
import tempfile

GPUS = 4


def parse_list(text):
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def main():
    cli, python, programs, tray, nvml_dir = sys.argv[1:6]
    locks = tempfile.mkdtemp()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TLLM_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
    }
    env.update(LD_LIBRARY_PATH=nvml_dir, TLLM_NVML_DOUBLE=os.path.join(tray, "nvml"))
    servers = []
    for gpu in range(GPUS):
        cmd = [cli, "run", "--step-core", "auto", "--policy", "numa", "--log", "info",
               "--sysfs-root", tray, "--lock-dir", locks, "--",
               python, os.path.join(programs, "host_view_target.py"),
               "--gpu", str(gpu), "--step", str(gpu), "--result", str(gpu)]
        err = tempfile.TemporaryFile()
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, text=True)
        info = json.loads(p.stdout.readline())
        servers.append((gpu, p, info, err))

    def phase(name):
        rows = []
        for gpu, p, info, err in servers:
            masks = {}
            for thread in ("host", "worker", "step", "result"):
                tid = info.get(thread)
                with open(f"/proc/{p.pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("Cpus_allowed_list:"):
                            masks[thread] = line.split(":", 1)[1].strip()
            err.seek(0)
            plan = subprocess.run([cli, "plan", "--gpu", str(gpu), "--json", "--sysfs-root", tray],
                                  env=dict(env, TLLM_AFFINITY_STEP_CORE="auto"),
                                  capture_output=True, text=True, check=True)
            rows.append({"gpu": gpu, "pid": p.pid, "rc": info["rc"], "masks": masks,
                         "plan": json.loads(plan.stdout),
                         "stderr": err.read().decode(errors="replace")})
        ps = subprocess.run([cli, "ps", "--json", "--sysfs-root", tray], env=env,
                            capture_output=True, text=True, check=True)
        print(json.dumps({"phase": name, "servers": rows, "ps": json.loads(ps.stdout)}),
              flush=True)

    phase("auto")
    # Upstream's pin: every tid of one /proc/<pid>/task snapshot to the GPU's local CPUs, the
    # step and result threads included (done from here: the kernel's masks are the same).
    for gpu, p, info, err in servers:
        with open(os.path.join(tray, "sys/bus/pci/devices", ADDRESSES[gpu], "local_cpulist")) as f:
            local = parse_list(f.read())
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            os.sched_setaffinity(int(tid), local)
    phase("process-wide")
    for gpu, p, info, err in servers:
        p.stdin.close()
        p.wait(timeout=60)


ADDRESSES = ["0008:06:00.0", "0009:06:00.0", "0018:06:00.0", "0019:06:00.0"]

if __name__ == "__main__":
    main()
