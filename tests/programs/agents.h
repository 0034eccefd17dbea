/* Shared by the lifecycle, fault and stress programs of tests/programs (lifecycle_scenarios.c,
 * churn_stress.c, birth_during_release.c, malloc_arenas.c, hostile.c, ...).
 *
 * - The library's functions are looked up with dlsym, so every program also runs without it.
 * - "Agents" are parked threads that run tasks on request: the test drives which thread calls
 *   configure, creates a child, pins itself, forks or execs.
 * - note()/phase() speak the PHASE protocol of tests/common/mod.rs ("PHASE <name>
 *   <thread>=<tid>:<role> ..." then wait for a line on stdin); lc_report() prints
 *   "REPORT <tag> <json>" with the library's JSON report.
 */
#ifndef LC_COMMON_H
#define LC_COMMON_H

#define _GNU_SOURCE
#pragma GCC diagnostic ignored "-Wunused-function"
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cpulist.h"

static int64_t (*t_configure)(int32_t);
static int32_t (*t_release)(int64_t);
static int32_t (*t_role)(int32_t);
static int64_t (*t_report)(char *, uint64_t);

static void lc_init(void) {
    t_configure = (int64_t (*)(int32_t))dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    t_release = (int32_t (*)(int64_t))dlsym(RTLD_DEFAULT, "tllm_affinity_release");
    t_role = (int32_t (*)(int32_t))dlsym(RTLD_DEFAULT, "tllm_affinity_role");
    t_report = (int64_t (*)(char *, uint64_t))dlsym(RTLD_DEFAULT, "tllm_affinity_report");
}

static pid_t lc_tid(void) { return (pid_t)syscall(SYS_gettid); }

static int64_t lc_configure(int32_t device) { return t_configure ? t_configure(device) : -1; }
static int32_t lc_release(int64_t lease) { return t_release ? t_release(lease) : -1; }
static int32_t lc_role(pid_t tid) { return t_role ? t_role(tid) : -1; }

/* The JSON report, malloc'd; "null" without the library. */
static char *lc_report_json(void) {
    if (!t_report) return strdup("null");
    for (;;) {
        int64_t need = t_report(NULL, 0);
        char *buf = malloc((size_t)need + 1);
        int64_t again = t_report(buf, (uint64_t)need + 1);
        if (again <= need) return buf;
        free(buf); /* threads came and went between the two calls: ask again */
    }
}

static pthread_mutex_t lc_out_lock = PTHREAD_MUTEX_INITIALIZER;

static void lc_report(const char *tag) {
    char *json = lc_report_json();
    pthread_mutex_lock(&lc_out_lock);
    printf("REPORT %s %s\n", tag, json);
    fflush(stdout);
    pthread_mutex_unlock(&lc_out_lock);
    free(json);
}

static void lc_say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void lc_say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&lc_out_lock);
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    pthread_mutex_unlock(&lc_out_lock);
    va_end(ap);
}

/* A thread's kernel mask as a cpulist ("0-1" style, ranges merged). */
static void lc_mask_of(pid_t tid, char *out, size_t len) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (syscall(SYS_sched_getaffinity, tid, sizeof set, &set) < 0) {
        snprintf(out, len, "?");
        return;
    }
    cpulist(&set, out, len);
}

/* ---- named threads and phases ---------------------------------------------------------- */

#define LC_MAX_NAMED 256
static struct { char name[24]; pid_t tid; } lc_named[LC_MAX_NAMED];
static int lc_n_named;
static pthread_mutex_t lc_named_lock = PTHREAD_MUTEX_INITIALIZER;

static void note_tid(const char *name, pid_t tid) {
    pthread_mutex_lock(&lc_named_lock);
    if (lc_n_named < LC_MAX_NAMED) {
        snprintf(lc_named[lc_n_named].name, sizeof lc_named[0].name, "%s", name);
        lc_named[lc_n_named].tid = tid;
        lc_n_named++;
    }
    pthread_mutex_unlock(&lc_named_lock);
}

static void note(const char *name) { note_tid(name, lc_tid()); }

static void phase(const char *name) {
    pthread_mutex_lock(&lc_named_lock);
    pthread_mutex_lock(&lc_out_lock);
    printf("PHASE %s", name);
    for (int i = 0; i < lc_n_named; i++)
        printf(" %s=%d:%d", lc_named[i].name, lc_named[i].tid, lc_role(lc_named[i].tid));
    printf("\n");
    fflush(stdout);
    pthread_mutex_unlock(&lc_out_lock);
    pthread_mutex_unlock(&lc_named_lock);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) exit(3);
}

/* ---- agents: parked threads that run tasks on request ---------------------------------- */

typedef struct agent agent_t;
typedef void (*task_fn)(agent_t *self, void *arg);

struct agent {
    char name[24];
    pthread_t thread;
    pid_t tid;
    pthread_mutex_t m;
    pthread_cond_t c;
    task_fn task;
    void *arg;
    int started;
    int quit;
};

/* Every live agent, reachable from here: a fork child (where the other threads are gone) must
 * not see them as leaks under valgrind. */
static agent_t *lc_agents[LC_MAX_NAMED];
static pthread_mutex_t lc_agents_lock = PTHREAD_MUTEX_INITIALIZER;
static void lc_keep(agent_t *a) {
    pthread_mutex_lock(&lc_agents_lock);
    for (int i = 0; i < LC_MAX_NAMED; i++)
        if (!lc_agents[i]) {
            lc_agents[i] = a;
            break;
        }
    pthread_mutex_unlock(&lc_agents_lock);
}
static void lc_forget(agent_t *a) {
    pthread_mutex_lock(&lc_agents_lock);
    for (int i = 0; i < LC_MAX_NAMED; i++)
        if (lc_agents[i] == a) lc_agents[i] = NULL;
    pthread_mutex_unlock(&lc_agents_lock);
}

static void *agent_main(void *p) {
    agent_t *a = p;
    note(a->name);
    pthread_mutex_lock(&a->m);
    a->tid = lc_tid();
    a->started = 1;
    pthread_cond_broadcast(&a->c);
    for (;;) {
        while (!a->task && !a->quit) pthread_cond_wait(&a->c, &a->m);
        if (a->task) {
            task_fn fn = a->task;
            pthread_mutex_unlock(&a->m);
            fn(a, a->arg);
            pthread_mutex_lock(&a->m);
            a->task = NULL;
            pthread_cond_broadcast(&a->c);
        } else {
            break;
        }
    }
    pthread_mutex_unlock(&a->m);
    return NULL;
}

/* Starts an agent from the calling thread; returns NULL (and sets *rc) when pthread_create fails. */
static agent_t *agent_new_attr(const char *name, const pthread_attr_t *attr, int *rc_out) {
    agent_t *a = calloc(1, sizeof *a);
    snprintf(a->name, sizeof a->name, "%s", name);
    pthread_mutex_init(&a->m, NULL);
    pthread_cond_init(&a->c, NULL);
    int rc = pthread_create(&a->thread, attr, agent_main, a);
    if (rc_out) *rc_out = rc;
    if (rc != 0) {
        free(a);
        return NULL;
    }
    lc_keep(a);
    pthread_mutex_lock(&a->m);
    while (!a->started) pthread_cond_wait(&a->c, &a->m);
    pthread_mutex_unlock(&a->m);
    return a;
}

static agent_t *agent_new(const char *name) {
    int rc;
    agent_t *a = agent_new_attr(name, NULL, &rc);
    if (!a) {
        fprintf(stderr, "pthread_create(%s) failed: %d\n", name, rc);
        exit(4);
    }
    return a;
}

static void agent_do(agent_t *a, task_fn fn, void *arg) {
    pthread_mutex_lock(&a->m);
    while (a->task) pthread_cond_wait(&a->c, &a->m);
    a->task = fn;
    a->arg = arg;
    pthread_cond_broadcast(&a->c);
    while (a->task) pthread_cond_wait(&a->c, &a->m);
    pthread_mutex_unlock(&a->m);
}

static void agent_stop(agent_t *a) {
    pthread_mutex_lock(&a->m);
    a->quit = 1;
    pthread_cond_broadcast(&a->c);
    pthread_mutex_unlock(&a->m);
    pthread_join(a->thread, NULL);
    lc_forget(a);
    pthread_mutex_destroy(&a->m);
    pthread_cond_destroy(&a->c);
    free(a);
}

/* Tasks shared by the programs. */
static int64_t lc_leases[64];
static int lc_n_leases;

static void task_configure(agent_t *self, void *arg) {
    int64_t lease = lc_configure((int32_t)(intptr_t)arg);
    lc_say("CONFIGURE %s %lld", self->name, (long long)lease);
    if (lease > 0 && lc_n_leases < 64) lc_leases[lc_n_leases++] = lease;
}

/* An agent that has configured `device`: the worker most scenarios start with. */
static agent_t *configured_agent(const char *name, int device) {
    agent_t *a = agent_new(name);
    agent_do(a, task_configure, (void *)(intptr_t)device);
    return a;
}

static void task_release_all(agent_t *self, void *arg) {
    (void)arg;
    for (int i = 0; i < lc_n_leases; i++)
        lc_say("RELEASE %s %lld %d", self->name, (long long)lc_leases[i], lc_release(lc_leases[i]));
    lc_n_leases = 0;
}

/* How most scenarios end: `w` releases every lease, then the phase "released". */
static void release_phase(agent_t *w) {
    agent_do(w, task_release_all, NULL);
    phase("released");
}

/* arg: the name of the agent to start from this agent; the new agent is stored in lc_spawned. */
static agent_t *lc_spawned;
static void task_spawn(agent_t *self, void *arg) {
    (void)self;
    lc_spawned = agent_new((const char *)arg);
}

static agent_t *spawn_from(agent_t *parent, const char *name) {
    agent_do(parent, task_spawn, (void *)name);
    return lc_spawned;
}

static uint64_t lc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Threads started on lc_in_worker_lib (worker_library_routine.c, a worker library) run
 * closure.fn(arg). */
struct lc_closure {
    void *(*fn)(void *);
    void *arg;
};

static void *(*lc_worker_lib_routine(const char *path))(void *) {
    void *lib = dlopen(path, RTLD_NOW);
    void *routine = lib ? dlsym(lib, "lc_in_worker_lib") : NULL;
    if (!routine) {
        fprintf(stderr, "worker library %s: %s\n", path, dlerror());
        exit(70);
    }
    return (void *(*)(void *))routine;
}

static void cpuset_of_list(const char *list, cpu_set_t *set) {
    CPU_ZERO(set);
    const char *p = list;
    while (*p) {
        char *end;
        long lo = strtol(p, &end, 10), hi = lo;
        if (*end == '-') hi = strtol(end + 1, &end, 10);
        for (long c = lo; c <= hi && c < CPU_SETSIZE; c++) CPU_SET((int)c, set);
        p = *end == ',' ? end + 1 : end;
        if (end == p && *p) break;
    }
}

/* Live threads of this process as the kernel counts them. */
#include <dirent.h>
static int lc_task_count(void) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* Threads in /proc/self/task before the program's first instruction that the program did not
 * make: none natively; under qemu-user, qemu's own RCU thread. */
static int lc_not_the_programs;
__attribute__((constructor)) static void lc_count_not_the_programs(void) {
    lc_not_the_programs = lc_task_count() - 1;
}

/* Waits (up to 10 s) until the kernel has reaped every thread of the program's but `n`: a joined
 * or detached thread is gone from /proc/self/task only a little after its routine returned. */
static int lc_wait_tasks(int n) {
    for (int i = 0; i < 10000; i++) {
        if (lc_task_count() == n + lc_not_the_programs) return 1;
        usleep(1000);
    }
    return 0;
}

#endif
