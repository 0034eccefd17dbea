"""Drives an app of tests/programs/zero_code inside the guest, as tests/process/zero_code.rs's Driver does on
the host: at each `PHASE <name> <thread>=<tid>:<role> ...` line it waits 50 ms (threads that were
exiting are gone then), reads each listed thread's mask from the kernel and prints
`PHASE <name> <thread>=<tid>:<role>:<cpulist> ...` (threads gone are left out), then lets the app
go on. `--get K:PATH` sends `GET PATH` to the app's `PORT` after its K-th phase (from 1), as the
host test does; each answer is printed as `GET <path> <body>` at the end.

Usage: drive.py [--get K:PATH]... -- COMMAND [ARG]...
"""
import subprocess
import sys
import threading
import time
import urllib.request


def mask_of(tid):
    try:
        with open("/proc/%s/status" % tid) as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def main():
    args = sys.argv[1:]
    gets = {}
    while args and args[0] == "--get":
        phase, path = args[1].split(":", 1)
        gets.setdefault(int(phase), []).append(path)
        args = args[2:]
    command = args[1:] if args and args[0] == "--" else args
    app = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port, phases, answers, waiting = None, 0, {}, []

    def get(path):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=120) as r:
                answers[path] = r.read().decode()
        except Exception as error:  # shown to the test, which fails on it
            answers[path] = "error: %s" % error

    for line in app.stdout:
        line = line.rstrip("\n")
        if line.startswith("PORT "):
            port = int(line.split()[1])
        if not line.startswith("PHASE "):
            print(line, flush=True)
            continue
        words = line.split()
        time.sleep(0.05)
        seen = []
        for entry in words[2:]:
            name, _, rest = entry.partition("=")
            tid = rest.split(":")[0]
            mask = mask_of(tid)
            if mask is not None:
                seen.append("%s=%s:%s" % (name, rest, mask))
        print("PHASE", words[1], *seen, flush=True)
        phases += 1
        for path in gets.get(phases, []):
            t = threading.Thread(target=get, args=(path,))
            t.start()
            waiting.append(t)
        app.stdin.write("\n")
        app.stdin.flush()
    status = app.wait()
    for t in waiting:
        t.join(120)
    for path, body in answers.items():
        print("GET", path, body.replace("\n", " "), flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
