"""A thread created in a worker scope, and the processes it starts (tests/process/worker_scope.rs),
run preloaded on the simulated two-node host, whose device 1 is local to node 0: the one node
this kernel has, so the scope's preference is a real one.

The main thread opens a worker scope for device 1 and creates a thread. The thread prints its own
memory policy (the kernel copied the caller's), then that of a bare `fork` child and of a `system`
child; then it sets a policy of its own (MPOL_BIND on node 0) and prints the three again, and its
own policy after them. Lines, each `<who> <mode> <node mask>`:

  CALLER, THREAD, THREAD_FORK, THREAD_SYSTEM, BOUND, BOUND_FORK, BOUND_SYSTEM, BOUND_AFTER

`scope_thread_children.py --policy` prints the policy of the process it runs in (the `system`
child).
"""
import ctypes
import os
import sys
import tempfile
import threading

LIB = ctypes.CDLL(None, use_errno=True)
GET_MEMPOLICY, SET_MEMPOLICY = {"x86_64": (239, 238), "aarch64": (236, 237)}[os.uname().machine]
MPOL_BIND = 2


def own_policy():
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * 16)()
    if LIB.syscall(GET_MEMPOLICY, ctypes.byref(mode), mask, ctypes.c_ulong(1024), None,
                   ctypes.c_ulong(0)) != 0:
        return f"failed errno {ctypes.get_errno()}"
    return f"{mode.value} {mask[0]:#x}"


def forked_policy():
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, own_policy().encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as forked:
        policy = forked.read()
    os.waitpid(pid, 0)
    return policy


def system_policy():
    with tempfile.NamedTemporaryFile("r") as out:
        status = os.system(f"{sys.executable} {__file__} --policy > {out.name}")
        return out.read().strip() if status == 0 else f"system failed {status}"


def in_the_scope(lines):
    lines.append(f"THREAD {own_policy()}")
    lines.append(f"THREAD_FORK {forked_policy()}")
    lines.append(f"THREAD_SYSTEM {system_policy()}")
    node0 = (ctypes.c_ulong * 16)(1)
    if LIB.syscall(SET_MEMPOLICY, MPOL_BIND, node0, ctypes.c_ulong(1024)) != 0:
        lines.append(f"BOUND failed errno {ctypes.get_errno()}")
        return
    lines.append(f"BOUND {own_policy()}")
    lines.append(f"BOUND_FORK {forked_policy()}")
    lines.append(f"BOUND_SYSTEM {system_policy()}")
    lines.append(f"BOUND_AFTER {own_policy()}")


def main():
    if sys.argv[1:] == ["--policy"]:
        print(own_policy())
        return 0
    LIB.tllm_affinity_begin_worker_scope.restype = ctypes.c_int64
    LIB.tllm_affinity_end_worker_scope.argtypes = [ctypes.c_int64]
    lease = LIB.tllm_affinity_begin_worker_scope(1)
    print(f"CALLER {own_policy()}")
    lines = []
    thread = threading.Thread(target=in_the_scope, args=(lines,))
    thread.start()
    thread.join()
    print("\n".join(lines))
    LIB.tllm_affinity_end_worker_scope(lease)
    return 0


if __name__ == "__main__":
    sys.exit(main())
