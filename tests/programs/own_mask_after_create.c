/* A worker that sets its own mask right after pthread_create returned, while its child may not
 * have registered yet.
 *
 * Each round: a fresh thread configures (a worker, on the worker mask), creates a child that
 * parks, and at once moves itself onto <other cpu> with sched_setaffinity. The kernel copied the
 * worker mask into the child at the clone, before that set, so the child is the library's worker
 * on the library's mask, whenever it registers; the worker then releases its lease (the last),
 * which must put the child back on its natural mask, the launch mask. The worker mask being one
 * CPU, the worker usually runs on after the clone and sets its mask before the child has run at
 * all: the order that used to leave the child on the worker mask for good.
 *
 *   own_mask_after_create <rounds> <other cpu>
 *
 * Prints "ROUND <r> role=<child's role> mask=<child's mask after the release>
 * raced=<0|1>" per round, raced=1 when the worker was already off the worker mask when its
 * child's routine began (the child registered after the set, or just before it). Then "DONE".
 */
#include "agents.h"
#include "park.h"

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int other_cpu, leave, parked_count;
static pid_t worker_tid, child_tid;
static char worker_mask_at_child_start[64], worker_mask_at_create[64];

static void *child(void *unused) {
    (void)unused;
    char seen[64];
    lc_mask_of(worker_tid, seen, sizeof seen);
    pthread_mutex_lock(&m);
    memcpy(worker_mask_at_child_start, seen, sizeof seen);
    child_tid = lc_tid();
    pthread_cond_broadcast(&c);
    pthread_mutex_unlock(&m);
    park_counted(&m, &c, &parked_count, &leave);
    return NULL;
}

static void *worker(void *unused) {
    (void)unused;
    int64_t lease = lc_configure(0);
    if (lease <= 0) {
        lc_say("NOLEASE %lld", (long long)lease);
        exit(3);
    }
    worker_tid = lc_tid();
    lc_mask_of(worker_tid, worker_mask_at_create, sizeof worker_mask_at_create);
    pthread_t t;
    if (pthread_create(&t, NULL, child, NULL)) abort();
    pthread_detach(t);
    cpu_set_t own;
    CPU_ZERO(&own);
    CPU_SET(other_cpu, &own);
    if (sched_setaffinity(0, sizeof own, &own)) abort();
    pthread_mutex_lock(&m);
    while (!child_tid) pthread_cond_wait(&c, &m);
    pthread_mutex_unlock(&m);
    lc_release(lease);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    lc_init();
    int rounds = atoi(argv[1]);
    other_cpu = atoi(argv[2]);
    for (int r = 0; r < rounds; r++) {
        child_tid = 0;
        pthread_t w;
        if (pthread_create(&w, NULL, worker, NULL)) abort();
        pthread_join(w, NULL);
        char mask[64];
        lc_mask_of(child_tid, mask, sizeof mask);
        lc_say("ROUND %d role=%d mask=%s raced=%d", r, lc_role(child_tid), mask,
               strcmp(worker_mask_at_child_start, worker_mask_at_create) != 0);
    }
    raise_flag(&m, &c, &leave);
    lc_say("DONE");
    return 0;
}
