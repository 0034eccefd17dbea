/* Thread births for deterministic counts (cachegrind instructions, strace system calls), nothing
 * else: no clock, no sorting, so the difference between two runs of N and 3N births is the cost
 * of 2N births and no more.
 *
 *   births nolease N          a host creates and joins N threads
 *   births lease N            the main thread configures, then creates and joins N (inherited)
 *   births apply N            a worker thread holds a lease; the host main thread starts N
 *                             threads whose routine is in $BENCH_WORK_LIB (a worker library):
 *                             each moves itself onto the worker mask (applied)
 *   births cycles N           64 parked threads (all asleep first); N configure + release cycles
 *                             of the main thread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *nothing(void *a) { return a; }

static int64_t (*configure)(int32_t);
static int32_t (*release)(int64_t);

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int state; /* 1: the lease holder configured; 2: it may release */

static void *lease_holder(void *a) {
    (void)a;
    int64_t lease = configure(0);
    pthread_mutex_lock(&m);
    state = lease > 0 ? 1 : -1;
    pthread_cond_broadcast(&c);
    while (state != 2) pthread_cond_wait(&c, &m);
    pthread_mutex_unlock(&m);
    release(lease);
    return NULL;
}

static pthread_cond_t all_parked = PTHREAD_COND_INITIALIZER;
static int parked_count;

static void *parked(void *a) {
    pthread_mutex_lock(&m);
    if (++parked_count == 64) pthread_cond_signal(&all_parked);
    while (state != 2) pthread_cond_wait(&c, &m);
    pthread_mutex_unlock(&m);
    return a;
}

static int create_join(int n, void *(*routine)(void *)) {
    for (int i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, routine, NULL)) return 1;
        pthread_join(t, NULL);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int n = atoi(argv[2]);
    const char *mode = argv[1];
    configure = (int64_t (*)(int32_t))dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    release = (int32_t (*)(int64_t))dlsym(RTLD_DEFAULT, "tllm_affinity_release");
    if (!strcmp(mode, "nolease")) return create_join(n, nothing);
    if (!configure || !release) return 3;
    if (!strcmp(mode, "lease")) return configure(0) > 0 ? create_join(n, nothing) : 4;
    if (!strcmp(mode, "apply")) {
        void *work = dlopen(getenv("BENCH_WORK_LIB"), RTLD_NOW);
        void *(*routine)(void *) = work ? (void *(*)(void *))dlsym(work, "bench_work_routine") : NULL;
        pthread_t holder;
        if (!routine || pthread_create(&holder, NULL, lease_holder, NULL)) return 5;
        pthread_mutex_lock(&m);
        while (state == 0) pthread_cond_wait(&c, &m);
        pthread_mutex_unlock(&m);
        int rc = state == 1 ? create_join(n, routine) : 4;
        pthread_mutex_lock(&m);
        state = 2;
        pthread_cond_broadcast(&c);
        pthread_mutex_unlock(&m);
        pthread_join(holder, NULL);
        return rc;
    }
    if (!strcmp(mode, "cycles")) {
        pthread_t pool[64];
        for (int i = 0; i < 64; i++)
            if (pthread_create(&pool[i], NULL, parked, NULL)) return 1;
        /* Every pool thread asleep before the first configure: none of them runs in between. */
        pthread_mutex_lock(&m);
        while (parked_count < 64) pthread_cond_wait(&all_parked, &m);
        pthread_mutex_unlock(&m);
        int rc = 0;
        for (int i = 0; i < n && !rc; i++) {
            int64_t lease = configure(0);
            rc = lease > 0 ? release(lease) : 4;
        }
        pthread_mutex_lock(&m);
        state = 2;
        pthread_cond_broadcast(&c);
        pthread_mutex_unlock(&m);
        for (int i = 0; i < 64; i++) pthread_join(pool[i], NULL);
        return rc;
    }
    return 2;
}
