/* Where threads run and where their memory lands, on a real multi-node kernel (tests/guest.rs
 * runs it inside the guest; it runs on any Linux).
 *
 * Threads: main (the host thread that configures nothing), H (a host thread started first), W
 * (calls tllm_affinity_configure(device)) and C (a thread W creates after configuring: born a
 * worker). Memory: 4 MiB buffers on 2 MiB boundaries, each first touched by one thread, their
 * pages' nodes read with move_pages in query mode (no page moves).
 *
 *   early    touched by main before any configure (memory touched before configure)
 *   host     touched by H after W configured
 *   worker   touched by W after configuring
 *   child    touched by C
 *   scope    touched by main while a worker scope it opened is open (the scope's caller)
 *   scoped   touched by S, a thread main creates inside that scope (born a worker)
 *
 * Lines (masks as cpulists read from the kernel with sched_getaffinity(tid)):
 *
 *   MASK <phase> <thread> <cpulist> <role>    phase: before, configured, released, scope
 *   PAGES <buffer> <node>=<pages> ... fail=<n> cpu=<CPU at the first touch>-<at the last>
 *   POLICY <thread> <phase> <mode> <nodes>    get_mempolicy's mode (0 MPOL_DEFAULT, 1
 *                                             MPOL_PREFERRED, 2 MPOL_BIND) and node mask (hex)
 *   HOLD                                      while configured, with NUMA_PLACEMENT_HOLD set to
 *                                             a FIFO: the program waits for a line from it (a
 *                                             test reads the process from outside meanwhile)
 *   LEASE <configure's lease> SCOPE <scope's lease>
 *   REPORT <the library's JSON report while configured>
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "abi.h"
#include "cpulist.h"
#include "huge_page.h"
#include "park.h"

#define BUF (4u << 20)
#define MAX_NODES 64

static int device;
static pid_t tid_main, tid_h, tid_w, tid_c;
static char *buf_early, *buf_host, *buf_worker, *buf_child, *buf_scope, *buf_scoped;
static int policy_h_before = -1, policy_h_after = -1;

/* One step counter everyone waits on: main advances it, threads act at their step. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int step, ready;

static void wait_step(int s) { wait_count(&lock, &changed, &step, s); }
static void set_step(int s) { set_and_wake(&lock, &changed, &step, s); }
static void mark_ready(void) { count_in(&lock, &changed, &ready); }
static void wait_ready(int n) { wait_count(&lock, &changed, &ready, n); }

static pid_t gettid_(void) { return (pid_t)syscall(SYS_gettid); }

/* The calling thread's policy mode; its node mask's first word in *nodes_out when given. The
 * mask is as wide as the kernel's largest node count (1024 nodes), which get_mempolicy needs. */
static int policy_of(unsigned long *nodes_out) {
    int mode = -1;
    unsigned long nodes[1024 / (8 * sizeof(unsigned long))] = {0};
    if (syscall(SYS_get_mempolicy, &mode, nodes, 1024UL, NULL, 0UL) != 0) return -1;
    if (nodes_out) *nodes_out = nodes[0];
    return mode;
}

static int policy_mode(void) { return policy_of(NULL); }

static void policy_line(const char *thread, const char *phase) {
    unsigned long nodes = 0;
    int mode = policy_of(&nodes);
    printf("POLICY %s %s %d %lx\n", thread, phase, mode, nodes);
}

/* A buffer starting on a huge page boundary: a transparent huge page then never spans two
 * buffers (adjacent mappings merge, and a huge page faulted in by one buffer's toucher would hold
 * pages of its neighbour, on the first toucher's node). */
static char *buffer(void) {
    const uintptr_t huge = pmd_huge_page_bytes();
    char *b = mmap(NULL, BUF + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    return (char *)(((uintptr_t)b + huge - 1) & ~(huge - 1));
}

/* The CPU each buffer's toucher ran on at its first and last page. */
static struct { char *b; int first, last; } touched[8];
static int n_touched;

static void touch(char *b) {
    long page = sysconf(_SC_PAGESIZE);
    int first = sched_getcpu();
    for (size_t i = 0; i < BUF; i += (size_t)page) b[i] = 1;
    pthread_mutex_lock(&lock);
    touched[n_touched].b = b;
    touched[n_touched].first = first;
    touched[n_touched].last = sched_getcpu();
    n_touched++;
    pthread_mutex_unlock(&lock);
}

static void pages(const char *name, char *b) {
    long page = sysconf(_SC_PAGESIZE);
    unsigned long n = BUF / (unsigned long)page;
    void **addrs = calloc(n, sizeof *addrs);
    int *status = calloc(n, sizeof *status);
    for (unsigned long i = 0; i < n; i++) addrs[i] = b + i * (unsigned long)page;
    int counts[MAX_NODES] = {0}, failed = 0;
    if (syscall(SYS_move_pages, 0, n, addrs, NULL, status, 0) != 0) {
        printf("PAGES %s error=move_pages\n", name);
        return;
    }
    for (unsigned long i = 0; i < n; i++) {
        if (status[i] >= 0 && status[i] < MAX_NODES) counts[status[i]]++;
        else failed++;
    }
    printf("PAGES %s", name);
    for (int node = 0; node < MAX_NODES; node++)
        if (counts[node]) printf(" %d=%d", node, counts[node]);
    printf(" fail=%d", failed);
    pthread_mutex_lock(&lock);
    for (int t = 0; t < n_touched; t++)
        if (touched[t].b == b) printf(" cpu=%d-%d", touched[t].first, touched[t].last);
    pthread_mutex_unlock(&lock);
    printf("\n");
    free(addrs);
    free(status);
}

static void mask_line(const char *phase, const char *name, pid_t tid) {
    cpu_set_t set;
    CPU_ZERO(&set);
    char list[1024] = "gone";
    if (sched_getaffinity(tid, sizeof set, &set) == 0) cpulist(&set, list, sizeof list);
    printf("MASK %s %s %s %d\n", phase, name, list, tllm_role(tid));
}

static void masks(const char *phase) {
    mask_line(phase, "main", tid_main);
    mask_line(phase, "H", tid_h);
    mask_line(phase, "W", tid_w);
    mask_line(phase, "C", tid_c);
}

static void *host_thread(void *arg) {
    (void)arg;
    tid_h = gettid_();
    policy_h_before = policy_mode();
    mark_ready();
    wait_step(1); /* W has configured */
    touch(buf_host);
    policy_h_after = policy_mode();
    mark_ready();
    wait_step(9);
    return NULL;
}

static void *child_thread(void *arg) {
    (void)arg;
    tid_c = gettid_();
    touch(buf_child);
    mark_ready();
    wait_step(9);
    return NULL;
}

static int64_t lease;

static void *worker_thread(void *arg) {
    (void)arg;
    tid_w = gettid_();
    lease = tllm_configure(device);
    touch(buf_worker);
    pthread_t c;
    pthread_create(&c, NULL, child_thread, NULL);
    mark_ready();
    wait_step(9);
    pthread_join(c, NULL);
    return NULL;
}

static void *scoped_thread(void *arg) {
    (void)arg;
    touch(buf_scoped);
    mask_line("scope", "S", gettid_());
    return NULL;
}

int main(int argc, char **argv) {
    device = argc > 1 ? atoi(argv[1]) : 0;
    tllm_abi_load();
    tllm_abi_require(tllm_configure && tllm_begin_scope && tllm_end_scope && tllm_release &&
                     tllm_role && tllm_report);
    tid_main = gettid_();
    buf_early = buffer();
    buf_host = buffer();
    buf_worker = buffer();
    buf_child = buffer();
    buf_scope = buffer();
    buf_scoped = buffer();
    int policy_main_before = policy_mode();
    touch(buf_early);

    pthread_t h, w;
    pthread_create(&h, NULL, host_thread, NULL);
    wait_ready(1);
    pthread_create(&w, NULL, worker_thread, NULL);
    wait_ready(2); /* W configured, touched, and C started */
    wait_ready(3); /* C touched */
    set_step(1);
    wait_ready(4); /* H touched */
    masks("configured");
    static char json[1 << 16];
    int64_t need = tllm_report(json, sizeof json);
    if (need > 0 && (size_t)need < sizeof json) printf("REPORT %s\n", json);
    pages("early", buf_early);
    pages("host", buf_host);
    pages("worker", buf_worker);
    pages("child", buf_child);
    printf("POLICY main before %d\nPOLICY main configured %d\n", policy_main_before,
           policy_mode());
    printf("POLICY H before %d\nPOLICY H configured %d\n", policy_h_before, policy_h_after);
    const char *hold = getenv("NUMA_PLACEMENT_HOLD");
    if (hold) {
        printf("HOLD\n");
        fflush(stdout);
        FILE *go = fopen(hold, "r");
        char line[16];
        if (go) {
            if (!fgets(line, sizeof line, go)) line[0] = 0;
            fclose(go);
        }
    }
    if (lease > 0) tllm_release(lease);
    masks("released");

    /* The scope's caller: main opens a worker scope and allocates while it is open. */
    int64_t scope = tllm_begin_scope(device);
    policy_line("main", "scope");
    touch(buf_scope);
    mask_line("scope", "main", tid_main);
    pthread_t s;
    pthread_create(&s, NULL, scoped_thread, NULL);
    pthread_join(s, NULL);
    if (scope > 0) {
        tllm_end_scope(scope);
        tllm_release(scope);
    }
    policy_line("main", "after_scope");
    pages("scope", buf_scope);
    pages("scoped", buf_scoped);
    printf("LEASE %lld SCOPE %lld\n", (long long)lease, (long long)scope);
    set_step(9);
    pthread_join(w, NULL);
    pthread_join(h, NULL);
    fflush(stdout);
    return 0;
}
