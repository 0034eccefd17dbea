/* A mixed thread population for the integration tests, driven phase by phase.
 *
 * Threads: the main thread (host); H1, a host thread started before any worker exists; W, the
 * worker thread that calls tllm_affinity_configure; C1..C6, W's children, alive throughout; G1,
 * C1's child (W's grandchild); P1, a thread whose start routine lives in libfakenccl.so (a
 * TLLM_AFFINITY_WORKER_LIBS object), created by the main thread before configure; and threads
 * born later: C7 (W's, during the lease), H2 (main's, during the lease), P2 (worker-lib, during
 * the lease), C8 (W's, after the last release).
 *
 * At each phase it prints "PHASE <name> <thread>=<tid>:<role> ..." and waits for a line on stdin,
 * so that the test reads the real masks from /proc/<pid>/task/<tid>/status in between. The
 * library's functions are looked up with dlsym, so the same binary also runs without it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "abi.h"
#include "named_threads.h"
#include "park.h"

static int quit;

static void park(void) { park_until(&lock, &changed, &quit); }

static void phase(const char *name) {
    pthread_mutex_lock(&lock);
    printf("PHASE %s", name);
    for (int i = 0; i < n_threads; i++)
        printf(" %s=%d:%d", threads[i].name, threads[i].tid,
               tllm_role ? tllm_role(threads[i].tid) : -1);
    printf("\n");
    fflush(stdout);
    pthread_mutex_unlock(&lock);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) exit(3);
}

static void *named(void *arg) {
    note((const char *)arg);
    if (strcmp((const char *)arg, "C1") == 0) {
        pthread_t g;
        pthread_create(&g, NULL, named, "G1");
    }
    park();
    return NULL;
}

static void spawn(const char *name) {
    pthread_t t;
    int count = n_threads;
    if (pthread_create(&t, NULL, named, (void *)name) != 0) exit(4);
    wait_for_count(count + 1 + (strcmp(name, "C1") == 0));
}

/* Work the main thread hands to W, so that configure and release run on the worker thread. */
static enum { IDLE, CONFIGURE, SPAWN, RELEASE, DONE } order;
static const char *order_arg;
static int64_t leases[4];
static int n_leases;
static pthread_cond_t order_cond = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t order_lock = PTHREAD_MUTEX_INITIALIZER;

static void ask_worker(int what, const char *arg) {
    pthread_mutex_lock(&order_lock);
    order = what;
    order_arg = arg;
    pthread_cond_broadcast(&order_cond);
    while (order != IDLE) pthread_cond_wait(&order_cond, &order_lock);
    pthread_mutex_unlock(&order_lock);
}

static int device;

static void *worker(void *unused) {
    (void)unused;
    note("W");
    pthread_mutex_lock(&order_lock);
    for (;;) {
        while (order == IDLE) pthread_cond_wait(&order_cond, &order_lock);
        if (order == DONE) {
            order = IDLE;
            pthread_cond_broadcast(&order_cond);
            break;
        }
        if (order == CONFIGURE) {
            int64_t lease = tllm_configure ? tllm_configure(device) : -1;
            fprintf(stderr, "configure -> %lld\n", (long long)lease);
            leases[n_leases++] = lease;
        } else if (order == SPAWN) {
            spawn(order_arg);
        } else if (order == RELEASE) {
            for (int i = 0; i < n_leases; i++) {
                int rc = tllm_release ? tllm_release(leases[i]) : -1;
                fprintf(stderr, "release %lld -> %d\n", (long long)leases[i], rc);
            }
            int again = tllm_release ? tllm_release(leases[0]) : -1;
            fprintf(stderr, "release again -> %d\n", again);
            n_leases = 0;
        }
        order = IDLE;
        pthread_cond_broadcast(&order_cond);
    }
    pthread_mutex_unlock(&order_lock);
    return NULL;
}

int main(int argc, char **argv) {
    device = argc > 1 ? atoi(argv[1]) : 0;
    tllm_abi_load();
    void *nccl = dlopen(getenv("FAKE_NCCL"), RTLD_NOW);
    if (!nccl) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 5; }
    void *(*progress)(void *) = (void *(*)(void *))dlsym(nccl, "fake_nccl_progress");
    void (*set_note)(void (*)(const char *)) = (void (*)(void (*)(const char *)))dlsym(nccl, "fake_nccl_set_note");
    set_note(note);

    note("main");
    spawn("H1");
    pthread_t w;
    int before_w = n_threads;
    pthread_create(&w, NULL, worker, NULL);
    wait_for_count(before_w + 1);
    for (int i = 1; i <= 6; i++) {
        static const char *names[] = {"", "C1", "C2", "C3", "C4", "C5", "C6"};
        ask_worker(SPAWN, names[i]);
    }
    pthread_t p1;
    int count = n_threads;
    pthread_create(&p1, NULL, progress, "P1");
    wait_for_count(count + 1);
    phase("before");

    ask_worker(CONFIGURE, NULL);
    phase("configured");

    ask_worker(SPAWN, "C7");
    spawn("H2");
    pthread_t p2;
    count = n_threads;
    pthread_create(&p2, NULL, progress, "P2");
    wait_for_count(count + 1);
    ask_worker(CONFIGURE, NULL);
    phase("configured-twice");

    ask_worker(RELEASE, NULL);
    phase("released");

    ask_worker(SPAWN, "C8");
    phase("after");

    raise_flag(&lock, &changed, &quit);
    ask_worker(DONE, NULL);
    return 0;
}
