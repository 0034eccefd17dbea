/* An Open MPI rank for tests/mpi.rs, linked with libmpi (mpicc), so that Open MPI's own
 * progress threads exist: MPI_Init starts them (Open MPI 4.1: one from libopen-pal, the opal
 * async progress thread, one from libpmix, the PMIx client's progress thread).
 *
 * Usage: mpi_rank MODE, MODE one of
 *   dedicated  every rank is a worker process (TLLM_AFFINITY_PROCESS_ROLE=worker, configured at
 *              load): main, the progress threads and an "engine" thread main starts after
 *              MPI_Init; one phase, "running";
 *   leader     rank 0 is the multi-node leader: its main thread (host) calls MPI_Init, starts a
 *              "session" server thread (host) and a two-thread pool; rank 0's worker runs on
 *              pool0, which configures (-1: the local rank's GPU) and starts an "engine" thread;
 *              phases "configured", then "released" after pool0 releases. Other ranks run as in
 *              dedicated mode.
 *
 * At each phase a rank prints one line on stdout (forwarded by mpirun)
 *   PHASE <phase> rank=<r> pid=<pid> load=<mask at load> constrained=<bool> <thread>=<tid>:<role> ...
 * where the mask at load and "constrained" come from the library's report, then waits until the
 * file <RT_GO_DIR>/<phase> exists (or <RT_GO_DIR>/quit: exit 3; 30 s: exit 4), while the test
 * reads /proc/<pid>/task/<tid>/status. Progress threads are noted as mpi1, mpi2, ... in tid
 * order: the threads MPI_Init started, found by listing /proc/self/task before and after. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <mpi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "abi.h"
#include "named_threads.h"
#include "park.h"

static int quit;
static int rank;

static void *parked(void *name) {
    note((const char *)name);
    park_until(&lock, &changed, &quit);
    return NULL;
}

static pthread_t start(const char *name) {
    pthread_t t;
    int count = n_threads;
    if (pthread_create(&t, NULL, parked, (void *)name) != 0) exit(5);
    wait_for_count(count + 1);
    return t;
}

/* The tids of this process, from the kernel. */
static int list_tasks(pid_t *out, int max) {
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    struct dirent *e;
    if (!d) exit(6);
    while ((e = readdir(d)) && n < max)
        if (e->d_name[0] != '.') out[n++] = (pid_t)atoi(e->d_name);
    closedir(d);
    return n;
}

static int cmp_tid(const void *a, const void *b) { return *(const pid_t *)a - *(const pid_t *)b; }

/* MPI_Init_thread, noting the threads it started as mpi1, mpi2, ... */
static void mpi_init(int *argc, char ***argv) {
    pid_t before[MAX_THREADS], after[MAX_THREADS], fresh[MAX_THREADS];
    int nb = list_tasks(before, MAX_THREADS), provided, nf = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    int na = list_tasks(after, MAX_THREADS);
    for (int i = 0; i < na; i++) {
        int old = 0;
        for (int j = 0; j < nb; j++) old |= after[i] == before[j];
        if (!old) fresh[nf++] = after[i];
    }
    qsort(fresh, nf, sizeof fresh[0], cmp_tid);
    for (int i = 0; i < nf; i++) {
        char name[16];
        snprintf(name, sizeof name, "mpi%d", i + 1);
        note_tid(name, fresh[i]);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
}

/* The value of a string (or literal) field of the library's JSON report. */
static void report_field(const char *field, char *out, size_t len) {
    snprintf(out, len, "none");
    if (!tllm_report) return;
    static char buf[1 << 16];
    if (tllm_report(buf, sizeof buf) >= (int64_t)sizeof buf) return;
    char key[64];
    snprintf(key, sizeof key, "\"%s\":", field);
    char *p = strstr(buf, key);
    if (!p) return;
    p += strlen(key);
    while (*p == ' ') p++;
    if (*p == '"') p++;
    size_t n = strcspn(p, "\",}");
    if (n >= len) n = len - 1;
    memcpy(out, p, n);
    out[n] = 0;
}

static void wait_go(const char *phase_name) {
    const char *dir = getenv("RT_GO_DIR");
    char go[4096], stop[4096];
    snprintf(go, sizeof go, "%s/%s", dir ? dir : ".", phase_name);
    snprintf(stop, sizeof stop, "%s/quit", dir ? dir : ".");
    for (int i = 0; i < 15000; i++) {
        if (access(go, F_OK) == 0) return;
        if (access(stop, F_OK) == 0) exit(3);
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    exit(4);
}

static void phase(const char *name) {
    char load[256], constrained[16];
    report_field("mask_at_load", load, sizeof load);
    report_field("constrained", constrained, sizeof constrained);
    pthread_mutex_lock(&lock);
    char line[8192];
    int n = snprintf(line, sizeof line, "PHASE %s rank=%d pid=%d load=%s constrained=%s", name,
                     rank, getpid(), load, constrained);
    for (int i = 0; i < n_threads && n < (int)sizeof line - 64; i++)
        n += snprintf(line + n, sizeof line - n, " %s=%d:%d", threads[i].name, threads[i].tid,
                      tllm_role ? tllm_role(threads[i].tid) : -1);
    pthread_mutex_unlock(&lock);
    printf("%s\n", line);
    fflush(stdout);
    wait_go(name);
}

/* Rank 0's worker, on the session's pool: configure, start an engine thread, then release when
 * main asks. */
static enum { IDLE, CONFIGURE, RELEASE, DONE } order;
static pthread_mutex_t order_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t order_cond = PTHREAD_COND_INITIALIZER;

static void ask_worker(int what) {
    pthread_mutex_lock(&order_lock);
    order = what;
    pthread_cond_broadcast(&order_cond);
    while (order != IDLE) pthread_cond_wait(&order_cond, &order_lock);
    pthread_mutex_unlock(&order_lock);
}

static void *worker_main(void *unused) {
    (void)unused;
    note("pool0");
    int64_t lease = 0;
    pthread_mutex_lock(&order_lock);
    for (;;) {
        while (order == IDLE) pthread_cond_wait(&order_cond, &order_lock);
        int what = order;
        if (what == CONFIGURE) {
            lease = tllm_configure ? tllm_configure(-1) : -1;
            fprintf(stderr, "rank %d: configure(-1) -> %lld\n", rank, (long long)lease);
            start("engine");
        } else if (what == RELEASE) {
            int rc = tllm_release ? tllm_release(lease) : -1;
            fprintf(stderr, "rank %d: release -> %d\n", rank, rc);
        }
        order = IDLE;
        pthread_cond_broadcast(&order_cond);
        if (what == DONE) break;
    }
    pthread_mutex_unlock(&order_lock);
    return NULL;
}

int main(int argc, char **argv) {
    tllm_abi_load();
    const char *mode = argc > 1 ? argv[1] : "dedicated";

    note("main");
    mpi_init(&argc, &argv);
    int leader = strcmp(mode, "leader") == 0 && rank == 0;
    pthread_t engine, session, pool0, pool1;
    if (!leader) {
        engine = start("engine");
        phase("running");
    } else {
        session = start("session");
        int count = n_threads;
        pthread_create(&pool0, NULL, worker_main, NULL);
        wait_for_count(count + 1);
        pool1 = start("pool1");
        ask_worker(CONFIGURE);
        phase("configured");
        ask_worker(RELEASE);
        phase("released");
        ask_worker(DONE);
        pthread_join(pool0, NULL);
    }
    int sum = 0, one = 1;
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    raise_flag(&lock, &changed, &quit);
    if (!leader) {
        pthread_join(engine, NULL);
    } else {
        pthread_join(session, NULL);
        pthread_join(pool1, NULL);
    }
    int size;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (sum != size) return 7;
    MPI_Finalize();
    return 0;
}
