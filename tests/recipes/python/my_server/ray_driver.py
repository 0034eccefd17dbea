"""Stand-in for `python -m my_server.ray_driver`, a user's Ray driver that calls ray.init() and
starts TensorRT-LLM's Ray actors, for the README recipe test: it runs the zero-code Ray
deployment of tests/programs/zero_code/ray_actors.py (a real local Ray cluster, two
RayWorkerWrapper actors of the upstream-shaped stand-in) unmodified, and exits 1 unless every
actor's threads were on one GPU's CPUs after setup_engine and back on the launch mask after
shutdown()."""
import json
import os
import runpy
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.normpath(os.path.join(HERE, "..", "..", "..", "programs"))
sys.path.insert(0, PROGRAMS)
# The actors import the deployment's instrumentation too: a local cluster's workers start with
# the driver's environment.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (PROGRAMS, os.environ.get("PYTHONPATH")) if p)


def main():
    with tempfile.TemporaryDirectory() as scratch:
        script = os.path.join(PROGRAMS, "zero_code", "ray_actors.py")
        out = os.path.join(scratch, "out")
        real_stdout = sys.stdout
        with open(out, "w") as captured:
            sys.stdout = captured
            sys.argv = [script, scratch]
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as end:
                if end.code:
                    raise
            finally:
                sys.stdout = real_stdout
        lines = dict(line.rstrip("\n").split(" ", 1) for line in open(out) if " " in line)
    launch = set(os.sched_getaffinity(0))
    setup, shutdown = json.loads(lines["SETUP"]), json.loads(lines["SHUTDOWN"])
    placed = []
    for actor in setup:
        masks = {cpus(t["mask"]) for t in actor["threads"].values()}
        if len(masks) != 1 or masks == {frozenset(launch)}:
            sys.exit("actor %d: its threads are not on one GPU's CPUs: %s" % (actor["pid"], masks))
        placed.append(masks.pop())
    if len(set(placed)) != len(placed):
        sys.exit("the actors share their CPUs: %s" % placed)
    for actor in shutdown:
        left = {n: t["mask"] for n, t in actor["threads"].items() if cpus(t["mask"]) != launch}
        if left:
            sys.exit("actor %d after shutdown(): %s" % (actor["pid"], left))
    print("every actor's threads on its GPU's CPUs, then back:",
          [sorted(p) for p in placed])


def cpus(cpulist):
    """A kernel cpulist ("0-3,8") as a set."""
    out = set()
    for part in cpulist.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return frozenset(out)


if __name__ == "__main__":
    main()
