/* Thread-cost measurements for scripts/bench, run under different preloads.
 *
 *   threads create N [apply]     N pthread_create+join round trips; prints the median and the
 *                                mean in ns. Under the library a lease is open and the creator
 *                                is a worker (inherited path), or with "apply" the creator is a
 *                                host thread and the routine lives in a worker library, so every
 *                                new thread moves onto the worker mask itself.
 *   threads nolease N            N round trips with the library loaded but no lease open.
 *   threads paired PATH N        N pairs of round trips in one process, alternating the
 *                                interposed pthread_create with glibc's own (found in libc.so.6,
 *                                past any preload): the two sides share the process, the CPU and
 *                                the moment, so their ratio is free of run-to-run noise. PATH is
 *                                nolease, inherited (a worker creates under a lease; both sides'
 *                                children inherit the worker mask) or apply (a host creates a
 *                                worker-library routine; glibc's side runs one
 *                                sched_setaffinity in the new thread instead). Prints both
 *                                medians and the median of the per-pair ratios (x 1e6).
 *   threads selfpin N            N round trips whose new thread moves itself onto the last
 *                                allowed CPU with one sched_setaffinity: the floor of "apply".
 *   threads sweep N K            N parked threads made by the worker; K configure+release cycles
 *                                against K rounds of 2N raw sched_setaffinity (the floor) and K
 *                                rounds of 2N sched_getaffinity+sched_setaffinity pairs (the
 *                                floor with the one read a thread SPEC §2/§5 require); prints
 *                                the medians in ns and the medians of the per-round ratios.
 *   threads churn N              N create+join cycles; prints VmRSS (kB) every N/10.
 *   threads parallel C N [apply] C creator threads each making N threads; prints elapsed ns.
 *                                With "apply" the creators are hosts under a lease starting a
 *                                worker-library routine (bare: a routine that pins itself).
 *   threads registry N           RSS growth per parked thread: N threads parked, prints kB.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int64_t (*configure_fn)(int32_t);
typedef int32_t (*release_fn)(int64_t);
static configure_fn configure;
static release_fn release_lease;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t median(uint64_t *v, int n) {
    qsort(v, n, sizeof *v, cmp_u64);
    return v[n / 2];
}

static void *nothing(void *arg) { return arg; }

static cpu_set_t last_cpu;
static void *pin_self(void *arg) {
    syscall(SYS_sched_setaffinity, 0, sizeof last_cpu, &last_cpu);
    return arg;
}

static void set_last_cpu(void) {
    cpu_set_t all;
    sched_getaffinity(0, sizeof all, &all);
    CPU_ZERO(&last_cpu);
    for (int c = CPU_SETSIZE - 1; c >= 0; c--)
        if (CPU_ISSET(c, &all)) { CPU_SET(c, &last_cpu); break; }
}

static long rss_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld", &kb) == 1) break;
    if (f) fclose(f);
    return kb;
}

/* The lease is opened by a thread that configures: that thread is a worker. */
static int64_t lease = -1;
static void (*worker_job)(void);
static void *configure_then_job(void *unused) {
    (void)unused;
    if (configure) lease = configure(0);
    if (worker_job) worker_job();
    return NULL;
}

/* Runs `job` on a worker thread under a lease (NULL: only opens the lease). */
static void on_worker(void (*job)(void)) {
    worker_job = job;
    pthread_t w;
    pthread_create(&w, NULL, configure_then_job, NULL);
    pthread_join(w, NULL);
}

/* For the apply path: opens a lease from a worker thread, so that the main thread stays a host,
 * and returns the routine of the worker library ($BENCH_WORK_LIB). */
static void *(*prepare_apply(void))(void *) {
    void *work = dlopen(getenv("BENCH_WORK_LIB"), RTLD_NOW);
    if (!work) { fprintf(stderr, "%s\n", dlerror()); exit(1); }
    set_last_cpu();
    on_worker(NULL);
    return (void *(*)(void *))dlsym(work, "bench_work_routine");
}

typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

static uint64_t trip(create_fn create, void *(*routine)(void *)) {
    pthread_t th;
    uint64_t t0 = now_ns();
    if (create(&th, NULL, routine, NULL) != 0) { perror("pthread_create"); exit(1); }
    pthread_join(th, NULL);
    return now_ns() - t0;
}

static void round_trips(int n, void *(*routine)(void *)) {
    uint64_t *t = malloc(sizeof *t * n);
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        t[i] = trip(pthread_create, routine);
        total += t[i];
    }
    printf("median_ns %llu mean_ns %llu\n", (unsigned long long)median(t, n),
           (unsigned long long)(total / n));
    free(t);
}

/* Alternates which side goes first, so neither always follows the other's cache footprint. */
static void paired_trips(int n, void *(*lib_routine)(void *), void *(*bare_routine)(void *)) {
    void *libc = dlopen("libc.so.6", RTLD_NOLOAD | RTLD_LAZY);
    create_fn glibc_create = libc ? (create_fn)dlsym(libc, "pthread_create") : NULL;
    if (!glibc_create || glibc_create == (create_fn)pthread_create) {
        fprintf(stderr, "glibc's own pthread_create not found past the preload\n");
        exit(1);
    }
    uint64_t *bare = malloc(sizeof *bare * n), *lib = malloc(sizeof *lib * n);
    uint64_t *ratio = malloc(sizeof *ratio * n);
    for (int i = 0; i < n / 10; i++) { /* warm-up: stack cache, registry slots, page faults */
        trip(glibc_create, bare_routine);
        trip(pthread_create, lib_routine);
    }
    for (int i = 0; i < n; i++) {
        if (i % 2) {
            bare[i] = trip(glibc_create, bare_routine);
            lib[i] = trip(pthread_create, lib_routine);
        } else {
            lib[i] = trip(pthread_create, lib_routine);
            bare[i] = trip(glibc_create, bare_routine);
        }
        ratio[i] = lib[i] * 1000000 / (bare[i] ? bare[i] : 1);
    }
    printf("bare_ns %llu library_ns %llu ratio_e6 %llu\n", (unsigned long long)median(bare, n),
           (unsigned long long)median(lib, n), (unsigned long long)median(ratio, n));
    free(bare);
    free(lib);
    free(ratio);
}

static int trips;
static void round_trips_of_nothing(void) { round_trips(trips, nothing); }
static void paired_trips_of_nothing(void) { paired_trips(trips, nothing, nothing); }

/* sweep: parked threads made by the worker thread. */
static pthread_mutex_t park_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t park_cond = PTHREAD_COND_INITIALIZER;
static int parked, unpark;
static pid_t *tids;
static void *park(void *idx) {
    pthread_mutex_lock(&park_lock);
    tids[(intptr_t)idx] = (pid_t)syscall(SYS_gettid);
    parked++;
    pthread_cond_broadcast(&park_cond);
    while (!unpark) pthread_cond_wait(&park_cond, &park_lock);
    pthread_mutex_unlock(&park_lock);
    return NULL;
}

static pthread_t *spawn_parked(int n) {
    pthread_t *ths = malloc(sizeof *ths * n);
    tids = calloc(n, sizeof *tids);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    for (int i = 0; i < n; i++)
        if (pthread_create(&ths[i], &attr, park, (void *)(intptr_t)i) != 0) { perror("create"); exit(1); }
    pthread_mutex_lock(&park_lock);
    while (parked < n) pthread_cond_wait(&park_cond, &park_lock);
    pthread_mutex_unlock(&park_lock);
    return ths;
}

static void join_parked(pthread_t *ths, int n) {
    pthread_mutex_lock(&park_lock);
    unpark = 1;
    pthread_cond_broadcast(&park_cond);
    pthread_mutex_unlock(&park_lock);
    for (int i = 0; i < n; i++) pthread_join(ths[i], NULL);
    free(ths);
}

struct sweep_args { int n, k; };
static void *sweep(void *p) {
    struct sweep_args *a = p;
    pthread_t *ths = spawn_parked(a->n);
    uint64_t *lib = malloc(sizeof *lib * a->k), *raw = malloc(sizeof *raw * a->k),
             *look = malloc(sizeof *look * a->k);
    cpu_set_t all, one, probe;
    sched_getaffinity(0, sizeof all, &all);
    CPU_ZERO(&one);
    for (int c = CPU_SETSIZE - 1; c >= 0; c--)
        if (CPU_ISSET(c, &all)) { CPU_SET(c, &one); break; }
    uint64_t *ratio = malloc(sizeof *ratio * a->k), *look_ratio = malloc(sizeof *look_ratio * a->k);
    for (int r = 0; r < a->k; r++) {
        /* The three run in a rotating order, so none always follows another. */
        for (int step = 0; step < 3; step++) {
            int which = (r + step) % 3;
            uint64_t t0 = now_ns();
            if (which == 0) {
                int64_t l = configure(0);
                release_lease(l);
                lib[r] = now_ns() - t0;
            } else if (which == 1) {
                for (int i = 0; i < a->n; i++)
                    syscall(SYS_sched_setaffinity, tids[i], sizeof one, &one);
                for (int i = 0; i < a->n; i++)
                    syscall(SYS_sched_setaffinity, tids[i], sizeof all, &all);
                raw[r] = now_ns() - t0;
            } else {
                for (int i = 0; i < a->n; i++) {
                    syscall(SYS_sched_getaffinity, tids[i], sizeof probe, &probe);
                    syscall(SYS_sched_setaffinity, tids[i], sizeof one, &one);
                }
                for (int i = 0; i < a->n; i++) {
                    syscall(SYS_sched_getaffinity, tids[i], sizeof probe, &probe);
                    syscall(SYS_sched_setaffinity, tids[i], sizeof all, &all);
                }
                look[r] = now_ns() - t0;
            }
        }
        ratio[r] = lib[r] * 1000000 / raw[r];
        look_ratio[r] = lib[r] * 1000000 / look[r];
    }
    printf("library_ns %llu floor_ns %llu look_floor_ns %llu ratio_e6 %llu look_ratio_e6 %llu\n",
           (unsigned long long)median(lib, a->k), (unsigned long long)median(raw, a->k),
           (unsigned long long)median(look, a->k), (unsigned long long)median(ratio, a->k),
           (unsigned long long)median(look_ratio, a->k));
    free(lib);
    free(raw);
    free(look);
    free(ratio);
    free(look_ratio);
    join_parked(ths, a->n);
    return NULL;
}

struct par_args { int n; void *(*routine)(void *); };
static void *creator(void *p) {
    struct par_args *a = p;
    for (int i = 0; i < a->n; i++) {
        pthread_t th;
        pthread_create(&th, NULL, a->routine, NULL);
        pthread_join(th, NULL);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: see the comment at the top\n"); return 2; }
    configure = (configure_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    release_lease = (release_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_release");
    int n = atoi(argv[2]);
    const char *mode = argv[1];
    if (!strcmp(mode, "create")) {
        trips = n;
        if (argc > 3 && !strcmp(argv[3], "apply"))
            round_trips(n, prepare_apply()); /* the main thread is a host */
        else
            on_worker(round_trips_of_nothing);
    } else if (!strcmp(mode, "paired")) {
        const char *path = argv[2];
        trips = argc > 3 ? atoi(argv[3]) : 1000;
        if (!configure) { fprintf(stderr, "paired needs the library\n"); return 1; }
        if (!strcmp(path, "nolease")) {
            paired_trips(trips, nothing, nothing);
        } else if (!strcmp(path, "inherited")) {
            on_worker(paired_trips_of_nothing);
        } else if (!strcmp(path, "apply")) {
            paired_trips(trips, prepare_apply(), pin_self); /* the main thread is a host */
        } else {
            fprintf(stderr, "paired: unknown path '%s'\n", path);
            return 2;
        }
    } else if (!strcmp(mode, "nolease")) {
        round_trips(n, nothing);
    } else if (!strcmp(mode, "selfpin")) {
        set_last_cpu();
        round_trips(n, pin_self);
    } else if (!strcmp(mode, "sweep")) {
        if (!configure) { fprintf(stderr, "sweep needs the library\n"); return 1; }
        struct sweep_args a = {n, argc > 3 ? atoi(argv[3]) : 9};
        pthread_t w;
        pthread_create(&w, NULL, sweep, &a);
        pthread_join(w, NULL);
    } else if (!strcmp(mode, "churn")) {
        printf("rss_kb 0 %ld\n", rss_kb());
        for (int i = 1; i <= n; i++) {
            pthread_t th;
            pthread_create(&th, NULL, nothing, NULL);
            pthread_join(th, NULL);
            if (i % (n / 10) == 0) printf("rss_kb %d %ld\n", i, rss_kb());
        }
    } else if (!strcmp(mode, "parallel")) {
        int c = n, per = atoi(argv[3]);
        pthread_t ths[64];
        struct par_args a = {per, nothing};
        if (argc > 4 && !strcmp(argv[4], "apply")) {
            a.routine = prepare_apply();
            if (!configure) a.routine = pin_self; /* bare: the floor of the apply path */
        }
        uint64_t t0 = now_ns();
        for (int i = 0; i < c; i++) pthread_create(&ths[i], NULL, creator, &a);
        for (int i = 0; i < c; i++) pthread_join(ths[i], NULL);
        printf("elapsed_ns %llu\n", (unsigned long long)(now_ns() - t0));
    } else if (!strcmp(mode, "registry")) {
        long before = rss_kb();
        pthread_t *ths = spawn_parked(n);
        long after = rss_kb();
        printf("rss_kb_before %ld rss_kb_after %ld\n", before, after);
        join_parked(ths, n);
    }
    fflush(stdout);
    if (lease > 0 && release_lease) release_lease(lease);
    return 0;
}
