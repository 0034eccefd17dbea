/* Bounded stress for issue #7: thread churn, configure/release loops and the application's own
 * setaffinity calls, all at once, with invariants checked by the threads themselves.
 *
 *   churn_stress <threads to churn> <seconds at most> <worker mask> <host mask> <worker library>
 *
 * Threads:
 * - 2 host checkers (started by main before any lease, so hosts on <host mask>): each step makes
 *   a host child that checks its own mask and role, joins it, then checks its own mask and role;
 *   every 64th step it also calls sched_setaffinity(0, <host mask>) on itself, as applications do;
 * - 2 host creators (main's): make and join batches of host children that check their mask/role;
 * - 2 configurers: configure(0), check their own mask is the worker mask while the lease is open,
 *   release; two of them, so leases overlap (only the last release restores);
 * - 2 worker creators (started by a configurer during its first lease, so workers): make and join
 *   batches of worker children; every 16th child pins itself with sched_setaffinity to a CPU of
 *   the host mask outside the worker mask and checks that the pin held; every 32nd child makes a
 *   grandchild.
 * - 2 apply creators (main's, so hosts): make and join batches of children whose routine lives in
 *   the worker library (worker_library_routine.c), so each is a worker that moves itself onto the
 *   worker mask when a lease is open at its birth: each checks it is a worker on the worker or the host
 *   mask. Every 64th batch also leaves one such child parked until the end (at most 32): born
 *   across configures and releases, after the last release every one must be back on the host
 *   mask, on the worker mask under one more configure, and on the host mask after its release.
 * Violations are counted and the first few printed. At the end everything is joined and the
 * program prints "STRESS ..." with its figures, then "PHASE end" (the test reads /proc), then the
 * report.
 */
#include "agents.h"

static cpu_set_t host_set, worker_set, pin_set;
static volatile int stop;
static long target_threads;
static long churned, cycles, app_pins, host_checks, grandchildren;
static long violations, pin_violations, worker_violations, create_failures, applied;
static void *(*in_worker_lib)(void *);

#define BUMP(x) __atomic_add_fetch(&(x), 1, __ATOMIC_RELAXED)

/* Whether thread `tid`'s mask (0: the caller's) is `want`; one read, so a concurrent change
 * cannot make two comparisons see two masks. */
static int mask_is_one_of(pid_t tid, const cpu_set_t *want, const cpu_set_t *or_this) {
    cpu_set_t now;
    CPU_ZERO(&now);
    if (syscall(SYS_sched_getaffinity, tid, sizeof now, &now) < 0) return 0;
    return CPU_EQUAL(&now, want) || (or_this && CPU_EQUAL(&now, or_this));
}

static int my_mask_is(const cpu_set_t *want) { return mask_is_one_of(0, want, NULL); }

static void violation(long *counter, const char *what) {
    long n = BUMP(*counter);
    if (n <= 5) {
        char mask[64];
        lc_mask_of(0, mask, sizeof mask);
        fprintf(stderr, "VIOLATION %s: thread %d role %d mask %s\n", what, (int)lc_tid(), lc_role(0), mask);
    }
}

static void check_host(const char *who) {
    BUMP(host_checks);
    if (!my_mask_is(&host_set)) violation(&violations, who);
    if (lc_role(0) != 0) violation(&violations, who);
}

static void *host_child(void *arg) {
    (void)arg;
    check_host("host child");
    BUMP(churned);
    return NULL;
}

static void *host_checker(void *arg) {
    (void)arg;
    for (long step = 0; !stop; step++) {
        pthread_t t;
        if (pthread_create(&t, NULL, host_child, NULL) == 0)
            pthread_join(t, NULL);
        else
            BUMP(create_failures);
        if (step % 64 == 0) {
            if (sched_setaffinity(0, sizeof host_set, &host_set) != 0) violation(&violations, "host pin");
            BUMP(app_pins);
        }
        check_host("host checker");
    }
    return NULL;
}

#define BATCH 8

static void *host_creator(void *arg) {
    (void)arg;
    while (!stop && __atomic_load_n(&churned, __ATOMIC_RELAXED) < target_threads) {
        pthread_t t[BATCH];
        int made = 0;
        for (int i = 0; i < BATCH; i++) {
            if (pthread_create(&t[made], NULL, host_child, NULL) == 0)
                made++;
            else
                BUMP(create_failures);
        }
        for (int i = 0; i < made; i++) pthread_join(t[i], NULL);
        check_host("host creator");
    }
    return NULL;
}

static void *grandchild(void *arg) {
    (void)arg;
    if (lc_role(0) != 1) violation(&worker_violations, "grandchild role");
    BUMP(grandchildren);
    BUMP(churned);
    return NULL;
}

static void *worker_child(void *arg) {
    long n = (long)arg;
    if (lc_role(0) != 1) violation(&worker_violations, "worker child role");
    if (n % 16 == 0) {
        /* the application pins this worker itself: the pin must hold */
        if (sched_setaffinity(0, sizeof pin_set, &pin_set) != 0) violation(&pin_violations, "pin call");
        BUMP(app_pins);
        sched_yield();
        if (!my_mask_is(&pin_set)) violation(&pin_violations, "application pin overridden");
    }
    if (n % 32 == 0) {
        pthread_t g;
        if (pthread_create(&g, NULL, grandchild, NULL) == 0)
            pthread_join(g, NULL);
        else
            BUMP(create_failures);
    }
    BUMP(churned);
    return NULL;
}

static void *worker_creator(void *arg) {
    (void)arg;
    long n = 0;
    while (!stop && __atomic_load_n(&churned, __ATOMIC_RELAXED) < target_threads) {
        pthread_t t[BATCH];
        int made = 0;
        for (int i = 0; i < BATCH; i++) {
            if (pthread_create(&t[made], NULL, worker_child, (void *)n++) == 0)
                made++;
            else
                BUMP(create_failures);
        }
        for (int i = 0; i < made; i++) pthread_join(t[i], NULL);
        if (lc_role(0) != 1) violation(&worker_violations, "worker creator role");
    }
    return NULL;
}

static void *apply_child(void *arg) {
    (void)arg;
    if (lc_role(0) != 1) violation(&worker_violations, "apply child role");
    if (!mask_is_one_of(0, &worker_set, &host_set)) violation(&worker_violations, "apply child mask");
    BUMP(applied);
    BUMP(churned);
    return NULL;
}

#define MAX_PARKED 32
static pthread_t parked[MAX_PARKED];
static pid_t parked_tids[MAX_PARKED];
static int parked_count;
static volatile int unpark;

static void *parked_child(void *slot) {
    __atomic_store_n(&parked_tids[(long)slot], lc_tid(), __ATOMIC_RELEASE);
    while (!unpark) usleep(1000);
    return NULL;
}

static struct lc_closure apply_closure = {apply_child, NULL};
static struct lc_closure parked_closures[MAX_PARKED];

static void *apply_creator(void *arg) {
    (void)arg;
    for (long batch = 0; !stop && __atomic_load_n(&churned, __ATOMIC_RELAXED) < target_threads; batch++) {
        pthread_t t[BATCH];
        int made = 0;
        for (int i = 0; i < BATCH; i++) {
            if (pthread_create(&t[made], NULL, in_worker_lib, &apply_closure) == 0)
                made++;
            else
                BUMP(create_failures);
        }
        for (int i = 0; i < made; i++) pthread_join(t[i], NULL);
        if (batch % 64 == 0) {
            int slot = __atomic_fetch_add(&parked_count, 1, __ATOMIC_RELAXED);
            if (slot < MAX_PARKED &&
                pthread_create(&parked[slot], NULL, in_worker_lib, &parked_closures[slot]) != 0)
                BUMP(create_failures);
        }
        check_host("apply creator");
    }
    return NULL;
}

/* Every parked child (all workers) on `want`; each one off it is a violation. */
static void check_parked(const cpu_set_t *want, const char *when) {
    int n = parked_count < MAX_PARKED ? parked_count : MAX_PARKED;
    for (int i = 0; i < n; i++) {
        pid_t tid;
        while (!(tid = __atomic_load_n(&parked_tids[i], __ATOMIC_ACQUIRE))) usleep(100);
        if (!mask_is_one_of(tid, want, NULL) || lc_role(tid) != 1) {
            fprintf(stderr, "VIOLATION parked apply child %d %s\n", (int)tid, when);
            BUMP(worker_violations);
        }
    }
}

static void *last_lease(void *unused) {
    (void)unused;
    int64_t lease = lc_configure(0);
    check_parked(&worker_set, "under a new lease");
    lc_release(lease);
    check_parked(&host_set, "after its release");
    return NULL;
}

static pthread_t worker_creators[2];
static volatile int creators_started;

static void *configurer(void *arg) {
    long index = (long)arg;
    for (long i = 0; !stop; i++) {
        int64_t lease = lc_configure(0);
        if (lease <= 0) {
            violation(&worker_violations, "configure failed");
            usleep(1000);
            continue;
        }
        if (!my_mask_is(&worker_set)) violation(&worker_violations, "configurer off the worker mask during its lease");
        if (index == 0 && i == 0) {
            for (int k = 0; k < 2; k++) pthread_create(&worker_creators[k], NULL, worker_creator, NULL);
            creators_started = 1;
        }
        if (i % 4 == 0) sched_yield();
        if (lc_release(lease) != 0) violation(&worker_violations, "release failed");
        BUMP(cycles);
    }
    return NULL;
}

static double now(void) { return (double)lc_now_ns() / 1e9; }

int main(int argc, char **argv) {
    lc_init();
    if (argc < 6) {
        fprintf(stderr, "usage: churn_stress <threads> <seconds> <worker cpulist> <host cpulist> "
                        "<worker library>\n");
        return 64;
    }
    in_worker_lib = lc_worker_lib_routine(argv[5]);
    for (long i = 0; i < MAX_PARKED; i++) parked_closures[i] = (struct lc_closure){parked_child, (void *)i};
    target_threads = atol(argv[1]);
    double budget = atof(argv[2]);
    cpuset_of_list(argv[3], &worker_set);
    cpuset_of_list(argv[4], &host_set);
    CPU_ZERO(&pin_set);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &host_set) && !CPU_ISSET(c, &worker_set)) {
            CPU_SET(c, &pin_set);
            break;
        }
    if (!my_mask_is(&host_set)) {
        fprintf(stderr, "main does not start on the host mask %s\n", argv[4]);
        return 65;
    }
    note("main");
    double start = now();
    pthread_t checkers[2], creators[2], configurers[2], appliers[2];
    for (int i = 0; i < 2; i++) pthread_create(&checkers[i], NULL, host_checker, NULL);
    for (int i = 0; i < 2; i++) pthread_create(&creators[i], NULL, host_creator, NULL);
    for (int i = 0; i < 2; i++) pthread_create(&appliers[i], NULL, apply_creator, NULL);
    for (long i = 0; i < 2; i++) pthread_create(&configurers[i], NULL, configurer, (void *)i);
    while (__atomic_load_n(&churned, __ATOMIC_RELAXED) < target_threads && now() - start < budget) usleep(10000);
    double churn_time = now() - start;
    stop = 1;
    for (int i = 0; i < 2; i++) pthread_join(checkers[i], NULL);
    for (int i = 0; i < 2; i++) pthread_join(creators[i], NULL);
    for (int i = 0; i < 2; i++) pthread_join(appliers[i], NULL);
    for (int i = 0; i < 2; i++) pthread_join(configurers[i], NULL);
    if (creators_started)
        for (int i = 0; i < 2; i++) pthread_join(worker_creators[i], NULL);
    /* Every lease is released: the parked apply children are back on the host mask; one more
     * lease puts them on the worker mask, and its release back. */
    int parked_n = parked_count < MAX_PARKED ? parked_count : MAX_PARKED;
    check_parked(&host_set, "after the last release");
    pthread_t last;
    pthread_create(&last, NULL, last_lease, NULL); /* main stays a host */
    pthread_join(last, NULL);
    unpark = 1;
    for (int i = 0; i < parked_n; i++) pthread_join(parked[i], NULL);
    int reaped = lc_wait_tasks(1);
    check_host("main");
    lc_say("STRESS threads=%ld cycles=%ld app_pins=%ld host_checks=%ld grandchildren=%ld applied=%ld "
           "parked=%d seconds=%.1f violations=%ld pin_violations=%ld worker_violations=%ld "
           "create_failures=%ld reaped=%d",
           churned, cycles, app_pins, host_checks, grandchildren, applied, parked_n, churn_time,
           violations, pin_violations, worker_violations, create_failures, reaped);
    phase("end");
    lc_report("end");
    return 0;
}
