"""Children started while a worker scope is open on the main thread (tests/guests/guest.rs runs it
inside the two-node guest, preloaded): which memory policy does each start with?

Usage: memory_children.py DEVICE WORKER

The main thread opens a worker scope for DEVICE (its workers' node is the GPU's), then starts
`numactl --show` through `subprocess`, `os.posix_spawn`, libc's `system` (`os.system`) and libc's
`popen` (glibc starts both through its own internal spawn), a bare `os.fork` child that asks its
own policy with get_mempolicy, a thread it creates meanwhile (which inherits the preference: the
scope's point) and which starts `numactl --show` through `subprocess` and forks a bare child, and
WORKER (a command line, split on spaces: a dedicated worker that touches memory, then
configures), then ends the scope. Lines:

  CALLER during|after <mode> <node mask>   the main thread's own policy in the scope and after it
  SUBPROCESS <numactl --show's line>       each line of the subprocess child's numactl --show
  SPAWN <numactl --show's line>            the same from the posix_spawn child
  SYSTEM <numactl --show's line>           the same from the system() child
  POPEN <numactl --show's line>            the same from the popen() child
  FORK <mode> <node mask>                  the bare fork child's get_mempolicy
  THREAD self <mode> <node mask>           the thread's own policy
  THREAD_SUBPROCESS <numactl --show's line>  the thread's subprocess child's
  THREAD_FORK <mode> <node mask>           the thread's bare fork child's get_mempolicy
  WORKER <line>                            each line the worker printed (stdout and stderr)
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import threading

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


def forked_policy():
    """A bare fork child's own policy, as its get_mempolicy gives it."""
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


def numactl_through_system():
    with tempfile.NamedTemporaryFile("r") as out:
        status = os.system(f"numactl --show > {out.name}")
        return out.read() if status == 0 else f"system failed {status}"


def numactl_through_popen():
    LIB.popen.restype = ctypes.c_void_p
    LIB.popen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    LIB.fread.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
    LIB.pclose.argtypes = [ctypes.c_void_p]
    stream = LIB.popen(b"numactl --show", b"r")
    if not stream:
        return f"popen failed errno {ctypes.get_errno()}"
    buf = ctypes.create_string_buffer(1 << 16)
    n = LIB.fread(buf, 1, len(buf) - 1, stream)
    LIB.pclose(stream)
    return buf.raw[:n].decode()


def thread_created_in_the_scope(lines):
    lines.append(f"THREAD self {own_policy()}")
    shown = subprocess.run(["numactl", "--show"], capture_output=True, text=True,
                           check=True).stdout
    lines.extend(f"THREAD_SUBPROCESS {line}" for line in shown.splitlines())
    lines.append(f"THREAD_FORK {forked_policy()}")


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
    show("SYSTEM", numactl_through_system())
    show("POPEN", numactl_through_popen())
    print("FORK", forked_policy())
    sys.stdout.flush()
    lines = []
    thread = threading.Thread(target=thread_created_in_the_scope, args=(lines,))
    thread.start()
    thread.join()
    print("\n".join(lines))
    ran = subprocess.run(worker, capture_output=True, text=True)
    show("WORKER", ran.stdout + ran.stderr)
    print("WORKER exit", ran.returncode)
    LIB.tllm_affinity_end_worker_scope(lease)
    print("CALLER after", own_policy())
    return 0


if __name__ == "__main__":
    sys.exit(main())
