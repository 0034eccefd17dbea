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
 *
 * MF_MIB sets the buffer's size (default 64). With MF_GPU_NODE=N the main thread also maps a
 * second buffer of 16 MiB bound to node N for good (mbind MPOL_BIND: what a program that puts
 * data in a GPU's memory node does) and touches it before ACTION. Lines:
 *
 *   PAGES before|after <node>=<pages> ... fail=0     the buffer's 4 KiB pages per node
 *   PAGES gpu_before|gpu_after <node>=<pages> ...    the bound buffer's (MF_GPU_NODE only)
 *   LOCKED <pages>                                   pages mlock'd
 *   CONFIGURE <rc> <microseconds>                    the action's return and how long it took
 *   REPORT <the library's JSON report after ACTION>
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "abi.h"

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
    char line[4096];
    while (fgets(line, sizeof line, maps)) {
        char *end;
        unsigned long begin = strtoul(line, &end, 16);
        if (begin < (unsigned long)start || begin >= (unsigned long)start + length) continue;
        long page_kb = 4;
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

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: memory_follows main|thread DEVICE | setenv VALUE | none\n");
        return 2;
    }
    tllm_abi_load();
    const char *action = argv[1];
    const char *mib = getenv("MF_MIB");
    size = (size_t)(mib ? atol(mib) : 64) << 20;
    long page = sysconf(_SC_PAGESIZE);
    /* On a 2 MiB boundary between inaccessible pages: no other mapping merges into the buffer's,
     * and no transparent huge page straddles its mlock'd half and the rest (moving the rest would
     * move the whole huge page). */
    const uintptr_t huge = 2u << 20;
    char *guarded = mmap(NULL, size + 2 * huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    buf = (char *)(((uintptr_t)guarded + huge) & ~(huge - 1));
    if (guarded == MAP_FAILED || mprotect(buf, size, PROT_READ | PROT_WRITE) != 0) {
        perror("mmap");
        return 2;
    }
    int bind = !(getenv("MF_NO_BIND") && strcmp(getenv("MF_NO_BIND"), "1") == 0);
    if (bind) set_policy(2 /* MPOL_BIND */, 1UL /* node 0 */);
    for (size_t i = 0; i < size; i += (size_t)page) buf[i] = 1;
    if (bind) set_policy(0 /* MPOL_DEFAULT */, 0);
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
    pages("before");
    fflush(stdout);
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
    } else if (strcmp(action, "none") != 0) {
        fprintf(stderr, "unknown action %s\n", action);
        return 2;
    }
    printf("CONFIGURE %lld %ld\n", (long long)rc, now_us() - started);
    pages("after");
    if (tllm_report) {
        static char json[1 << 16];
        int64_t need = tllm_report(json, sizeof json);
        if (need > 0 && (size_t)need < sizeof json) printf("REPORT %s\n", json);
    }
    return 0;
}
