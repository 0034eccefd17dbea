/* A process that touches 64 MiB on NUMA node 0, then is configured for a GPU on another node:
 * where do its pages lie afterwards? (tests/guest.rs runs it inside the guest.)
 *
 *   memory_follows ACTION [ARG]
 *
 * The main thread maps a 64 MiB buffer and first-touches it with its memory policy bound to node
 * 0 (MPOL_BIND, set back to MPOL_DEFAULT right after), unless MF_NO_BIND=1 (a process under
 * numactl, whose own policy places it). With MF_LOCK=1 the first half is mlock'd. Then ACTION:
 *
 *   main DEVICE       tllm_affinity_configure(DEVICE) on the main thread (a dedicated worker)
 *   thread DEVICE     tllm_affinity_configure(DEVICE) on a second thread (a shared process)
 *   setenv VALUE      setenv("CUDA_VISIBLE_DEVICES", VALUE) (a TLLM_AFFINITY_PROCESS_ROLE=worker
 *                     process follows the device variables)
 *   none              nothing (the library not loaded: the bench's baseline)
 *   wait FILE         prints READY, then waits until FILE exists (another program moves the
 *                     pages meanwhile: numactl's migratepages, the bench's comparison)
 *   hold NODE MIB     takes node NODE's free memory down to MIB (bound there), prints HELD and
 *                     sleeps until killed: another tenant filling the target node
 *   mapfile PATH      maps PATH MAP_PRIVATE, reads every page, prints MAPPED <pages> and sleeps
 *                     until killed: another process sharing a file's page cache (a model file, a
 *                     library) with the worker
 *
 * MF_MIB sets the buffer's size (default 64). With MF_GPU_NODE=N the main thread also maps a
 * second buffer of 16 MiB bound to node N for good (mbind MPOL_BIND: what a program that puts
 * data in a GPU's memory node does) and touches it before ACTION.
 *
 * What runs beside the move (each prints its line after ACTION):
 *   MF_WATCH=1  a thread allocating and touching 1 MiB private chunks in a loop, asking the policy
 *               of its chunks and of the buffer (get_mempolicy MPOL_F_ADDR) each time, and a
 *               thread forking in a loop, each child counting the mappings of its numa_maps with
 *               a policy: WINDOW <policies seen> <chunks>, FORKS <children with a policy> <forks>,
 *               then POLICIES <numa_maps lines with a policy> after ACTION.
 *   MF_WATCH=fork  the forking thread alone (the allocating one fills the target node when a
 *               move runs long).
 *   MF_SHM=1    an 8 MiB shmem object (memfd) mapped shared with a child, which binds its second
 *               half to node 0 (its own shared policy) and touches it all on node 0: after
 *               ACTION the child prints SHM_POLICY <mode of the first half> <mode of the second>
 *               <node mask of the second> and the parent SHM_PAGES <node>=<pages> ...
 *   MF_THP=1    the buffer starts half a huge page past a huge page boundary (2 MiB on 4 KiB
 *               pages, 32 MiB on 16 KiB pages: the kernel's hpage_pmd_size), advised
 *               MADV_HUGEPAGE: HUGE before|after <AnonHugePages kB of the buffer's mappings>
 *               <AnonHugePages kB of the whole host (/proc/meminfo)> <huge page splits so far:
 *               vmstat's thp_split_page + thp_split_pmd + thp_migration_split>. (A process's
 *               smaps leaves out huge pages NUMA balancing has just marked for a hinting fault,
 *               so only the kernel's own counts say whether any was split.)
 *   MF_PIN_EVERY_KIB=N  one page in every N KiB of the buffer long-term pinned, registered as an
 *               io_uring fixed buffer (what cudaHostRegister and RDMA registration do to a worker's
 *               host buffers): such a page cannot migrate. PINNED <pages> before ACTION.
 *   MF_FILE=PATH  PATH mapped MAP_PRIVATE and every page read before ACTION (another process
 *               maps it too: `mapfile`): PAGES file_before|file_after <node>=<pages> ...
 *   MF_PROT_NONE=1  4 MiB more first-touched on node 0, then made PROT_NONE (a guard region, a
 *               JIT's or an allocator's reserve): pages present that no read can reach.
 *   MF_RUN_MS=N the main thread then runs N ms without touching the buffer, as a worker does
 *               between loading its model and configure: automatic NUMA balancing's scanner,
 *               driven by a task's run time, marks the buffer for hinting faults meanwhile.
 *               MARKED <AnonHugePages kB of the buffer's mappings in smaps> after it (smaps
 *               leaves the marked huge pages out).
 * Lines:
 *
 *   PAGES before|after <node>=<pages> ... fail=0     the buffer's memory per node, in 4 KiB
 *                                                    units whatever the kernel's page size
 *   PAGE_KB before|after <kB>                        numa_maps' kernelpagesize_kB= for it
 *   PAGES gpu_before|gpu_after <node>=<pages> ...    the bound buffer's (MF_GPU_NODE only)
 *   LOCKED <pages>                                   pages mlock'd
 *   CONFIGURE <rc> <microseconds>                    the action's return and how long it took
 *   OWN_POLICY <mode>                                the main thread's own memory policy after it
 *   FAULT_MOVES <pages>                              pages the kernel's hinting-fault path moved
 *                                                    during ACTION (vmstat numa_pages_migrated)
 *   REPORT <the library's JSON report after ACTION>
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>

/* memfd_create(2) through syscall(2): glibc declares it from 2.27 on, and the aarch64 build is
 * linked against glibc 2.17 (tests/guest_aarch64.rs). */
#ifndef SYS_memfd_create
#if defined(__x86_64__)
#define SYS_memfd_create 319
#elif defined(__aarch64__)
#define SYS_memfd_create 279
#endif
#endif
#include <unistd.h>
#include "abi.h"
#include "huge_page.h"

#define MAX_NODES 64

static size_t size;
static char *buf;
static size_t gpu_size = 16u << 20;
static char *gpu_buf;
static int device;
static int64_t thread_rc;

static long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000L + t.tv_nsec / 1000;
}

static void set_policy(int mode, unsigned long nodes) {
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
    mask[0] = nodes;
    if (syscall(SYS_set_mempolicy, mode, mode ? mask : NULL, mode ? 1024UL : 0UL) != 0) {
        perror("set_mempolicy");
        exit(2);
    }
}

/* The buffer's pages per node, from /proc/self/numa_maps: its lines for mappings inside the
 * buffer (mlock splits it in two). numa_maps walks the page tables itself; move_pages in query
 * mode answers -ENOENT for pages automatic NUMA balancing marked (kernels 6.1 to 6.4). */
static void pages_of(const char *phase, const char *start, size_t length) {
    FILE *maps = fopen("/proc/self/numa_maps", "r");
    if (!maps) {
        printf("PAGES %s error=numa_maps\n", phase);
        return;
    }
    long counts[MAX_NODES] = {0};
    long page_kb = 4;
    char line[4096];
    while (fgets(line, sizeof line, maps)) {
        char *end;
        unsigned long begin = strtoul(line, &end, 16);
        if (begin < (unsigned long)start || begin >= (unsigned long)start + length) continue;
        char *at = strstr(line, "kernelpagesize_kB=");
        if (at) page_kb = atol(at + strlen("kernelpagesize_kB="));
        for (char *word = strtok(end, " \n"); word; word = strtok(NULL, " \n")) {
            int node;
            long n;
            if (sscanf(word, "N%d=%ld", &node, &n) == 2 && node >= 0 && node < MAX_NODES)
                counts[node] += n * page_kb / 4;
        }
    }
    fclose(maps);
    printf("PAGE_KB %s %ld\n", phase, page_kb);
    printf("PAGES %s", phase);
    for (int node = 0; node < MAX_NODES; node++)
        if (counts[node]) printf(" %d=%ld", node, counts[node]);
    printf(" fail=0\n");
}

static void pages(const char *phase) {
    pages_of(phase, buf, size);
    if (gpu_buf) {
        char gpu_phase[64];
        snprintf(gpu_phase, sizeof gpu_phase, "gpu_%s", phase);
        pages_of(gpu_phase, gpu_buf, gpu_size);
    }
}

/* The second buffer, bound to `node` for good and touched by the calling thread. */
static void map_bound_to(int node, long page) {
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
    mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
    gpu_buf = mmap(NULL, gpu_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (gpu_buf == MAP_FAILED ||
        syscall(SYS_mbind, gpu_buf, gpu_size, 2 /* MPOL_BIND */, mask, 1024UL, 0U) != 0) {
        perror("mbind");
        exit(2);
    }
    for (size_t i = 0; i < gpu_size; i += (size_t)page) gpu_buf[i] = 1;
}

static void *configure_on_thread(void *arg) {
    (void)arg;
    thread_rc = tllm_configure(device);
    return NULL;
}

static int flag(const char *name) { return getenv(name) && strcmp(getenv(name), "1") == 0; }

static volatile int action_done;

static int policy_at(const void *address) {
    int mode = -1;
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
    if (syscall(SYS_get_mempolicy, &mode, mask, 1024UL, address, 2UL /* MPOL_F_ADDR */) != 0)
        return -1;
    return mode;
}

/* numa_maps lines of this process whose policy is not "default" (the gpu buffer's own bind
 * aside, when there is one). */
static int policies(void) {
    FILE *maps = fopen("/proc/self/numa_maps", "r");
    if (!maps) return -1;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, maps)) {
        unsigned long begin = strtoul(line, NULL, 16);
        if (gpu_buf && begin >= (unsigned long)gpu_buf && begin < (unsigned long)gpu_buf + gpu_size)
            continue;
        char *policy = strchr(line, ' ');
        if (policy && strncmp(policy + 1, "default", 7) != 0) n++;
    }
    fclose(maps);
    return n;
}

static long window_seen, window_chunks, fork_policies, forks;

static void *allocate_in_a_loop(void *arg) {
    (void)arg;
    long page = sysconf(_SC_PAGESIZE);
    while (!action_done) {
        char *chunk = mmap(NULL, 1u << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (chunk == MAP_FAILED) break;
        for (size_t i = 0; i < (1u << 20); i += (size_t)page) chunk[i] = 1;
        if (policy_at(chunk) > 0) window_seen++;
        for (size_t at = 0; at < size; at += 1u << 20)
            if (policy_at(buf + at) > 0) window_seen++;
        window_chunks++;
        if (window_chunks % 16 == 0) munmap(chunk, 1u << 20);
    }
    return NULL;
}

static void *fork_in_a_loop(void *arg) {
    (void)arg;
    while (!action_done) {
        pid_t child = fork();
        if (child == 0) {
            int n = policies();
            _exit(n < 0 ? 100 : n > 99 ? 99 : n);
        }
        if (child < 0) break;
        int status = 0;
        waitpid(child, &status, 0);
        forks++;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fork_policies++;
    }
    return NULL;
}

static long huge_kb(void) {
    FILE *smaps = fopen("/proc/self/smaps", "r");
    if (!smaps) return -1;
    char line[4096];
    long kb = 0;
    int inside = 0;
    while (fgets(line, sizeof line, smaps)) {
        unsigned long begin, end;
        if (sscanf(line, "%lx-%lx ", &begin, &end) == 2) {
            inside = begin >= (unsigned long)buf && begin < (unsigned long)buf + size;
            continue;
        }
        long n;
        if (inside && sscanf(line, "AnonHugePages: %ld kB", &n) == 1) kb += n;
    }
    fclose(smaps);
    return kb;
}

/* `name <value>` of a /proc file of such lines (`AnonHugePages: <kB> kB` too), or -1. */
static long proc_value(const char *path, const char *name) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    long value = -1;
    size_t len = strlen(name);
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, name, len) == 0 && (line[len] == ' ' || line[len] == ':')) {
            value = strtol(line + len + 1, NULL, 10);
            break;
        }
    }
    fclose(f);
    return value;
}

static long node_free_mib(int node) {
    char path[128], name[32];
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d/meminfo", node);
    snprintf(name, sizeof name, "Node %d MemFree", node);
    long kb = proc_value(path, name);
    return kb < 0 ? -1 : kb / 1024;
}

static long host_huge_kb(void) { return proc_value("/proc/meminfo", "AnonHugePages"); }

static long huge_splits(void) {
    return proc_value("/proc/vmstat", "thp_split_page") + proc_value("/proc/vmstat", "thp_split_pmd") +
           proc_value("/proc/vmstat", "thp_migration_split");
}


/* hold NODE MIB: bind to NODE and touch until its free memory is down to MIB. */
/* Registers one page in every `every_kib` KiB of the buffer as an io_uring fixed buffer (the
 * kernel pins it FOLL_LONGTERM until the ring closes, at exit) and returns how many, or -1. */
static long pin_every(long every_kib, long page) {
    struct {
        uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
        uint32_t resv[3];
        uint64_t sq_off[5], cq_off[5];
    } params;
    memset(&params, 0, sizeof params);
    int ring = (int)syscall(SYS_io_uring_setup, 1, &params);
    if (ring < 0) {
        perror("io_uring_setup");
        return -1;
    }
    size_t step = (size_t)every_kib << 10, count = size / step;
    struct iovec *pinned = calloc(count, sizeof *pinned);
    for (size_t i = 0; i < count; i++) {
        pinned[i].iov_base = buf + i * step;
        pinned[i].iov_len = (size_t)page;
    }
    if (syscall(SYS_io_uring_register, ring, 0 /* IORING_REGISTER_BUFFERS */, pinned,
                (unsigned)count) != 0) {
        perror("io_uring_register");
        return -1;
    }
    free(pinned);
    return (long)count;
}

/* PATH mapped MAP_PRIVATE, every page read: its pages in this process's page tables. */
static char *map_file(const char *path, size_t *length) {
    FILE *f = fopen(path, "r");
    if (!f || fseek(f, 0, SEEK_END) != 0) {
        perror(path);
        exit(2);
    }
    *length = (size_t)ftell(f);
    char *at = mmap(NULL, *length, PROT_READ, MAP_PRIVATE, fileno(f), 0);
    fclose(f);
    if (at == MAP_FAILED) {
        perror("mmap file");
        exit(2);
    }
    long page = sysconf(_SC_PAGESIZE);
    for (size_t i = 0; i < *length; i += (size_t)page) (void)*(volatile char *)(at + i);
    return at;
}

static int map_file_and_wait(const char *path) {
    size_t length;
    map_file(path, &length);
    printf("MAPPED %lu\n", (unsigned long)(length / (size_t)sysconf(_SC_PAGESIZE)));
    fflush(stdout);
    while (1) pause();
    return 0;
}

static int hold(int node, long keep_mib) {
    set_policy(2 /* MPOL_BIND */, 1UL << node);
    long page = sysconf(_SC_PAGESIZE);
    long held = 0;
    while (node_free_mib(node) > keep_mib) {
        char *chunk = mmap(NULL, 4u << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (chunk == MAP_FAILED) break;
        for (size_t i = 0; i < (4u << 20); i += (size_t)page) chunk[i] = 1;
        held += 4;
    }
    printf("HELD %ld free=%ld\n", held, node_free_mib(node));
    fflush(stdout);
    while (1) pause();
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: memory_follows main|thread DEVICE | setenv VALUE | none\n");
        return 2;
    }
    tllm_abi_load();
    const char *action = argv[1];
    if (strcmp(action, "hold") == 0)
        return hold(argc > 2 ? atoi(argv[2]) : 1, argc > 3 ? atol(argv[3]) : 0);
    if (strcmp(action, "mapfile") == 0 && argc > 2) return map_file_and_wait(argv[2]);
    const char *mib = getenv("MF_MIB");
    size = (size_t)(mib ? atol(mib) : 64) << 20;
    long page = sysconf(_SC_PAGESIZE);
    /* The shmem object's child first: forked after the buffer is touched it would share its
     * pages copy-on-write, and a page two processes map is not moved. */
    int shm_pipe[2] = {-1, -1}, shm_done[2] = {-1, -1};
    pid_t shm_child = -1;
    char *shm = NULL;
    const size_t shm_size = 8u << 20;
    if (flag("MF_SHM")) {
        int fd = (int)syscall(SYS_memfd_create, "memory_follows_shm", 0);
        if (fd < 0 || ftruncate(fd, (off_t)shm_size) != 0 || pipe(shm_pipe) != 0 ||
            pipe(shm_done) != 0) {
            perror("memfd");
            return 2;
        }
        fflush(stdout);
        shm_child = fork();
        if (shm_child == 0) {
            char *mine = mmap(NULL, shm_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            unsigned long node0[1024 / (8 * sizeof(unsigned long))] = {1UL};
            if (mine == MAP_FAILED ||
                syscall(SYS_mbind, mine + shm_size / 2, shm_size / 2, 2 /* MPOL_BIND */, node0,
                        1024UL, 0U) != 0) {
                perror("child mbind");
                _exit(2);
            }
            set_policy(2 /* MPOL_BIND */, 1UL);
            for (size_t i = 0; i < shm_size; i += (size_t)page) mine[i] = 1;
            if (write(shm_pipe[1], "r", 1) != 1) _exit(2);
            char c;
            if (read(shm_done[0], &c, 1) != 1) _exit(2);
            int mode = -1;
            unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
            syscall(SYS_get_mempolicy, &mode, mask, 1024UL, mine + shm_size / 2, 2UL);
            printf("SHM_POLICY %d %d %lu\n", policy_at(mine), mode, mask[0]);
            fflush(stdout);
            _exit(0);
        }
        char c;
        if (shm_child < 0 || read(shm_pipe[0], &c, 1) != 1) {
            perror("shm child");
            return 2;
        }
        shm = mmap(NULL, shm_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (shm == MAP_FAILED) {
            perror("mmap shm");
            return 2;
        }
        for (size_t i = 0; i < shm_size; i += (size_t)page) (void)*(volatile char *)(shm + i);
        pages_of("shm_before", shm, shm_size);
    }
    /* On a huge page boundary between inaccessible pages: no other mapping merges into the
     * buffer's, and no transparent huge page straddles its mlock'd half and the rest (moving the
     * rest would move the whole huge page). */
    const uintptr_t huge = pmd_huge_page_bytes();
    int thp = flag("MF_THP");
    char *guarded = mmap(NULL, size + 3 * huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    buf = (char *)(((uintptr_t)guarded + huge) & ~(huge - 1));
    /* Huge pages: half a huge page past a boundary, so a walk in steps from the mapping's start
     * ends its steps inside huge pages. */
    if (thp) buf += huge / 2;
    if (guarded == MAP_FAILED || mprotect(buf, size, PROT_READ | PROT_WRITE) != 0 ||
        (thp && madvise(buf, size, MADV_HUGEPAGE) != 0)) {
        perror("mmap");
        return 2;
    }
    int bind = !(getenv("MF_NO_BIND") && strcmp(getenv("MF_NO_BIND"), "1") == 0);
    if (bind) set_policy(2 /* MPOL_BIND */, 1UL /* node 0 */);
    for (size_t i = 0; i < size; i += (size_t)page) buf[i] = 1;
    if (flag("MF_PROT_NONE")) {
        const size_t guard_size = 4u << 20;
        char *guard = mmap(NULL, guard_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                           -1, 0);
        if (guard == MAP_FAILED) {
            perror("mmap guard");
            return 2;
        }
        for (size_t i = 0; i < guard_size; i += (size_t)page) guard[i] = 1;
        if (mprotect(guard, guard_size, PROT_NONE) != 0) {
            perror("mprotect");
            return 2;
        }
    }
    if (bind) set_policy(0 /* MPOL_DEFAULT */, 0);
    const char *file_path = getenv("MF_FILE");
    size_t file_size = 0;
    char *file_map = file_path ? map_file(file_path, &file_size) : NULL;
    if (file_map) pages_of("file_before", file_map, file_size);
    const char *gpu_node = getenv("MF_GPU_NODE");
    if (gpu_node) {
        int node = atoi(gpu_node);
        if (node < 0 || node >= 1024) {
            fprintf(stderr, "MF_GPU_NODE=%s: not a node\n", gpu_node);
            return 2;
        }
        map_bound_to(node, page);
    }
    if (getenv("MF_LOCK") && strcmp(getenv("MF_LOCK"), "1") == 0) {
        if (mlock(buf, size / 2) != 0) {
            perror("mlock");
            return 2;
        }
        printf("LOCKED %lu\n", (unsigned long)(size / 2 / (size_t)page));
    }
    const char *pin_kib = getenv("MF_PIN_EVERY_KIB");
    if (pin_kib) {
        long pinned = pin_every(atol(pin_kib), page);
        if (pinned < 0) return 2;
        printf("PINNED %ld\n", pinned);
    }
    if (thp) printf("HUGE before %ld %ld %ld\n", huge_kb(), host_huge_kb(), huge_splits());
    const char *run_ms = getenv("MF_RUN_MS");
    if (run_ms) {
        for (long until = now_us() + atol(run_ms) * 1000; now_us() < until;) {
        }
        printf("MARKED %ld\n", huge_kb());
    }
    pthread_t allocator, forker;
    int fork_only = getenv("MF_WATCH") && strcmp(getenv("MF_WATCH"), "fork") == 0;
    int watch = flag("MF_WATCH") || fork_only;
    if (watch) {
        if (!fork_only) pthread_create(&allocator, NULL, allocate_in_a_loop, NULL);
        pthread_create(&forker, NULL, fork_in_a_loop, NULL);
    }
    pages("before");
    fflush(stdout);
    long fault_moves = proc_value("/proc/vmstat", "numa_pages_migrated");
    long started = now_us();
    int64_t rc = 0;
    if (strcmp(action, "main") == 0 || strcmp(action, "thread") == 0) {
        tllm_abi_require(tllm_configure && tllm_report);
        device = argc > 2 ? atoi(argv[2]) : 0;
        if (action[0] == 'm') {
            rc = tllm_configure(device);
        } else {
            pthread_t t;
            pthread_create(&t, NULL, configure_on_thread, NULL);
            pthread_join(t, NULL);
            rc = thread_rc;
        }
    } else if (strcmp(action, "setenv") == 0) {
        tllm_abi_require(tllm_report != NULL);
        rc = setenv("CUDA_VISIBLE_DEVICES", argc > 2 ? argv[2] : "", 1);
    } else if (strcmp(action, "wait") == 0 && argc > 2) {
        printf("READY\n");
        fflush(stdout);
        while (access(argv[2], F_OK) != 0) usleep(10000);
    } else if (strcmp(action, "none") != 0) {
        fprintf(stderr, "unknown action %s\n", action);
        return 2;
    }
    printf("CONFIGURE %lld %ld\n", (long long)rc, now_us() - started);
    {
        int mode = -1;
        unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
        syscall(SYS_get_mempolicy, &mode, mask, 1024UL, NULL, 0UL);
        printf("OWN_POLICY %d\n", mode);
    }
    printf("FAULT_MOVES %ld\n", proc_value("/proc/vmstat", "numa_pages_migrated") - fault_moves);
    action_done = 1;
    if (watch) {
        if (!fork_only) pthread_join(allocator, NULL);
        pthread_join(forker, NULL);
        printf("WINDOW %ld %ld\nFORKS %ld %ld\nPOLICIES %d\n", window_seen, window_chunks,
               fork_policies, forks, policies());
    }
    if (thp) printf("HUGE after %ld %ld %ld\n", huge_kb(), host_huge_kb(), huge_splits());
    if (shm) {
        pages_of("shm_after", shm, shm_size);
        fflush(stdout);
        int status = 0;
        if (write(shm_done[1], "d", 1) != 1 || waitpid(shm_child, &status, 0) != shm_child ||
            !WIFEXITED(status) || WEXITSTATUS(status) != 0)
            printf("SHM_CHILD failed %d\n", status);
    }
    pages("after");
    if (file_map) pages_of("file_after", file_map, file_size);
    if (tllm_report) {
        static char json[1 << 16];
        int64_t need = tllm_report(json, sizeof json);
        if (need > 0 && (size_t)need < sizeof json) printf("REPORT %s\n", json);
    }
    return 0;
}
