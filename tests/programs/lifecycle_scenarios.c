/* Lifecycle rules of issue #2 and the faults of issue #7, one mode per scenario
 * (lifecycle_scenarios <mode> <arguments>):
 *
 *   explicit <cpu>      attr masks made by a worker during a lease (A1)
 *   observe <cpu>       the application's own setaffinity calls, and taskset -p (A2)
 *   exits               return, pthread_exit, cancellation, detached, tombstones (A3)
 *   createfail <n>      pthread_create failing on an impossible attr mask (A3, B2)
 *   nproc               pthread_create failing on RLIMIT_NPROC, as nobody (B2)
 *   fork                fork from a host and from a worker thread of a busy parent (A3)
 *   forkstorm <n>       n forks while other threads create threads (B2)
 *   dlopen <a> <b> <c>  dlopen of objects whose constructors start threads (A3)
 *   configure <device>  a worker configures, then releases (A4, A5)
 *   role                the roles and masks at load (A4)
 *   early               a thread started by another object's constructor (A3)
 *   exec <who>          exec from the main thread or from a worker, during a lease (B2)
 *   execed              what the exec'd image sees
 *   exit <status> [dev] configure(dev) when given, make a thread, exit(status) (B3)
 *   step                pin_step_thread(0), for the lock-file tests (B4)
 *
 * Output: PHASE lines (the test reads the kernel's masks, then answers on stdin), REPORT lines
 * (the library's JSON report) and free-form result lines checked by tests/lifecycle.rs.
 */
#include "agents.h"
#include "park.h"

#include <grp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

static int cpu_arg;

/* The one-CPU mask {cpu_arg} that the pinning tasks set. */
static cpu_set_t only_cpu_arg(void) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu_arg, &set);
    return set;
}

/* ---- explicit --------------------------------------------------------------------------- */

static agent_t *explicit_child;
static void task_spawn_explicit(agent_t *self, void *arg) {
    (void)self;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    cpu_set_t set = only_cpu_arg();
    pthread_attr_setaffinity_np(&attr, sizeof set, &set);
    int rc;
    explicit_child = agent_new_attr((const char *)arg, &attr, &rc);
    if (!explicit_child) {
        fprintf(stderr, "explicit create failed: %d\n", rc);
        exit(4);
    }
    pthread_attr_destroy(&attr);
}

static int mode_explicit(void) {
    note("main");
    agent_t *w = configured_agent("W", 0);
    spawn_from(w, "C");
    agent_do(w, task_spawn_explicit, "E");
    agent_t *e = explicit_child;
    spawn_from(e, "E1");
    phase("configured");
    lc_report("configured");
    agent_do(w, task_configure, (void *)0);
    spawn_from(e, "E2");
    spawn_from(w, "C2");
    phase("configured-twice");
    agent_do(w, task_release_all, NULL);
    spawn_from(e, "E3");
    phase("released");
    lc_report("released");
    agent_do(w, task_configure, (void *)0);
    phase("configured-again");
    agent_do(w, task_release_all, NULL);
    return 0;
}

/* ---- observe ---------------------------------------------------------------------------- */

static void task_pin_self(agent_t *self, void *arg) {
    (void)arg;
    cpu_set_t set = only_cpu_arg();
    int rc = sched_setaffinity(0, sizeof set, &set);
    lc_say("PINNED %s sched_setaffinity(0) -> %d", self->name, rc);
}

static void task_pin_other_pthread(agent_t *self, void *arg) {
    agent_t *other = arg;
    cpu_set_t set = only_cpu_arg();
    int rc = pthread_setaffinity_np(other->thread, sizeof set, &set);
    lc_say("PINNED %s pthread_setaffinity_np(%s) -> %d", self->name, other->name, rc);
}

static void task_pin_other_tid(agent_t *self, void *arg) {
    agent_t *other = arg;
    cpu_set_t set = only_cpu_arg();
    int rc = sched_setaffinity(other->tid, sizeof set, &set);
    lc_say("PINNED %s sched_setaffinity(%s) -> %d", self->name, other->name, rc);
}

static int mode_observe(void) {
    note("main");
    agent_t *w = configured_agent("W", 0);
    spawn_from(w, "C");
    agent_t *s1 = spawn_from(w, "S1");
    agent_t *s2 = spawn_from(w, "S2");
    agent_t *s3 = spawn_from(w, "S3");
    agent_t *s4 = spawn_from(w, "S4");
    (void)s3;
    agent_do(s1, task_pin_self, NULL);
    agent_do(w, task_pin_other_pthread, s2);
    agent_do(w, task_pin_other_tid, s4);
    phase("pinned");
    agent_do(w, task_configure, (void *)0);
    spawn_from(s1, "S1child");
    phase("configured-twice");
    /* the test runs taskset -p on S3 here */
    release_phase(w);
    lc_report("released");
    agent_do(w, task_configure, (void *)0);
    phase("configured-again");
    lc_report("configured-again");
    agent_do(w, task_release_all, NULL);
    return 0;
}

/* ---- exits ------------------------------------------------------------------------------ */

static void *by_return(void *arg) { return arg; }
static void *by_exit(void *arg) {
    pthread_exit(arg);
    return NULL;
}
static void *by_cancel(void *arg) {
    (void)arg;
    for (;;) {
        pthread_testcancel();
        usleep(1000);
    }
    return NULL;
}
static void *by_async_cancel(void *arg) {
    (void)arg;
    pthread_setcanceltype(PTHREAD_CANCEL_ASYNCHRONOUS, NULL);
    for (volatile unsigned long i = 0;; i++) {
    }
    return NULL;
}
static pthread_mutex_t park_m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t park_c = PTHREAD_COND_INITIALIZER;
static void unlock_park(void *m) { pthread_mutex_unlock(m); }
static void *by_cancel_in_wait(void *arg) {
    (void)arg;
    pthread_mutex_lock(&park_m);
    pthread_cleanup_push(unlock_park, &park_m);
    for (;;) pthread_cond_wait(&park_c, &park_m);
    pthread_cleanup_pop(1);
    return NULL;
}
static volatile int detached_done;
static void *detached(void *arg) {
    (void)arg;
    __sync_fetch_and_add(&detached_done, 1);
    return NULL;
}

/* A parent that starts a child and exits first: the child outlives it (a tombstone). */
static pthread_t orphan;
static volatile int orphan_go, orphan_started;
static void *orphan_main(void *arg) {
    (void)arg;
    note("orphan");
    orphan_started = 1;
    while (!orphan_go) usleep(1000);
    return NULL;
}
static void *short_parent(void *arg) {
    (void)arg;
    pthread_create(&orphan, NULL, orphan_main, NULL);
    return NULL;
}

static int churn_ways(const char *tag) {
    int ended = 0;
    void *(*ways[])(void *) = {by_return, by_exit, by_cancel, by_async_cancel, by_cancel_in_wait};
    for (int round = 0; round < 40; round++) {
        for (size_t k = 0; k < sizeof ways / sizeof ways[0]; k++) {
            pthread_t t;
            if (pthread_create(&t, NULL, ways[k], NULL) != 0) return -1;
            if (k >= 2) {
                usleep(200);
                pthread_cancel(t);
            }
            void *res;
            pthread_join(t, &res);
            if (k >= 2 && res != PTHREAD_CANCELED) {
                fprintf(stderr, "%s: thread %zu not cancelled\n", tag, k);
                return -1;
            }
            ended++;
        }
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t d;
        if (pthread_create(&d, &attr, detached, NULL) == 0) ended++;
        pthread_attr_destroy(&attr);
    }
    while (detached_done < 40) usleep(1000);
    return ended;
}

static void task_churn(agent_t *self, void *arg) {
    (void)arg;
    int n = churn_ways(self->name);
    lc_say("ENDED %s %d", self->name, n);
}

static void task_orphan(agent_t *self, void *arg) {
    (void)self;
    (void)arg;
    pthread_t p;
    pthread_create(&p, NULL, short_parent, NULL);
    pthread_join(p, NULL);
    while (!orphan_started) usleep(1000);
}

static int mode_exits(void) {
    note("main");
    lc_report("start");
    int n = churn_ways("main");
    lc_say("ENDED main %d", n);
    agent_t *w = configured_agent("W", 0);
    detached_done = 0;
    agent_do(w, task_churn, NULL);
    agent_do(w, task_orphan, NULL);
    lc_wait_tasks(3);
    phase("orphan-alive");
    lc_report("orphan-alive");
    orphan_go = 1;
    pthread_join(orphan, NULL);
    agent_do(w, task_release_all, NULL);
    agent_stop(w);
    lc_say("WAITED %d", lc_wait_tasks(1));
    phase("ended");
    lc_report("ended");
    return 0;
}

/* ---- createfail ------------------------------------------------------------------------- */

static void *never_runs(void *arg) {
    lc_say("ERROR the thread ran");
    return arg;
}

static int fail_loop(const char *who, int n) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(CPU_SETSIZE - 1, &set); /* a CPU no machine here has */
    pthread_attr_setaffinity_np(&attr, sizeof set, &set);
    int failures = 0, errno_kept = 0, first_rc = 0;
    for (int i = 0; i < n; i++) {
        pthread_t t;
        errno = 4242;
        int rc = pthread_create(&t, &attr, never_runs, NULL);
        if (rc == 0) {
            pthread_join(t, NULL);
            continue;
        }
        if (!first_rc) first_rc = rc;
        failures++;
        if (errno == 4242) errno_kept++;
    }
    pthread_attr_destroy(&attr);
    lc_say("CREATEFAIL %s rc=%d failures=%d errno_kept=%d", who, first_rc, failures, errno_kept);
    return failures;
}

static int fail_n;
static void task_fail(agent_t *self, void *arg) {
    (void)arg;
    fail_loop(self->name, fail_n);
}

static int mode_createfail(int n) {
    fail_n = n;
    note("main");
    lc_report("before");
    fail_loop("main", n);
    agent_t *w = configured_agent("W", 0);
    agent_do(w, task_fail, NULL);
    spawn_from(w, "C");
    phase("after");
    lc_report("after");
    agent_do(w, task_release_all, NULL);
    return 0;
}

/* ---- nproc ------------------------------------------------------------------------------ */

static int unpark, parked_count;
static void *parked(void *arg) {
    (void)arg;
    park_counted(&park_m, &park_c, &parked_count, &unpark);
    return NULL;
}

static int mode_nproc(void) {
    note("main");
    (void)configured_agent("W", 0);
    struct rlimit lim = {16, 16};
    if (setrlimit(RLIMIT_NPROC, &lim) != 0 || setgroups(0, NULL) != 0 || setresgid(65534, 65534, 65534) != 0 ||
        setresuid(65534, 65534, 65534) != 0) {
        lc_say("NPROC cannot drop privileges: %s", strerror(errno));
        return 6;
    }
    pthread_t threads[4096];
    int made = 0, rc = 0, errno_after = 0;
    for (; made < 4096; made++) {
        errno = 4242;
        rc = pthread_create(&threads[made], NULL, parked, NULL);
        errno_after = errno;
        if (rc != 0) break;
    }
    /* every thread made has started (and so registered) before anyone looks */
    pthread_mutex_lock(&park_m);
    while (parked_count < made) pthread_cond_wait(&park_c, &park_m);
    pthread_mutex_unlock(&park_m);
    lc_say("NPROC made=%d rc=%d errno=%d", made, rc, errno_after);
    phase("limited");
    lc_report("limited");
    raise_flag(&park_m, &park_c, &unpark);
    for (int i = 0; i < made; i++) pthread_join(threads[i], NULL);
    lc_wait_tasks(2);
    agent_t *late = agent_new("late");
    (void)late;
    phase("recovered");
    lc_report("recovered");
    return 0;
}

/* ---- fork ------------------------------------------------------------------------------- */

static void *child_thread(void *arg) {
    (void)arg;
    return (void *)(intptr_t)lc_role(0);
}

/* What a fork child checks: its report, a thread, a configure and a release. Prints one line. */
static int child_checks(const char *tag, int release_inherited) {
    char *json = lc_report_json();
    int threads = 0;
    for (char *p = json; (p = strstr(p, "\"tid\":")); p++) threads++;
    int my_role = lc_role(0);
    pthread_t t;
    void *role_of_thread = (void *)(intptr_t)-99;
    int rc = pthread_create(&t, NULL, child_thread, NULL);
    if (rc == 0) pthread_join(t, &role_of_thread);
    char before[64];
    lc_mask_of(0, before, sizeof before);
    int rel = -99;
    if (release_inherited) rel = lc_release(release_inherited);
    char restored[64];
    lc_mask_of(0, restored, sizeof restored);
    int64_t lease = lc_configure(0);
    char mask[64];
    lc_mask_of(0, mask, sizeof mask);
    int rel2 = lease > 0 ? lc_release(lease) : -99;
    char released[64];
    lc_mask_of(0, released, sizeof released);
    char *after = lc_report_json();
    int after_threads = 0;
    for (char *p = after; (p = strstr(p, "\"tid\":")); p++) after_threads++;
    lc_say("CHILD %s threads=%d role=%d thread_role=%ld mask_before=%s release_inherited=%d restored=%s "
           "lease=%lld mask=%s release=%d released_mask=%s threads_after=%d",
           tag, threads, my_role, (long)(intptr_t)role_of_thread, before, rel, restored, (long long)lease, mask,
           rel2, released, after_threads);
    lc_say("CHILDREPORT %s %s", tag, json);
    free(json);
    free(after);
    return 0;
}

static void fork_and_wait(const char *tag, int release_inherited) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20);
        child_checks(tag, release_inherited);
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    lc_say("FORKED %s status=%d", tag, status);
}

static void task_fork(agent_t *self, void *arg) {
    (void)arg;
    fork_and_wait(self->name, lc_n_leases ? (int)lc_leases[0] : 0);
}

static int mode_fork(void) {
    note("main");
    agent_t *h = agent_new("H");
    (void)h;
    agent_t *w = configured_agent("W", 0);
    spawn_from(w, "C1");
    spawn_from(w, "C2");
    fork_and_wait("main", 0);
    agent_do(w, task_fork, NULL);
    phase("parent");
    lc_report("parent");
    agent_do(w, task_release_all, NULL);
    return 0;
}

/* ---- forkstorm -------------------------------------------------------------------------- */

static volatile int storm_stop;
static volatile long storm_created;
static void *storm_leaf(void *arg) { return arg; }
static void *storm_creator(void *arg) {
    (void)arg;
    while (!storm_stop) {
        pthread_t t;
        if (pthread_create(&t, NULL, storm_leaf, NULL) == 0) {
            pthread_join(t, NULL);
            __sync_fetch_and_add(&storm_created, 1);
        }
    }
    return NULL;
}
static pthread_t storm_threads[2];
static void task_start_storm(agent_t *self, void *arg) {
    (void)self;
    (void)arg;
    pthread_create(&storm_threads[1], NULL, storm_creator, NULL);
}

static void *storm_configurer(void *arg) {
    (void)arg;
    while (!storm_stop) {
        int64_t lease = lc_configure(0);
        usleep(500);
        if (lease > 0) lc_release(lease);
    }
    return NULL;
}

static int mode_forkstorm(int n) {
    note("main");
    agent_t *w = configured_agent("W", 0);
    pthread_create(&storm_threads[0], NULL, storm_creator, NULL); /* a host creator */
    agent_do(w, task_start_storm, NULL);                         /* a worker creator */
    pthread_t conf;
    pthread_create(&conf, NULL, storm_configurer, NULL);
    int ok = 0, bad = 0;
    for (int i = 0; i < n; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            alarm(20);
            char *json = lc_report_json();
            int threads = 0;
            for (char *p = json; (p = strstr(p, "\"tid\":")); p++) threads++;
            char tidkey[64];
            snprintf(tidkey, sizeof tidkey, "\"tid\":%d,", (int)getpid());
            int me = strstr(json, tidkey) != NULL;
            pthread_t t;
            void *role = (void *)(intptr_t)-99;
            int rc = pthread_create(&t, NULL, child_thread, NULL);
            if (rc == 0) pthread_join(t, &role);
            int64_t lease = lc_configure(0);
            char mask[64];
            lc_mask_of(0, mask, sizeof mask);
            int rel = lease > 0 ? lc_release(lease) : -99;
            int good = threads == 1 && me && rc == 0 && (intptr_t)role == 0 && lease > 0 && rel == 0;
            if (!good)
                fprintf(stderr, "fork child %d: threads=%d me=%d rc=%d role=%ld lease=%lld mask=%s rel=%d\n%s\n", i,
                        threads, me, rc, (long)(intptr_t)role, (long long)lease, mask, rel, json);
            _exit(good ? 0 : 1);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
            ok++;
        else {
            bad++;
            fprintf(stderr, "fork child %d: status %d\n", i, status);
        }
    }
    storm_stop = 1;
    pthread_join(storm_threads[0], NULL);
    pthread_join(storm_threads[1], NULL);
    pthread_join(conf, NULL);
    lc_wait_tasks(2);
    lc_say("FORKSTORM forks=%d ok=%d bad=%d threads_created=%ld", n, ok, bad, storm_created);
    agent_do(w, task_release_all, NULL);
    agent_stop(w);
    phase("end");
    lc_report("end");
    return 0;
}

/* ---- dlopen ----------------------------------------------------------------------------- */

typedef int (*tids_fn)(pid_t *out, int max);

static void dlopen_and_note(const char *path, const char *prefix) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        lc_say("DLOPEN %s failed: %s", prefix, dlerror());
        exit(5);
    }
    tids_fn tids = (tids_fn)dlsym(h, "lc_dl_tids");
    pid_t out[8];
    int n = tids(out, 8);
    for (int i = 0; i < n; i++) {
        char name[24];
        snprintf(name, sizeof name, "%s%d", prefix, i);
        note_tid(name, out[i]);
    }
    lc_say("DLOPEN %s %d threads", prefix, n);
}

static const char *dl_paths[3];
static void task_dlopen(agent_t *self, void *arg) {
    (void)self;
    dlopen_and_note(dl_paths[0], (const char *)arg);
}

static int mode_dlopen(void) {
    note("main");
    agent_t *w = configured_agent("W", 0);
    agent_do(w, task_dlopen, "A");
    dlopen_and_note(dl_paths[1], "B");
    dlopen_and_note(dl_paths[2], "N");
    phase("loaded");
    lc_report("loaded");
    release_phase(w);
    return 0;
}

/* ---- configure / role ------------------------------------------------------------------- */

/* W configures `device` and makes C; the phase and report "configured", then W releases and the
 * phase "released" (the configure and early modes). */
static int configure_and_release(int device) {
    agent_t *w = configured_agent("W", device);
    spawn_from(w, "C");
    phase("configured");
    lc_report("configured");
    release_phase(w);
    return 0;
}

static int mode_configure(int device) {
    note("main");
    return configure_and_release(device);
}

static int mode_role(void) {
    note("main");
    lc_report("load");
    agent_t *t = agent_new("T");
    spawn_from(t, "T1");
    phase("running");
    lc_report("running");
    return 0;
}

/* ---- early: a thread started by another object's constructor -------------------------- */

static int mode_early(void) {
    note("main");
    pid_t (*early_tid)(void) = (pid_t (*)(void))dlsym(RTLD_DEFAULT, "lc_early_tid");
    if (!early_tid) {
        lc_say("EARLY no lc_early_tid: the object is not loaded");
        return 5;
    }
    note_tid("early", early_tid());
    lc_say("EARLY tid=%d role=%d", (int)early_tid(), lc_role(early_tid()));
    lc_report("load");
    return configure_and_release(0);
}

/* ---- exit: a plain program for the bad-input table -------------------------------------- */

static int mode_exit(int argc, char **argv) {
    int status = argc > 2 ? atoi(argv[2]) : 0;
    if (argc > 3) {
        int64_t lease = lc_configure(atoi(argv[3]));
        char mask[64];
        lc_mask_of(0, mask, sizeof mask);
        lc_say("CONFIGURE main %lld mask=%s", (long long)lease, mask);
    }
    pthread_t t;
    if (pthread_create(&t, NULL, by_return, NULL) == 0) pthread_join(t, NULL);
    lc_report("exit");
    exit(status);
}

/* ---- step: TLLM_AFFINITY_STEP_CORE's pin, for the lock-file tests -------------------------- */

static int mode_step(void) {
    int32_t (*pin)(int32_t) = (int32_t (*)(int32_t))dlsym(RTLD_DEFAULT, "tllm_affinity_pin_step_thread");
    int rc = pin ? pin(0) : -1;
    char mask[64];
    lc_mask_of(0, mask, sizeof mask);
    lc_say("STEP rc=%d mask=%s", rc, mask);
    return 0;
}

/* ---- exec ------------------------------------------------------------------------------- */

static char *self_path;
static void task_exec(agent_t *self, void *arg) {
    (void)self;
    (void)arg;
    fflush(stdout);
    execl(self_path, self_path, "execed", "worker", (char *)NULL);
    lc_say("EXEC failed: %s", strerror(errno));
    exit(7);
}

static int mode_exec(const char *who) {
    note("main");
    agent_t *w = configured_agent("W", 0);
    spawn_from(w, "C");
    phase("before-exec");
    lc_report("before-exec");
    if (strcmp(who, "worker") == 0) {
        agent_do(w, task_exec, NULL);
    }
    fflush(stdout);
    execl(self_path, self_path, "execed", "main", (char *)NULL);
    lc_say("EXEC failed: %s", strerror(errno));
    return 7;
}

static int mode_execed(const char *who) {
    note("main");
    char mask[64];
    lc_mask_of(0, mask, sizeof mask);
    lc_say("EXECED from=%s pid=%d role=%d mask=%s", who, (int)getpid(), lc_role(0), mask);
    lc_report("execed");
    agent_t *t = agent_new("T");
    (void)t;
    phase("execed");
    return 0;
}

int main(int argc, char **argv) {
    lc_init();
    static char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) exe[n] = 0;
    self_path = exe;
    const char *mode = argc > 1 ? argv[1] : "";
    if (argc > 2) cpu_arg = atoi(argv[2]);
    if (!strcmp(mode, "explicit")) return mode_explicit();
    if (!strcmp(mode, "observe")) return mode_observe();
    if (!strcmp(mode, "exits")) return mode_exits();
    if (!strcmp(mode, "createfail")) return mode_createfail(argc > 2 ? atoi(argv[2]) : 100);
    if (!strcmp(mode, "nproc")) return mode_nproc();
    if (!strcmp(mode, "fork")) return mode_fork();
    if (!strcmp(mode, "forkstorm")) return mode_forkstorm(argc > 2 ? atoi(argv[2]) : 100);
    if (!strcmp(mode, "dlopen") && argc > 4) {
        dl_paths[0] = argv[2];
        dl_paths[1] = argv[3];
        dl_paths[2] = argv[4];
        return mode_dlopen();
    }
    if (!strcmp(mode, "configure")) return mode_configure(argc > 2 ? atoi(argv[2]) : 0);
    if (!strcmp(mode, "role")) return mode_role();
    if (!strcmp(mode, "early")) return mode_early();
    if (!strcmp(mode, "exit")) return mode_exit(argc, argv);
    if (!strcmp(mode, "step")) return mode_step();
    if (!strcmp(mode, "exec")) return mode_exec(argc > 2 ? argv[2] : "main");
    if (!strcmp(mode, "execed")) return mode_execed(argc > 2 ? argv[2] : "?");
    fprintf(stderr, "usage: lifecycle_scenarios <mode> ...\n");
    return 64;
}
