"""`scripts/bench --slices`: several engines side by side on one node, each for its own GPU,
with every worker on the whole node (TLLM_AFFINITY_SLICE off, as TensorRT-LLM places them)
against each GPU's workers on its own slice (TLLM_AFFINITY_SLICE=gpu). Imported by scripts/bench;
also run alone (`python3 scripts/bench_slices.py LIB ENGINE_SO [--quick] [--rounds N]`, which is
how scripts/device-check runs it on a GPU host, and tests/guests/guest.rs in the guest of eight
CPUs). See docs/benchmarks.md.

The host is written: one NUMA node over this machine's allowed CPUs, each CPU a core of its own,
and GPUS GPUs on it (half the CPU count, so that each slice has the two cores a slice needs; at
least two). Each engine is a process under the library: a worker thread configures its GPU and
starts WORKERS busy native threads (benches/programs/engine_step.c, one loaded copy per thread,
each stepping a fixed instruction count per step without pause), one more than its slice has
CPUs, as a rank's executor loop, communication and data threads outnumber its share. All engines
start at once, run for a fixed window and report each thread's steps, CPU and wall time and the
kernel's count of its migrations between CPUs. The two modes alternate over interleaved rounds.

Printed per mode, medians over the rounds (spread: min-max): the steps/s of all engines together,
the slowest engine's share of the mean (fairness between engines), the CPU time a step costs (a
cold cache or a shared one shows here), the time a step spends runnable but off its CPU, and the
migrations per thread per second.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The engine program: one process, one GPU. argv: ENGINE_SO COPIES SECONDS GPU.
ENGINE = r"""
import ctypes, json, os, shutil, sys, threading, time
so, copies, seconds, gpu = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
lib = ctypes.CDLL(None)
lib.tllm_affinity_configure.restype = ctypes.c_int64
engines = []
def migrations(tid):
    try:
        for line in open(f"/proc/self/task/{tid}/sched"):
            if line.startswith("se.nr_migrations"):
                return int(line.split(":")[1])
    except OSError:
        pass
    return -1
def stats(e):
    out = (ctypes.c_int64 * 8)()
    e.engine_stats(out)
    return list(out)
def worker():
    lease = lib.tllm_affinity_configure(gpu)
    work = os.environ["BENCH_WORK_DIR"]
    for i in range(copies):
        path = os.path.join(work, f"engine{gpu}_{i}.so")  # one copy, one step thread
        shutil.copy(so, path)
        e = ctypes.CDLL(path)
        e.engine_wait.restype = ctypes.c_long
        e.engine_wait()
        engines.append(e)
    ready.set()
    stop.wait()
    lib.tllm_affinity_release(ctypes.c_int64(lease))
ready, stop = threading.Event(), threading.Event()
t = threading.Thread(target=worker)
t.start()
ready.wait()
sys.stdout.write("READY\n"); sys.stdout.flush()
sys.stdin.readline()
before = [(stats(e), migrations(stats(e)[0])) for e in engines]
time.sleep(seconds)
after = [(stats(e), migrations(stats(e)[0])) for e in engines]
mask = open(f"/proc/self/task/{stats(engines[0])[0]}/status").read()
mask = [l.split(":")[1].strip() for l in mask.splitlines() if l.startswith("Cpus_allowed_list")][0]
print(json.dumps({"gpu": gpu, "mask": mask, "threads": [
    {"steps": a[1] - b[1], "cpu_ns": a[2] - b[2], "wall_ns": a[3] - b[3],
     "elapsed_ns": a[4] - b[4], "migrations": (ma - mb) if mb >= 0 and ma >= 0 else None}
    for (b, mb), (a, ma) in zip(before, after)]}))
stop.set(); t.join()
"""


def write_host(root, cpus, gpus):
    """One node over `cpus`, each CPU a core, `gpus` NVIDIA GPUs on it."""
    listed = ",".join(map(str, cpus))
    node = f"{root}/sys/devices/system/node/node0"
    os.makedirs(node)
    open(f"{node}/cpulist", "w").write(listed + "\n")
    os.makedirs(f"{root}/sys/devices/system/cpu")
    open(f"{root}/sys/devices/system/cpu/online", "w").write(listed + "\n")
    for i in range(gpus):
        gpu = f"{root}/sys/bus/pci/devices/0000:{0x1a + 0x10 * i:02x}:00.0"
        os.makedirs(gpu)
        for name, value in [("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200"),
                            ("numa_node", "0"), ("local_cpulist", listed)]:
            open(f"{gpu}/{name}", "w").write(value + "\n")


def one_round(lib, engine_so, root, gpus, copies, seconds, sliced, work):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_")}
    env.update(LD_PRELOAD=lib, TLLM_AFFINITY_SYSFS_ROOT=root, TLLM_AFFINITY_NVML="0",
               TLLM_AFFINITY_LOG="error", BENCH_WORK_DIR=work)
    if sliced:
        env["TLLM_AFFINITY_SLICE"] = "gpu"
    procs = [subprocess.Popen([sys.executable, "-c", ENGINE, engine_so, str(copies),
                               str(seconds), str(g)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for g in range(gpus)]
    for p in procs:
        if p.stdout.readline().strip() != "READY":
            raise RuntimeError("an engine did not start")
    for p in procs:  # all windows open together
        p.stdin.write("go\n")
        p.stdin.flush()
    engines = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.stdin.close()
        p.wait(60)
    threads = [t for e in engines for t in e["threads"]]
    per_engine = [sum(t["steps"] for t in e["threads"]) / (e["threads"][0]["elapsed_ns"] / 1e9)
                  for e in engines]
    steps = sum(t["steps"] for t in threads)
    migrations = [t["migrations"] for t in threads if t["migrations"] is not None]
    return {
        "masks": " ".join(f"{e['gpu']}:[{e['mask']}]" for e in engines),
        "steps_s": sum(per_engine),
        "slowest": min(per_engine) / statistics.mean(per_engine),
        "cpu_step": sum(t["cpu_ns"] for t in threads) / steps / 1e3,
        "off_step": max(0, sum(t["wall_ns"] - t["cpu_ns"] for t in threads)) / steps / 1e3,
        "migrations": (sum(migrations) / len(migrations) / seconds) if migrations else None,
    }


def cell(values, fmt):
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return (f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–"
            f"{fmt.format(max(values))})")


COLUMNS = [("steps_s", "steps/s, all engines", "{:.0f}"),
           ("slowest", "slowest engine / mean", "{:.2f}"),
           ("cpu_step", "CPU µs/step", "{:.0f}"),
           ("off_step", "off-CPU µs/step (runnable, waiting)", "{:.0f}"),
           ("migrations", "migrations/thread/s", "{:.1f}")]


def run(lib, engine_so, quick, rounds=None):
    """The --slices section: prints its table and what the two modes' ratios are. `rounds`
    overrides the rounds `quick` chooses."""
    cpus = sorted(os.sched_getaffinity(0))
    gpus = max(2, len(cpus) // 2)
    tmp = tempfile.mkdtemp(prefix="tllm-bench-slices-")
    try:
        root = os.path.join(tmp, "host")
        write_host(root, cpus, gpus)
        share = max(1, len(cpus) // gpus)
        copies = share + 1
        rounds = rounds or (3 if quick else 7)
        seconds = 1.0 if quick else 2.0
        modes = {"node masks (TLLM_AFFINITY_SLICE off)": False,
                 "slices (TLLM_AFFINITY_SLICE=gpu)": True}
        samples = {name: [] for name in modes}
        for r in range(rounds):
            order = list(modes.items())
            for name, sliced in order[r % 2:] + order[:r % 2]:
                samples[name].append(one_round(lib, engine_so, root, gpus, copies, seconds,
                                               sliced, tmp))
        print(f"\nSlices: {gpus} engines side by side on one node over CPUs "
              f"{','.join(map(str, cpus))} (each CPU a core of its own), {copies} busy worker "
              f"threads each (benches/programs/engine_step.c), a {seconds:.0f} s window, "
              f"{rounds} interleaved rounds. Cells: median (spread: min–max over the rounds).")
        if share < 2:
            print(f"\nCaveat: {len(cpus)} CPU(s) give {gpus} GPUs fewer than two cores each, so "
                  f"the library keeps every GPU on the whole node (and says so): both modes are "
                  f"the same placement here, and the figures show only the noise between runs.")
        print("\n| mode | worker masks (GPU:[CPUs]) | "
              + " | ".join(h for _, h, _ in COLUMNS) + " |")
        print("|---|---|" + "---:|" * len(COLUMNS))
        for name, got in samples.items():
            masks = "; ".join(sorted({s["masks"] for s in got}))
            print(f"| {name} | {masks} | "
                  + " | ".join(cell([s[k] for s in got], f) for k, _, f in COLUMNS) + " |")
        off, on = (samples[name] for name in modes)
        print("\n| figure | slices / node masks, per round |")
        print("|---|---:|")
        for key, label, _ in COLUMNS:
            ratios = [a[key] / b[key] for a, b in zip(on, off)
                      if a[key] is not None and b[key]]
            print(f"| {label} | {cell(ratios, '{:.2f}')} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asked = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else None
    run(os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), "--quick" in sys.argv, asked)
