/* A thread that moves itself onto the worker mask while a release sweeps the process.
 *
 * A host thread starting a worker-library routine plans the child's move under the registry
 * lock; the child makes the move itself before it takes the lock (the move can migrate it), then
 * registers. Here the host starts such a child and at once releases the only lease, whose sweep
 * over <parked> worker threads holds the lock for milliseconds: the child moves onto the worker
 * mask, waits, and registers after the release. It must be born as if after the release: back on
 * the host mask, where nothing would ever restore it from otherwise.
 *
 *   birth_during_release <worker library> <rounds> <parked workers>
 *
 * Prints "ROUND <r> tid=<tid> role=<role> mask=<list> raced=<0|1>" per round, where raced=1 says
 * the child registered after the release began: its routine started on the host mask, where only
 * a registration that saw no lease puts a worker-library thread (one that registered during the
 * lease starts on the worker mask, and the release moves it back later). Then "DONE".
 */
#include "agents.h"
#include "park.h"

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int parked_count, leave, child_leave;
static pid_t child_tid;
static char child_start_mask[64];

static void *parked(void *unused) {
    (void)unused;
    park_counted(&m, &c, &parked_count, &leave);
    return NULL;
}

static void *raced_child(void *unused) {
    (void)unused;
    char start_mask[64];
    lc_mask_of(lc_tid(), start_mask, sizeof start_mask);
    pthread_mutex_lock(&m);
    memcpy(child_start_mask, start_mask, sizeof start_mask);
    child_tid = lc_tid();
    pthread_cond_broadcast(&c);
    while (!child_leave) pthread_cond_wait(&c, &m);
    pthread_mutex_unlock(&m);
    return NULL;
}

/* The configurer owns the parked workers (its descendants), so every configure sweeps them. */
static int parked_target;
static pthread_t *parked_threads;
static int64_t lease;
static int want_lease, lease_ready, quit;

static void *configurer(void *unused) {
    (void)unused;
    for (int i = 0; i < parked_target; i++)
        if (pthread_create(&parked_threads[i], NULL, parked, NULL)) abort();
    pthread_mutex_lock(&m);
    while (parked_count < parked_target) pthread_cond_wait(&c, &m);
    for (;;) {
        while (!want_lease && !quit) pthread_cond_wait(&c, &m);
        if (quit) break;
        pthread_mutex_unlock(&m);
        int64_t l = lc_configure(0);
        pthread_mutex_lock(&m);
        lease = l;
        want_lease = 0;
        lease_ready = 1;
        pthread_cond_broadcast(&c);
    }
    pthread_mutex_unlock(&m);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) return 64;
    lc_init();
    void *(*in_lib)(void *) = lc_worker_lib_routine(argv[1]);
    int rounds = atoi(argv[2]);
    parked_target = atoi(argv[3]);
    parked_threads = calloc((size_t)parked_target, sizeof *parked_threads);
    struct lc_closure closure = {raced_child, NULL};
    char host_mask[64];
    lc_mask_of(lc_tid(), host_mask, sizeof host_mask);
    pthread_t conf;
    if (pthread_create(&conf, NULL, configurer, NULL)) abort();
    for (int r = 0; r < rounds; r++) {
        pthread_mutex_lock(&m);
        want_lease = 1;
        lease_ready = 0;
        child_tid = 0;
        child_leave = 0;
        pthread_cond_broadcast(&c);
        while (!lease_ready) pthread_cond_wait(&c, &m);
        int64_t l = lease;
        pthread_mutex_unlock(&m);

        pthread_t child;
        if (pthread_create(&child, NULL, in_lib, &closure)) abort();
        lc_release(l);

        pthread_mutex_lock(&m);
        while (!child_tid) pthread_cond_wait(&c, &m);
        pid_t tid = child_tid;
        int raced = !strcmp(child_start_mask, host_mask);
        pthread_mutex_unlock(&m);
        char mask[64];
        lc_mask_of(tid, mask, sizeof mask);
        printf("ROUND %d tid=%d role=%d mask=%s raced=%d\n", r, (int)tid, lc_role(tid), mask, raced);
        fflush(stdout);

        pthread_mutex_lock(&m);
        child_leave = 1;
        pthread_cond_broadcast(&c);
        pthread_mutex_unlock(&m);
        pthread_join(child, NULL);
    }
    pthread_mutex_lock(&m);
    quit = 1;
    leave = 1;
    pthread_cond_broadcast(&c);
    pthread_mutex_unlock(&m);
    pthread_join(conf, NULL);
    for (int i = 0; i < parked_target; i++) pthread_join(parked_threads[i], NULL);
    printf("DONE\n");
    return 0;
}
