/* A worker's pool thread pins itself to exactly the worker set, as onnxruntime pins its own
 * intra-op threads, and nothing else touches the library until the test has looked with
 * `tllm-affinity ps` (no role or report call: those would take the pin in on their way).
 * Prints "PINNED tid=<tid>", waits for a line, releases, prints "REPORT released <json>", waits
 * for another line (the test reads the pool thread's mask), then ends. */
#include "agents.h"
#include "park.h"

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int done;

static void *pool_thread(void *arg) {
    cpu_set_t *worker_set = arg;
    pthread_setaffinity_np(pthread_self(), sizeof *worker_set, worker_set);
    lc_say("PINNED tid=%d", lc_tid());
    park_until(&m, &c, &done);
    return NULL;
}

int main(void) {
    lc_init();
    int64_t lease = lc_configure(0);
    cpu_set_t worker_set;
    sched_getaffinity(0, sizeof worker_set, &worker_set);
    pthread_t t;
    if (lease <= 0 || pthread_create(&t, NULL, pool_thread, &worker_set) != 0) return 1;
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 3;
    lc_release(lease);
    lc_report("released");
    if (!fgets(line, sizeof line, stdin)) return 3;
    raise_flag(&m, &c, &done);
    pthread_join(t, NULL);
    return 0;
}
