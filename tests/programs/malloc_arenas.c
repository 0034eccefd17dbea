/* Threads the library starts allocate nothing (issue 6). A malloc or free in a new thread makes
 * glibc build that thread's malloc cache and attach it to an arena, a new one while there are
 * fewer than 8 per CPU: memory a bare thread that never allocates does not have. This program
 * counts the arenas (malloc_info's heaps) before and while K children of each path are alive:
 * a host's children, a worker's children under a lease (inherited path), and a host's children
 * whose routine lives in a worker library (apply path: each moves itself onto the worker mask).
 *
 * Prints "ARENAS <before> <during>", then "CHILD <path> <role> <cpulist>" for each child.
 * Usage: malloc_arenas <path of libnccl_routine.so.2>
 */
#include "agents.h"
#include <malloc.h>

#define K 12

static pthread_barrier_t parked, leave, worker_ready, worker_go;
static int tids[3 * K];
static pthread_t children[3 * K];
static struct lc_closure in_lib_closures[K];

static void *park(void *index) {
    tids[(intptr_t)index] = (int)lc_tid();
    pthread_barrier_wait(&parked);
    pthread_barrier_wait(&leave);
    return NULL;
}

static int count_arenas(void) {
    char *xml = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&xml, &len);
    malloc_info(0, f);
    fclose(f);
    int n = 0;
    for (char *p = xml; (p = strstr(p, "<heap nr=")); p++) n++;
    free(xml);
    return n;
}

static void *nothing(void *arg) { return arg; }

static int64_t lease = -1;
static void *worker(void *unused) {
    (void)unused;
    lease = lc_configure(0);
    /* glibc's pthread_create allocates the new thread's TLS vector in the creator: one thread
     * made and joined here gives this creator its arena with or without the library. */
    pthread_t first;
    if (pthread_create(&first, NULL, nothing, NULL)) abort();
    pthread_join(first, NULL);
    pthread_barrier_wait(&worker_ready);
    pthread_barrier_wait(&worker_go);
    for (intptr_t i = K; i < 2 * K; i++)
        if (pthread_create(&children[i], NULL, park, (void *)i)) abort();
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    lc_init();
    void *(*in_lib)(void *) = lc_worker_lib_routine(argv[1]);
    pthread_barrier_init(&parked, NULL, 3 * K + 1);
    pthread_barrier_init(&leave, NULL, 3 * K + 1);
    pthread_barrier_init(&worker_ready, NULL, 2);
    pthread_barrier_init(&worker_go, NULL, 2);
    for (intptr_t i = 0; i < K; i++) in_lib_closures[i] = (struct lc_closure){park, (void *)(2 * K + i)};

    pthread_t w;
    if (pthread_create(&w, NULL, worker, NULL)) abort();
    pthread_barrier_wait(&worker_ready);
    int before = count_arenas();
    pthread_barrier_wait(&worker_go);
    for (intptr_t i = 0; i < K; i++)
        if (pthread_create(&children[i], NULL, park, (void *)i)) abort();
    for (int i = 0; i < K; i++)
        if (pthread_create(&children[2 * K + i], NULL, in_lib, &in_lib_closures[i])) abort();
    pthread_barrier_wait(&parked);
    int during = count_arenas();

    printf("ARENAS %d %d\n", before, during);
    const char *paths[3] = {"host", "inherited", "apply"};
    for (int i = 0; i < 3 * K; i++) {
        char mask[64];
        lc_mask_of(tids[i], mask, sizeof mask);
        printf("CHILD %s %d %s\n", paths[i / K], lc_role(tids[i]), mask);
    }
    fflush(stdout);
    pthread_barrier_wait(&leave);
    pthread_join(w, NULL);
    for (int i = 0; i < 3 * K; i++) pthread_join(children[i], NULL);
    if (lease > 0) lc_release(lease);
    return 0;
}
