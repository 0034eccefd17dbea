/* The population tests/fault_injection.rs runs with one system call failing (or a resource run
 * out), with and without the library: its stdout must be the same either way.
 *
 *   fault_population [CHILDREN]     (default 4)
 *
 * Threads: the main thread; H, a host thread; W, a worker that calls tllm_affinity_configure(0),
 * then creates CHILDREN children one after another, each computing a checksum and staying alive
 * until all are made (so CHILDREN threads live at once); W takes the report, releases, and the
 * main thread joins everyone. Every failure the program meets (a thread not created, a join) is
 * printed with its errno and the program goes on, as a server that survives it would; only what
 * it computed and what failed goes to stdout, never a mask, a lease or a tid (those differ with
 * the library by design). What the library answered goes to stderr, without the library's
 * "[tllm-affinity]" prefix, for the reader of a failure. The library's functions are looked up
 * with dlsym, so the same binary runs without it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "abi.h"
#include "park.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int quit, started;

static uint64_t checksum(uint64_t seed) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int i = 0; i < 1000; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
    return x >> 33;
}

struct child { pthread_t thread; int made; uint64_t seed, sum; };

static void *child(void *arg) {
    struct child *c = arg;
    c->sum = checksum(c->seed);
    park_counted(&lock, &changed, &started, &quit);
    return NULL;
}

static void *host(void *arg) {
    *(uint64_t *)arg = checksum(7);
    park_until(&lock, &changed, &quit);
    return NULL;
}

struct work { int children, made, failed, first_error; struct child *kids; };

static void *worker(void *arg) {
    struct work *w = arg;
    int64_t lease = tllm_configure ? tllm_configure(0) : 0;
    fprintf(stderr, "population: configure -> %lld\n", (long long)lease);
    for (int i = 0; i < w->children; i++) {
        struct child *c = &w->kids[i];
        c->seed = (uint64_t)i + 1;
        int rc = pthread_create(&c->thread, NULL, child, c);
        c->made = rc == 0;
        if (rc == 0) {
            w->made++;
            /* One at a time, so a limit on tasks stops the same child in every run. */
            wait_count(&lock, &changed, &started, w->made);
        } else {
            if (!w->failed++) w->first_error = rc;
        }
    }
    if (tllm_report) {
        char buf[256];
        fprintf(stderr, "population: report -> %lld bytes\n", (long long)tllm_report(buf, sizeof buf));
    }
    if (lease > 0 && tllm_release)
        fprintf(stderr, "population: release -> %d\n", tllm_release(lease));
    return NULL;
}

static void made(const char *who, int rc) {
    if (rc) printf("%s: not created: %s\n", who, strerrorname_np(rc) ? strerrorname_np(rc) : "?");
    else printf("%s: created\n", who);
}

int main(int argc, char **argv) {
    struct work w = {.children = argc > 1 ? atoi(argv[1]) : 4};
    w.kids = calloc((size_t)w.children, sizeof *w.kids);
    if (!w.kids) {
        printf("no memory for %d children\n", w.children);
        return 0;
    }
    tllm_abi_load();
    uint64_t host_sum = 0;
    pthread_t h, wt;
    int h_rc = pthread_create(&h, NULL, host, &host_sum);
    made("host", h_rc);
    int w_rc = pthread_create(&wt, NULL, worker, &w);
    made("worker", w_rc);
    if (w_rc == 0) {
        int rc = pthread_join(wt, NULL);
        if (rc) printf("worker: join: %s\n", strerrorname_np(rc));
        printf("children: %d created, %d not", w.made, w.failed);
        if (w.failed) printf(" (first: %s)", strerrorname_np(w.first_error));
        printf("\n");
    }
    raise_flag(&lock, &changed, &quit);
    uint64_t sum = 0;
    int joined = 0;
    for (int i = 0; i < w.children; i++) {
        if (!w.kids[i].made) continue;
        int rc = pthread_join(w.kids[i].thread, NULL);
        if (rc) printf("child %d: join: %s\n", i, strerrorname_np(rc));
        else joined++;
        sum += w.kids[i].sum;
    }
    if (h_rc == 0) {
        int rc = pthread_join(h, NULL);
        if (rc) printf("host: join: %s\n", strerrorname_np(rc));
        printf("host: sum %llu\n", (unsigned long long)host_sum);
    }
    printf("children: %d joined, sum %llu\n", joined, (unsigned long long)sum);
    printf("done\n");
    return 0;
}
