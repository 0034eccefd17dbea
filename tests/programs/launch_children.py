"""Programs started from a process under the library (tests/process/launch.rs).

Usage: launch_children.py MODE
  worker-subprocess   a worker thread (configure(0)) starts the child with subprocess
  worker-posix-spawn  a worker thread starts it with os.posix_spawn
  worker-sh-exec      a worker thread starts `sh -c 'exec python child'`
  host-subprocess     the main thread (a host) starts the child with subprocess
  child               configure(0) from the main thread, print the report as "CHILD <json>"
  app                 start a thread, print "APP <pid>", for the report tests
"""

import json
import os
import subprocess
import sys
import threading

import tllm_affinity

HERE = os.path.abspath(__file__)


def child_command():
    return [sys.executable, HERE, "child"]


def start_child(how):
    if how == "subprocess":
        subprocess.run(child_command(), check=True)
    elif how == "posix-spawn":
        pid = os.posix_spawn(sys.executable, child_command(), os.environ)
        os.waitpid(pid, 0)
    elif how == "sh-exec":
        quoted = " ".join("'%s'" % a for a in child_command())
        subprocess.run(["sh", "-c", "exec " + quoted], check=True)
    else:
        raise SystemExit("unknown way to start a child: " + how)


def from_worker(how):
    def work():
        lease = tllm_affinity.configure(0)
        start_child(how)
        lease.release()

    t = threading.Thread(target=work)
    t.start()
    t.join()


def main():
    mode = sys.argv[1]
    if mode.startswith("worker-"):
        from_worker(mode[len("worker-"):])
    elif mode == "host-subprocess":
        start_child("subprocess")
    elif mode == "child":
        lease = tllm_affinity.configure(0)
        report = tllm_affinity.report()
        print("CHILD " + json.dumps({"pid": os.getpid(), "constrained": report["constrained"],
                                     "mask_at_load": report["mask_at_load"]}), flush=True)
        lease.release()
    elif mode == "app":
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        print("APP %d" % os.getpid(), flush=True)
    else:
        raise SystemExit("unknown mode " + mode)


if __name__ == "__main__":
    main()
