/* Everything that can leave a lock held in a fork child, at once, for a few seconds (the
 * never-hang rule of docs/reliability.md). Every thread below runs until the time is up; then
 * the main thread prints its counts and calls exit() while they all still run.
 *
 *   fork_storm repro SECONDS PLUGIN_A PLUGIN_B
 *     the reported hang: two threads dlopen/dlclose plugins whose constructor and destructor
 *     create and join a thread, one creates and joins threads, one configures and releases,
 *     one forks children that create one thread and _exit, one pins itself.
 *   fork_storm storm SECONDS PLUGIN_A PLUGIN_B
 *     the same, plus: a thread inside dl_iterate_phdr, vfork / _Fork / posix_spawn children
 *     that only exec or _exit, signals whose handler calls interposed functions (sched_getaffinity,
 *     sched_setaffinity), and fork children that fork grandchildren.
 *
 * Prints "STORM forks=N children_ok=N ..." and exits 0; a child that did not exit 0 (or whose
 * grandchild did not) counts in children_bad. A hang is the test's to catch (it collects every process's stacks). */
#include "agents.h"

#include <link.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

extern char **environ;
pid_t _Fork(void);

static volatile int stop;
static const char *plugins[2];
static long counts[16];
enum { FORKS, CHILDREN_OK, CHILDREN_BAD, LOADS, CREATES, CYCLES, PINS, ITERATIONS, VFORKS,
       UNDERSCORE_FORKS, SPAWNS, SIGNALS };
static void count(int which) { __atomic_fetch_add(&counts[which], 1, __ATOMIC_RELAXED); }

static void *nothing(void *arg) { return arg; }

static int create_and_join(void) {
    pthread_t t;
    int rc = pthread_create(&t, NULL, nothing, NULL);
    if (rc == 0) pthread_join(t, NULL);
    return rc;
}

static void *loader(void *arg) {
    const char *path = arg;
    while (!stop) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            fprintf(stderr, "fork_storm: dlopen %s: %s\n", path, dlerror());
            exit(4);
        }
        dlclose(h);
        count(LOADS);
    }
    return NULL;
}

static void *creator(void *arg) {
    (void)arg;
    while (!stop)
        if (create_and_join() == 0) count(CREATES);
    return NULL;
}

static void *configurer(void *arg) {
    (void)arg;
    while (!stop) {
        int64_t lease = lc_configure(0);
        create_and_join();
        if (lease > 0) lc_release(lease);
        count(CYCLES);
    }
    return NULL;
}

static void *self_pinner(void *arg) {
    (void)arg;
    cpu_set_t all, one;
    sched_getaffinity(0, sizeof all, &all);
    CPU_ZERO(&one);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &all)) {
            CPU_SET(cpu, &one);
            break;
        }
    while (!stop) {
        sched_setaffinity(0, sizeof one, &one);
        sched_setaffinity(0, sizeof all, &all);
        count(PINS);
    }
    return NULL;
}

static int walk_one(struct dl_phdr_info *info, size_t size, void *data) {
    (void)info, (void)size, (void)data;
    sched_yield(); /* stay inside the walk (and the loader's write lock) a little longer */
    return 0;
}

static void *iterator(void *arg) {
    (void)arg;
    while (!stop) {
        dl_iterate_phdr(walk_one, NULL);
        count(ITERATIONS);
    }
    return NULL;
}

/* A fork child's life: one thread (or, with grandchildren, a fork of its own), then _exit. */
static int child_life(int grandchildren) {
    if (create_and_join() != 0) return 5;
    if (grandchildren) {
        pid_t g = fork();
        if (g == 0) _exit(create_and_join() == 0 ? 0 : 5);
        int status = 0;
        if (g < 0 || waitpid(g, &status, 0) != g || !WIFEXITED(status) || WEXITSTATUS(status))
            return 6;
    }
    return 0;
}

static void reap(pid_t pid) {
    int status = 0;
    if (pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0)
        count(CHILDREN_OK);
    else
        count(CHILDREN_BAD);
}

static void *forker(void *arg) {
    int grandchildren = arg != NULL;
    while (!stop) {
        pid_t pid = fork();
        if (pid == 0) _exit(child_life(grandchildren));
        count(FORKS);
        reap(pid);
    }
    return NULL;
}

/* Children that, as POSIX allows after vfork or _Fork in a threaded process, only exec or _exit.
 * Each kind in a function of its own, so no local of the loop lives across a vfork. */
static char *const true_argv[] = {"true", NULL};

static __attribute__((noinline)) pid_t vfork_and_exit(void) {
    pid_t pid = vfork();
    if (pid == 0) _exit(0);
    count(VFORKS);
    return pid;
}

static __attribute__((noinline)) pid_t vfork_and_exec(void) {
    pid_t pid = vfork();
    if (pid == 0) {
        execve("/bin/true", true_argv, environ);
        _exit(7);
    }
    count(VFORKS);
    return pid;
}

static pid_t underscore_fork_then(int exec) {
    pid_t pid = _Fork();
    if (pid == 0) {
        if (exec) execve("/bin/true", true_argv, environ);
        _exit(exec ? 7 : 0);
    }
    count(UNDERSCORE_FORKS);
    return pid;
}

static pid_t spawn_true(void) {
    pid_t pid;
    if (posix_spawn(&pid, "/bin/true", NULL, NULL, true_argv, environ) != 0) pid = -1;
    count(SPAWNS);
    return pid;
}

static void *exec_forker(void *arg) {
    (void)arg;
    for (unsigned round = 0; !stop; round++) {
        switch (round % 5) {
        case 0: reap(vfork_and_exit()); break;
        case 1: reap(vfork_and_exec()); break;
        case 2: reap(underscore_fork_then(0)); break;
        case 3: reap(underscore_fork_then(1)); break;
        default: reap(spawn_true());
        }
    }
    return NULL;
}

static void on_signal(int sig) {
    (void)sig;
    int saved = errno;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) sched_setaffinity(0, sizeof set, &set);
    errno = saved;
}

#define TARGETS 8
static pthread_t targets[TARGETS];
static int n_targets;

static void *signaller(void *arg) {
    (void)arg;
    for (unsigned i = 0; !stop; i++) {
        if (pthread_kill(targets[i % n_targets], SIGUSR1) == 0) count(SIGNALS);
        struct timespec pause = {0, 200000};
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static void start(void *(*fn)(void *), void *arg) {
    pthread_t t;
    if (pthread_create(&t, NULL, fn, arg) != 0) {
        fprintf(stderr, "fork_storm: pthread_create failed\n");
        exit(4);
    }
    if (n_targets < TARGETS) targets[n_targets++] = t;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: fork_storm repro|storm SECONDS PLUGIN_A PLUGIN_B\n");
        return 2;
    }
    lc_init();
    int storm = !strcmp(argv[1], "storm");
    int seconds = atoi(argv[2]);
    plugins[0] = argv[3];
    plugins[1] = argv[4];

    if (storm) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sa.sa_flags = SA_RESTART;
        sigaction(SIGUSR1, &sa, NULL);
    }
    start(loader, (void *)plugins[0]);
    start(loader, (void *)plugins[1]);
    start(creator, NULL);
    start(configurer, NULL);
    start(forker, NULL);
    start(self_pinner, NULL);
    if (storm) {
        start(iterator, NULL);
        start(exec_forker, NULL);
        start(forker, (void *)1);
        start(signaller, NULL);
    }
    sleep((unsigned)seconds);
    /* On a loaded machine a thread may not have had its turn yet: every activity runs at least
     * once (10 s more at most; the test then sees the zero). */
    int active[] = {FORKS, LOADS, CREATES, CYCLES, PINS, ITERATIONS, VFORKS, UNDERSCORE_FORKS,
                    SPAWNS, SIGNALS};
    int n_active = storm ? 10 : 5;
    for (int tries = 0; tries < 100; tries++) {
        int all = 1;
        for (int i = 0; i < n_active; i++) all &= __atomic_load_n(&counts[active[i]], __ATOMIC_RELAXED) > 0;
        if (all) break;
        struct timespec tick = {0, 100000000};
        nanosleep(&tick, NULL);
    }
    stop = 1;
    printf("STORM forks=%ld children_ok=%ld children_bad=%ld loads=%ld creates=%ld cycles=%ld "
           "pins=%ld iterations=%ld vforks=%ld underscore_forks=%ld spawns=%ld signals=%ld\n",
           counts[FORKS], counts[CHILDREN_OK], counts[CHILDREN_BAD], counts[LOADS],
           counts[CREATES], counts[CYCLES], counts[PINS], counts[ITERATIONS], counts[VFORKS],
           counts[UNDERSCORE_FORKS], counts[SPAWNS], counts[SIGNALS]);
    fflush(stdout);
    /* exit() with every thread still running: the exit race. */
    exit(0);
}
