"""What the memory_follows_*.py programs share: 64 MiB first-touched on node 0 by the main thread,
as the interpreter and the framework touch memory before upstream's late pin, and the buffer's
pages per node read back.

Lines: ``DEVICE <n>``; ``PAGES before|after <node>=<pages> ... fail=0`` for the buffer's 4 KiB
pages, read from ``numa_maps``.
"""
import ctypes
import mmap

SYS_SET_MEMPOLICY = 238  # x86_64
MPOL_DEFAULT, MPOL_BIND = 0, 2
MIB = 64
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def set_policy(mode, nodes):
    mask = (ctypes.c_ulong * 16)(nodes)
    args = (mask, ctypes.c_ulong(1024)) if mode else (None, ctypes.c_ulong(0))
    if libc.syscall(SYS_SET_MEMPOLICY, mode, *args) != 0:
        raise OSError(ctypes.get_errno(), "set_mempolicy")


def pages(phase, start, size):
    """The buffer's pages per node, from /proc/self/numa_maps (which walks the page tables
    itself; move_pages in query mode answers -ENOENT for pages automatic NUMA balancing marked,
    on kernels 6.1 to 6.4)."""
    counts = {}
    with open("/proc/self/numa_maps") as maps:
        for line in maps:
            words = line.split()
            if not start <= int(words[0], 16) < start + size:
                continue
            page_kb = next((int(w.split("=")[1]) for w in words
                            if w.startswith("kernelpagesize_kB=")), 4)
            for w in words:
                if w.startswith("N") and "=" in w:
                    node, n = w[1:].split("=")
                    counts[int(node)] = counts.get(int(node), 0) + int(n) * page_kb // 4
    nodes = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"PAGES {phase} {nodes} fail=0", flush=True)


def buffer(size):
    """``size`` bytes of anonymous memory between two inaccessible pages, so that no other
    mapping merges into its numa_maps line."""
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    base = libc.mmap(None, size + 2 * page, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value) or libc.mprotect(base + page, size, 3) != 0:
        raise OSError(ctypes.get_errno(), "mmap")
    return base + page


def touched_on_node0(device):
    """Says ``DEVICE``, first-touches the buffer with this thread's policy bound to node 0 (set
    back to the default right after, so the library sees no policy of the process's own), says
    ``PAGES before``; returns ``after()``, which says ``PAGES after``."""
    print(f"DEVICE {device}", flush=True)
    size = MIB << 20
    start = buffer(size)
    set_policy(MPOL_BIND, 1)
    ctypes.memset(start, 1, size)
    set_policy(MPOL_DEFAULT, 0)
    pages("before", start, size)
    return lambda: pages("after", start, size)
