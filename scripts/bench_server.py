"""`scripts/bench --server` (issues 17, 29): what placement does to a server's requests and its
engine, side by side in one run. Imported by scripts/bench; see docs/server-benchmark.md.

1. One server process (benches/programs/server_app.py: uvicorn + FastAPI handlers doing host-side
   CPU work, over the stand-in TensorRT-LLM of tests/programs/upstream_trtllm built as the
   single-process TP1 deployment builds it) under load from `wrk` (a separate process; an asyncio
   client of this file when wrk is missing): a fixed request count at a fixed concurrency. The
   engine is benches/programs/engine_step.c: a native thread born from the engine's loop thread,
   doing fixed CPU work per step, stepping continuously whatever the load, without the GIL; its
   steps/s, CPU time per step (busy) and wall - CPU per step (runnable, off the CPU) are read
   over the load and over an idle window before it. Three modes, interleaved rounds, one command
   line: no pinning, upstream's process-wide pinning, the same command under `tllm-affinity run`.
2. The same server under `taskset -c <GPU-local CPU>` (a constrained launch), with
   TLLM_NUMA_AWARE_WORKER_AFFINITY unset vs =0.
3. benches/programs/step_loop.c, with and without TLLM_AFFINITY_STEP_CORE=auto.
Every ratio is a median over rounds of per-round ratios, printed with its spread (min–max).
"""
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGS = os.path.join(ROOT, "benches", "programs")
CONCURRENCY = 16
PROMPT = " ".join(["Summarise the following passage about NUMA placement, tokenisers and the "
                   "threads of an inference server; answer in three sentences."] * 12)
BODY = json.dumps({"prompt": PROMPT, "max_tokens": 16})


def fmt_mask(cpus):
    if not cpus:
        return "?"
    runs, start = [], cpus[0]
    for a, b in zip(cpus, cpus[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(runs)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port, path, timeout=2.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


def post(port):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=BODY.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


async def _client(port, requests, concurrency):
    """The fallback load generator: `concurrency` keep-alive HTTP/1.1 connections sending until
    `requests` responses have come back; latencies in µs."""
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY.encode()
    left = [requests]
    lat = []
    errors = [0]

    async def conn():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            t = time.perf_counter()
            writer.write(head)
            status = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            lat.append((time.perf_counter() - t) * 1e6)
            if b" 200 " not in status:
                errors[0] += 1
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(concurrency)))
    return lat, errors[0], (time.perf_counter() - start) * 1e6


def load(port, requests):
    """(requests/s, p50 µs, p99 µs, errors)."""
    if shutil.which("wrk"):
        env = dict(os.environ, WRK_BODY=BODY, WRK_REQUESTS=str(requests))
        out = subprocess.run(["wrk", "-t1", f"-c{CONCURRENCY}", "-d120s", "--timeout", "20s",
                              "-s", os.path.join(PROGS, "fixed_count.lua"),
                              f"http://127.0.0.1:{port}/generate"],
                             env=env, check=True, capture_output=True, text=True).stdout
        r = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", out.split("WRK", 1)[1])}
        return (r["requests"] / (r["duration_us"] / 1e6), r["p50_us"], r["p99_us"],
                r["errors"])
    lat, errors, duration = asyncio.run(_client(port, requests, CONCURRENCY))
    lat.sort()
    return (len(lat) / (duration / 1e6), lat[len(lat) // 2], lat[int((len(lat) - 1) * 0.99)],
            errors)


def engine_window(before, after):
    """The step thread's figures between two /stats answers."""
    steps = after["steps"] - before["steps"]
    cpu = after["cpu_ns"] - before["cpu_ns"]
    wall = after["wall_ns"] - before["wall_ns"]
    elapsed = after["clock_ns"] - before["clock_ns"]
    if steps <= 0:
        return {"steps_s": 0.0, "cpu_step": float("nan"), "off_step": float("nan")}
    return {"steps_s": steps / (elapsed / 1e9), "cpu_step": cpu / steps / 1e3,
            "off_step": max(0, wall - cpu) / steps / 1e3}


def serve_once(ctx, argv_prefix, env_extra, requests):
    """Starts the server under `argv_prefix`, warms it, reads the engine idle, loads it, stops
    it; one sample."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TLLM_") and k not in ("LD_PRELOAD", "PYTHONPATH")}
    env.update(ctx["server_env"])
    env.update(env_extra)
    log = open(os.path.join(ctx["tmp"], "server.log"), "w")
    proc = subprocess.Popen([*argv_prefix, sys.executable,
                             os.path.join(PROGS, "server_app.py"), str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                get_json(port, "/stats", 0.5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise RuntimeError("server did not start: "
                                       + open(log.name).read()[-2000:])
                time.sleep(0.05)
        for _ in range(20):
            post(port)
        quiet = get_json(port, "/stats")
        time.sleep(ctx["idle_s"])
        before = get_json(port, "/stats")
        rps, p50, p99, errors = load(port, requests)
        after = get_json(port, "/stats")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    idle = engine_window(quiet, before)
    busy = engine_window(before, after)
    place = (f"main {fmt_mask(after['main'])}, loop {fmt_mask(after['loop'])}, "
             f"step {fmt_mask(after['step'])}, pool {fmt_mask(after['pool'])}")
    return {"rps": rps, "p50": p50 / 1e3, "p99": p99 / 1e3, "errors": errors, "place": place,
            "steps_load": busy["steps_s"], "cpu_step": busy["cpu_step"],
            "off_step": busy["off_step"], "steps_idle": idle["steps_s"]}


# Per-mode columns: (key, heading, format).
COLUMNS = [("rps", "host req/s", "{:.0f}"), ("p50", "p50 ms", "{:.1f}"),
           ("p99", "p99 ms", "{:.1f}"), ("steps_load", "engine steps/s, loaded", "{:.0f}"),
           ("cpu_step", "engine CPU µs/step (busy)", "{:.0f}"),
           ("off_step", "engine off-CPU µs/step (runnable, waiting)", "{:.0f}"),
           ("steps_idle", "engine steps/s, idle server", "{:.0f}")]


def cell(values, fmt):
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–" \
           f"{fmt.format(max(values))})"


def server_table(title, variants, samples):
    print(f"\n{title}\n")
    print("| mode | command | placement (main = event loop, loop = engine loop, step = engine "
          "step thread, pool = a FastAPI pool thread) | "
          + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|---|---|---|" + "---:|" * len(COLUMNS))
    for name, (_, _, shown) in variants.items():
        got = samples[name]
        places = sorted({s["place"] for s in got})
        print(f"| {name} | `{shown}` | {'; '.join(places)} | "
              + " | ".join(cell([s[k] for s in got], f) for k, _, f in COLUMNS) + " |")
    errors = sum(s["errors"] for got in samples.values() for s in got)
    if errors:
        print(f"\n{errors} request(s) failed (non-2xx or socket errors)")


def step_loop(ctx, rounds):
    exe = ctx["step_loop"]
    iters = 1500 if ctx["quick"] else 4000
    base = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_")}
    base.update(LD_PRELOAD=ctx["lib"], TLLM_AFFINITY_SYSFS_ROOT=ctx["one_node"],
                TLLM_AFFINITY_LOCK_DIR=ctx["locks"], TLLM_AFFINITY_LOG="error")
    variants = {"step core off (TLLM_AFFINITY_STEP_CORE unset)": base,
                "TLLM_AFFINITY_STEP_CORE=auto": dict(base, TLLM_AFFINITY_STEP_CORE="auto")}
    hosts = max(1, len(os.sched_getaffinity(0)))
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, env in variants.items():
            out = subprocess.run([exe, str(iters), str(hosts)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            samples[name].append({k: int(v) for k, v in re.findall(r"(\w+) (-?\d+)", out)})
    print(f"\nStep loop (benches/programs/step_loop.c): {iters} iterations of ~50 µs, each handed "
          f"to the result thread (futex), with {hosts} host threads loading the CPUs; median of "
          f"{rounds} interleaved rounds (spread: min–max of the rounds' medians)\n")
    print("| step core | step / result CPU | hand-off p50 µs | hand-off p99 µs | iteration "
          "p50 µs | iteration p99 µs |")
    print("|---|---|---:|---:|---:|---:|")
    for name, got in samples.items():
        cells = [cell([s[key] / 1e3 for s in got], "{:.1f}")
                 for key in ("handoff_p50_ns", "handoff_p99_ns", "iter_p50_ns", "iter_p99_ns")]
        pinned = got[-1]["step_rc"] > 0
        where = (f"{got[-1]['step_cpu']} / {got[-1]['result_cpu']} (pinned)" if pinned
                 else "floating (scheduler's choice)")
        print(f"| {name} | {where} | " + " | ".join(cells) + " |")
    off, on = list(variants)
    return {key: [a[key] / b[key] for a, b in zip(samples[on], samples[off])]
            for key in ("handoff_p50_ns", "handoff_p99_ns", "iter_p50_ns", "iter_p99_ns")}


def probe_figures(ctx):
    out = subprocess.run([ctx["cli"], "probe"], capture_output=True, text=True).stdout
    same = re.search(r"same CPU\s+\S+\s+([\d.]+) µs", out)
    cross = re.search(r"two cores, one node\s+\S+\s+([\d.]+) µs", out)
    states = re.findall(r"^\s+(\S.*?)\s+(\d+) µs$", out, re.M)
    rec = re.search(r"recommendation: (\S+)", out)
    return (same.group(1) if same else "?", cross.group(1) if cross else "?",
            ", ".join(f"{n.strip()} {v} µs" for n, v in states) or "none listed",
            rec.group(1) if rec else "?")


def check_stack():
    missing = subprocess.run([sys.executable, "-c", "import uvicorn, fastapi"],
                             capture_output=True, text=True)
    if missing.returncode != 0:
        sys.stderr.write("scripts/bench --server: uvicorn and fastapi cannot be imported by "
                         f"{sys.executable} ({missing.stderr.strip().splitlines()[-1]}); run "
                         "scripts/setup (pip install uvicorn fastapi)\n")
        sys.exit(1)


# Summary rows: (what the row measures, key in a sample).
SUMMARY_ROWS = [
    ("engine steps/s under load (fixed native work per step, stepping continuously, no GIL; "
     "higher is better)", "steps_load"),
    ("engine steps/s with the server idle (the same engine before the load; higher is better)",
     "steps_idle"),
    ("engine CPU time per step under load (busy time of the fixed work; ~1.00 = the same work)",
     "cpu_step"),
    (f"host requests/s at concurrency {CONCURRENCY} (wrk, fixed request count; higher is better)",
     "rps"),
    ("request latency p50 (lower is better)", "p50"),
    ("request latency p99 (lower is better)", "p99"),
]
# Summary columns: (heading, mode, the mode it is divided by).
COMPARISONS = [
    ("process-wide (upstream) / no pinning", "process-wide (upstream)", "no pinning"),
    ("tllm-affinity run / no pinning", "tllm-affinity run", "no pinning"),
    ("tllm-affinity run / process-wide (upstream)", "tllm-affinity run",
     "process-wide (upstream)"),
    ("constrained: upstream clears (unset) / kept (=0)", "constrained, unset (upstream clears)",
     "constrained, policy =0 (kept)"),
    ("constrained: tllm-affinity run (unset) / kept (=0)",
     "constrained, unset, tllm-affinity run", "constrained, policy =0 (kept)"),
]


def run(tmp, lib, simulated_sysfs, quick):
    """The whole --server section; prints its tables and the summary."""
    check_stack()
    start = time.monotonic()
    tmp = os.path.join(tmp, "server")  # the full scripts/bench has written its own tree already
    os.makedirs(tmp)
    load_before = open("/proc/loadavg").read().split()[:3]
    subprocess.run(["cargo", "build", "--release", "-q"], cwd=ROOT, check=True)
    cli = os.path.join(ROOT, "target", "release", "tllm-affinity")
    engine = os.path.join(tmp, "libengine_step.so")
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", "-pthread", "-o", engine,
                    os.path.join(PROGS, "engine_step.c")], check=True)
    step_exe = os.path.join(tmp, "step_loop")
    subprocess.run(["cc", "-O2", "-pthread", "-o", step_exe,
                    os.path.join(PROGS, "step_loop.c"), "-ldl"], check=True)
    sysfs = simulated_sysfs(tmp)
    one_node = os.path.join(tmp, "one-node")
    write_one_node(one_node)
    locks = os.path.join(tmp, "locks")
    os.makedirs(locks, exist_ok=True)
    gpu_cpus = open(os.path.join(sysfs, "sys/bus/pci/devices/0000:3b:00.0/local_cpulist")
                    ).read().strip()
    ctx = {"tmp": tmp, "lib": lib, "cli": cli, "quick": quick, "one_node": one_node,
           "locks": locks, "step_loop": step_exe, "idle_s": 0.5 if quick else 1.0,
           "server_env": {"PYTHONPATH": os.path.join(ROOT, "tests", "programs", "upstream_trtllm"),
                          "TLLM_WORKER_USE_SINGLE_PROCESS": "1", "RT_ENGINE_LOOP": "1",
                          "RT_ENGINE_STEP": engine, "TLLM_AFFINITY_SYSFS_ROOT": sysfs}}
    rounds = 3 if quick else 7
    requests = 300 if quick else 600
    run_lib = [cli, "run", "--sysfs-root", sysfs, "--lock-dir", locks, "--log", "error", "--"]
    taskset = ["taskset", "-c", gpu_cpus]
    py = "python server_app.py"
    # name: (argv prefix, environment, the command as shown)
    part1 = {
        "no pinning": ([], {"TLLM_NUMA_AWARE_WORKER_AFFINITY": "0"},
                       f"TLLM_NUMA_AWARE_WORKER_AFFINITY=0 {py}"),
        "process-wide (upstream)": ([], {}, py),
        "tllm-affinity run": (run_lib, {}, f"tllm-affinity run --sysfs-root SIM -- {py}"),
    }
    part2 = {
        "constrained, policy =0 (kept)": (taskset, {"TLLM_NUMA_AWARE_WORKER_AFFINITY": "0"},
                                          f"TLLM_NUMA_AWARE_WORKER_AFFINITY=0 taskset -c "
                                          f"{gpu_cpus} {py}"),
        "constrained, unset (upstream clears)": (taskset, {}, f"taskset -c {gpu_cpus} {py}"),
        "constrained, unset, tllm-affinity run": (taskset + run_lib, {},
                                                  f"taskset -c {gpu_cpus} tllm-affinity run "
                                                  f"--sysfs-root SIM -- {py}"),
    }
    modes = [*part1.items(), *part2.items()]
    samples = {name: [] for name, _ in modes}
    for r in range(rounds):
        # Each round starts at another mode, so no mode always follows the same one.
        for name, (prefix, env, _) in modes[r % len(modes):] + modes[:r % len(modes)]:
            samples[name].append(serve_once(ctx, prefix, env, requests))
    loader = "wrk -t1" if shutil.which("wrk") else "the asyncio client of scripts/bench_server.py"
    cpus = sorted(os.sched_getaffinity(0))
    print(f"\nServer (benches/programs/server_app.py: uvicorn + FastAPI, stand-in TensorRT-LLM "
          f"single-process TP1; engine: benches/programs/engine_step.c, a native step thread "
          f"born from the engine loop, fixed CPU work per step, stepping continuously without "
          f"the GIL); load: {loader}, {requests} requests at concurrency {CONCURRENCY} after 20 "
          f"warm-up requests and a {ctx['idle_s']:.1f} s idle window; {rounds} interleaved "
          f"rounds; simulated host SIM: two NUMA nodes over CPUs {fmt_mask(cpus)}, the GPU "
          f"local to CPU(s) {gpu_cpus}. Cells: median (spread: min–max over the rounds). "
          f"Busy = the step thread's CPU time (CLOCK_THREAD_CPUTIME_ID); off-CPU = its wall "
          f"time minus that (it never blocks, so: runnable, waiting for a CPU).")
    server_table("1. Placement modes", part1, samples)
    server_table(f"2. Constrained launch (taskset -c {gpu_cpus}: the process starts on the "
                 f"GPU-local CPU only)", part2, samples)
    step_rounds = 3 if quick else 7
    step = step_loop(ctx, step_rounds)
    same, cross, states, rec = probe_figures(ctx)
    print(f"\n`tllm-affinity probe` on this host: futex hand-off {same} µs on the same CPU, "
          f"{cross} µs across two cores (median); idle states: {states}; its recommendation: "
          f"{rec}")

    def ratios(name, base, key):
        return [s[key] / b[key] for s, b in zip(samples[name], samples[base])]

    print(f"\nSummary: what placement buys. Each cell: the median over {rounds} interleaved "
          f"rounds of the per-round ratio (spread: min–max); the modes of a round ran back to "
          f"back on the same machine.\n")
    print("| figure (what it measures) | " + " | ".join(h for h, _, _ in COMPARISONS) + " |")
    print("|---|" + "---:|" * len(COMPARISONS))
    for label, key in SUMMARY_ROWS:
        print(f"| {label} | " + " | ".join(cell(ratios(name, base, key), "{:.2f}")
                                            for _, name, base in COMPARISONS) + " |")
    print(f"\n| step loop ({step_rounds} rounds; benches/programs/step_loop.c) | "
          f"TLLM_AFFINITY_STEP_CORE=auto / off |")
    print("|---|---:|")
    for label, key in [("step iteration latency p50 (lower is better)", "iter_p50_ns"),
                       ("step iteration latency p99", "iter_p99_ns"),
                       ("step-to-result hand-off p50", "handoff_p50_ns"),
                       ("step-to-result hand-off p99", "handoff_p99_ns")]:
        print(f"| {label} | {cell(step[key], '{:.2f}')} |")
    for label, key in [("engine steps/s under load", "steps_load"),
                       ("host requests/s", "rps")]:
        got = ratios("tllm-affinity run", "process-wide (upstream)", key)
        wins = sum(1 for x in got if x >= 1)
        print(f"\n{label}, tllm-affinity run / process-wide (upstream): "
              f"{statistics.median(got):.2f} ({min(got):.2f}–{max(got):.2f}); the library at or "
              f"above upstream in {wins} of {len(got)} rounds", end="")
    print()
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"\n--server took {time.monotonic() - start:.0f} s; load average (1, 5, 15 min) "
          f"{' '.join(load_before)} before, {' '.join(load_after)} after, on "
          f"{os.cpu_count()} CPUs (other users' load shows here)")


def write_one_node(root):
    """This host as it is (one NUMA node over every allowed CPU), one GPU on it: the layout on
    which `auto` can give the GPU a step core and a result core."""
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    d = f"{root}/sys/devices/system/node/node0"
    os.makedirs(d)
    open(f"{d}/cpulist", "w").write(cpus + "\n")
    os.makedirs(f"{root}/sys/devices/system/cpu")
    open(f"{root}/sys/devices/system/cpu/online", "w").write(cpus + "\n")
    gpu = f"{root}/sys/bus/pci/devices/0000:3b:00.0"
    os.makedirs(gpu)
    for name, value in [("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200"),
                        ("numa_node", "0"), ("local_cpulist", cpus)]:
        open(f"{gpu}/{name}", "w").write(value + "\n")
