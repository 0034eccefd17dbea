"""Children started while a worker scope is open on the main thread (tests/guests/guest.rs runs it
inside the two-node guest, preloaded): which memory policy does each start with?

Usage: memory_children.py DEVICE WORKER

The main thread opens a worker scope for DEVICE (its workers' node is the GPU's), then starts
`numactl --show` through `subprocess` and through `os.posix_spawn`, a bare `os.fork` child that
asks its own policy with get_mempolicy, and WORKER (a command line, split on spaces: a dedicated
worker that touches memory, then configures), then ends the scope. Lines:

  CALLER during|after <mode> <node mask>   the main thread's own policy in the scope and after it
  SUBPROCESS <numactl --show's line>       each line of the subprocess child's numactl --show
  SPAWN <numactl --show's line>            the same from the posix_spawn child
  FORK <mode> <node mask>                  the bare fork child's get_mempolicy
  WORKER <line>                            each line the worker printed (stdout and stderr)
"""
import ctypes
import os
import subprocess
import sys

LIB = ctypes.CDLL(None, use_errno=True)
LIB.tllm_affinity_begin_worker_scope.restype = ctypes.c_int64
LIB.tllm_affinity_begin_worker_scope.argtypes = [ctypes.c_int32]
LIB.tllm_affinity_end_worker_scope.restype = ctypes.c_int32
LIB.tllm_affinity_end_worker_scope.argtypes = [ctypes.c_int64]
SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}[os.uname().machine]


def own_policy():
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * 16)()
    rc = LIB.syscall(SYS_GET_MEMPOLICY, ctypes.byref(mode), mask, ctypes.c_ulong(1024), None,
                     ctypes.c_ulong(0))
    if rc != 0:
        return f"failed errno {ctypes.get_errno()}"
    return f"{mode.value} {mask[0]:#x}"


def show(prefix, text):
    for line in text.splitlines():
        print(prefix, line)


def main():
    device, worker = int(sys.argv[1]), sys.argv[2].split()
    lease = LIB.tllm_affinity_begin_worker_scope(device)
    if lease <= 0:
        print(f"begin_worker_scope({device}) = {lease}", file=sys.stderr)
        return 2
    print("CALLER during", own_policy())
    sys.stdout.flush()
    show("SUBPROCESS", subprocess.run(["numactl", "--show"], capture_output=True,
                                      text=True, check=True).stdout)
    read_end, write_end = os.pipe()
    pid = os.posix_spawn("/usr/bin/env", ["env", "numactl", "--show"], dict(os.environ),
                         file_actions=[(os.POSIX_SPAWN_DUP2, write_end, 1)])
    os.close(write_end)
    with os.fdopen(read_end) as spawned:
        show("SPAWN", spawned.read())
    os.waitpid(pid, 0)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, own_policy().encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as forked:
        print("FORK", forked.read())
    os.waitpid(pid, 0)
    ran = subprocess.run(worker, capture_output=True, text=True)
    show("WORKER", ran.stdout + ran.stderr)
    print("WORKER exit", ran.returncode)
    LIB.tllm_affinity_end_worker_scope(lease)
    print("CALLER after", own_policy())
    return 0


if __name__ == "__main__":
    sys.exit(main())
