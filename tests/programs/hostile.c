/* The engine under hostile conditions (tests/hostile.rs), one mode per condition:
 *
 *   hostile signals <ms>     a signal handler that calls sched_setaffinity interrupts threads that
 *                            are inside the library (its setaffinity shim, thread creation, exit)
 *   hostile vfork            a worker's vfork and clone(CLONE_VM) children call sched_setaffinity(0)
 *   hostile chain <n>        threads that start their successor and exit, n generations
 *   hostile glibc            glibc's own helper threads (timer_create SIGEV_THREAD, aio) started
 *                            from a worker during a lease
 *   hostile tsd              a worker's thread-specific-data destructor creates a thread
 *   hostile tlsdtor          a worker's thread_local destructor (__cxa_thread_atexit_impl, as
 *                            C++ registers one) creates a thread and sets its own mask
 *   hostile launchvar        prints what the library left in TLLM_AFFINITY_LAUNCH
 *   hostile fifo <ms>        two SCHED_FIFO threads of different priorities on one CPU, both
 *                            creating threads (so both take the library's locks)
 *
 * Output: PHASE lines (the test reads the kernel's masks, then answers on stdin), REPORT lines
 * and result lines, as in agents.h.
 */
#include "agents.h"

#include <aio.h>
#include <fcntl.h>
#include <malloc.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

static int cpu_arg_local = 1;

/* ---- signals ------------------------------------------------------------------------------ */

static volatile sig_atomic_t handled;
static volatile int stop_busy;

static void on_signal(int sig) {
    (void)sig;
    int saved = errno;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (syscall(SYS_sched_getaffinity, 0, sizeof set, &set) > 0) sched_setaffinity(0, sizeof set, &set);
    handled++;
    errno = saved;
}

static void *trivial(void *arg) { return arg; }

static void *busy(void *arg) {
    (void)arg;
    note(arg ? "busy_worker" : "busy_host");
    long rounds = 0;
    while (!stop_busy) {
        cpu_set_t set;
        CPU_ZERO(&set);
        syscall(SYS_sched_getaffinity, 0, sizeof set, &set);
        sched_setaffinity(0, sizeof set, &set);
        pthread_t t;
        if (pthread_create(&t, NULL, trivial, NULL) == 0) pthread_join(t, NULL);
        rounds++;
    }
    return (void *)rounds;
}

static pthread_t busy_threads[2];
static void task_start_busy(agent_t *self, void *arg) {
    (void)self;
    pthread_create(&busy_threads[1], NULL, busy, arg);
}

static int mode_signals(int ms) {
    note("main");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    agent_t *w = configured_agent("W", 0);
    pthread_create(&busy_threads[0], NULL, busy, NULL);
    agent_do(w, task_start_busy, (void *)1);
    uint64_t until = lc_now_ns() + (uint64_t)ms * 1000000ull;
    long sent = 0;
    while (lc_now_ns() < until) {
        pthread_kill(busy_threads[sent & 1], SIGUSR1);
        sent++;
        if ((sent & 63) == 0) sched_yield();
    }
    stop_busy = 1;
    void *r0, *r1;
    pthread_join(busy_threads[0], &r0);
    pthread_join(busy_threads[1], &r1);
    lc_say("SIGNALS sent=%ld handled=%d rounds=%ld", sent, (int)handled, (long)r0 + (long)r1);
    agent_do(w, task_release_all, NULL);
    lc_say("DONE");
    return 0;
}

/* ---- vfork and clone(CLONE_VM) ------------------------------------------------------------ */

static void pin_self_to(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static int cloned_child(void *arg) {
    pin_self_to((int)(intptr_t)arg);
    return 0;
}

static void task_children(agent_t *self, void *arg) {
    (void)self;
    (void)arg;
    int other = cpu_arg_local == 0 ? 1 : 0;
    pid_t pid = vfork();
    if (pid == 0) {
        pin_self_to(other);
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    size_t stack_len = 256 * 1024;
    char *stack = mmap(NULL, stack_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    pid = clone(cloned_child, stack + stack_len, CLONE_VM | SIGCHLD, (void *)(intptr_t)other);
    waitpid(pid, &status, 0);
    munmap(stack, stack_len);
    lc_say("CHILDREN vfork and clone done");
}

/* How the vfork, glibc and tsd modes go on from their set-up: a worker W configures device 0 and
 * runs `task(arg)`, then `settle()` runs on the main thread, then the phase `name`, and W releases
 * (release_phase). */
static int worker_task_phase(task_fn task, void *arg, void (*settle)(void), const char *name) {
    agent_t *w = configured_agent("W", 0);
    agent_do(w, task, arg);
    settle();
    phase(name);
    release_phase(w);
    return 0;
}

static void report_children(void) { lc_report("children"); }

static int mode_vfork(void) {
    note("main");
    return worker_task_phase(task_children, NULL, report_children, "children");
}

/* ---- chain -------------------------------------------------------------------------------- */

static long chain_length;
static size_t heap_at_first_checkpoint, heap_at_end;
static sem_t chain_done;

/* Bytes in use, including the chunks malloc maps by themselves (a large vector's). */
static size_t heap_in_use(void) {
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

static void *chain_link(void *arg) {
    long generation = (long)arg;
    if (generation == 1000) heap_at_first_checkpoint = heap_in_use();
    if (generation == chain_length) {
        heap_at_end = heap_in_use();
        sem_post(&chain_done);
        return NULL;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t next;
    while (pthread_create(&next, &attr, chain_link, (void *)(generation + 1)) != 0) usleep(100);
    pthread_attr_destroy(&attr);
    return NULL;
}

static int mode_chain(long n) {
    /* One arena: mallinfo2 then counts every thread's allocations, the library's included. */
    mallopt(M_ARENA_MAX, 1);
    chain_length = n;
    sem_init(&chain_done, 0, 0);
    chain_link((void *)0);
    sem_wait(&chain_done);
    lc_wait_tasks(1);
    lc_say("CHAIN generations=%ld heap_at_1000=%zu heap_at_end=%zu", n, heap_at_first_checkpoint,
           heap_at_end);
    return 0;
}

/* ---- glibc's own helper threads ----------------------------------------------------------- */

static sem_t timer_fired;
static void on_timer(union sigval v) {
    (void)v;
    sem_post(&timer_fired);
}

/* Names every thread the program did not start itself (glibc's helpers). */
static void note_unnamed(const char *prefix) {
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    int n = 0;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        pid_t tid = (pid_t)atoi(e->d_name);
        int known = 0;
        pthread_mutex_lock(&lc_named_lock);
        for (int i = 0; i < lc_n_named; i++)
            if (lc_named[i].tid == tid) known = 1;
        pthread_mutex_unlock(&lc_named_lock);
        if (!known) {
            char name[24];
            snprintf(name, sizeof name, "%s%d", prefix, n++);
            note_tid(name, tid);
        }
    }
    if (d) closedir(d);
    lc_say("UNNAMED %d", n);
}

static void task_glibc_helpers(agent_t *self, void *arg) {
    (void)self;
    (void)arg;
    sem_init(&timer_fired, 0, 0);
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_THREAD;
    sev.sigev_notify_function = on_timer;
    timer_t timer;
    if (timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0) {
        perror("timer_create");
        exit(5);
    }
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    its.it_value.tv_nsec = 1000000;
    timer_settime(timer, 0, &its, NULL);
    sem_wait(&timer_fired);

    static char buf[16];
    static struct aiocb cb;
    int fd = open("/proc/self/stat", O_RDONLY);
    memset(&cb, 0, sizeof cb);
    cb.aio_fildes = fd;
    cb.aio_buf = buf;
    cb.aio_nbytes = sizeof buf;
    if (aio_read(&cb) != 0) {
        perror("aio_read");
        exit(5);
    }
    const struct aiocb *list[1] = {&cb};
    aio_suspend(list, 1, NULL);
    aio_return(&cb);
    close(fd);
}

static void note_helpers(void) { note_unnamed("helper"); }

static int mode_glibc(void) {
    note("main");
    (void)agent_new("before");
    return worker_task_phase(task_glibc_helpers, NULL, note_helpers, "configured");
}

/* ---- SIGEV_THREAD timers of a worker and of a host ------------------------------------------ */

/* Each callback writes its thread's mask into the slot its timer's value names. */
static char timer_masks[4][128];
static sem_t timer_slot_fired;
static void record_mask(union sigval v) {
    lc_mask_of(lc_tid(), timer_masks[v.sival_int], sizeof timer_masks[0]);
    sem_post(&timer_slot_fired);
}

static timer_t make_timer(int slot) {
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_THREAD;
    sev.sigev_notify_function = record_mask;
    sev.sigev_value.sival_int = slot;
    timer_t timer;
    if (timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0) {
        perror("timer_create");
        exit(5);
    }
    return timer;
}

/* Fires `timer` once, its callback writing into `slot`. */
static void fire(timer_t timer) {
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    its.it_value.tv_nsec = 1000000;
    timer_settime(timer, 0, &its, NULL);
    sem_wait(&timer_slot_fired);
}

static timer_t worker_timer;
static void task_worker_timer(agent_t *self, void *arg) {
    (void)self, (void)arg;
    worker_timer = make_timer(0);
    fire(worker_timer);
}

static void task_worker_timer_after(agent_t *self, void *arg) {
    (void)self, (void)arg;
    worker_timer = make_timer(2);
    fire(worker_timer);
}

/* The worker creates the process's first SIGEV_THREAD timer (glibc starts its helper thread
 * there, on the worker mask), then the host main thread creates one; both fire during the lease
 * and again after the release. Prints "TIMERS worker=.. host=.. worker_after=.. host_after=..",
 * each the mask its callback ran on. */
static int mode_timers(void) {
    sem_init(&timer_slot_fired, 0, 0);
    note("main");
    agent_t *w = configured_agent("W", 0);
    agent_do(w, task_worker_timer, NULL);
    timer_t host_timer = make_timer(1);
    fire(host_timer);
    agent_do(w, task_release_all, NULL);
    timer_delete(worker_timer);
    agent_do(w, task_worker_timer_after, NULL);
    timer_delete(host_timer);
    host_timer = make_timer(3);
    fire(host_timer);
    timer_delete(host_timer);
    timer_delete(worker_timer);
    lc_say("TIMERS worker=%s host=%s worker_after=%s host_after=%s", timer_masks[0],
           timer_masks[1], timer_masks[2], timer_masks[3]);
    return 0;
}

/* ---- a thread created from a thread-specific-data destructor ------------------------------- */

static pthread_key_t user_key;
static sem_t orphan_started;

static void *orphan(void *arg) {
    (void)arg;
    note("orphan");
    sem_post(&orphan_started);
    for (;;) pause();
    return NULL;
}

/* Starts a detached orphan: what both kinds of destructor below do on an exiting thread. */
static void start_orphan(void) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    pthread_create(&t, &attr, orphan, NULL);
    pthread_attr_destroy(&attr);
}

static void user_destructor(void *value) {
    (void)value;
    start_orphan();
}

/* An agent task: runs `arg` (a start routine) on a thread of its own and joins it. */
static void task_run_and_join(agent_t *self, void *arg) {
    (void)self;
    pthread_t t;
    pthread_create(&t, NULL, (void *(*)(void *))arg, NULL);
    pthread_join(t, NULL);
}

static void *exiting_worker(void *arg) {
    (void)arg;
    note("exiting");
    pthread_setspecific(user_key, (void *)1);
    return NULL;
}

static void wait_orphan(void) { sem_wait(&orphan_started); }

static int mode_tsd(void) {
    note("main");
    /* Created after the library's own key: its destructor runs after the library's. */
    pthread_key_create(&user_key, user_destructor);
    sem_init(&orphan_started, 0, 0);
    return worker_task_phase(task_run_and_join, (void *)exiting_worker, wait_orphan, "configured");
}

/* ---- a thread created from a thread_local destructor -------------------------------------- */

/* What a C++ `thread_local` with a destructor registers (g++ emits this call). */
extern int __cxa_thread_atexit_impl(void (*dtor)(void *), void *obj, void *dso);
extern void *__dso_handle;

static void tls_destructor(void *obj) {
    (void)obj;
    start_orphan();
    /* Then, once the child runs (registered), its own mask, set again: the library must still
     * know the thread. Not before: a child that registers after its creator chose its own mask
     * takes that choice on (register_child reads the creator's placement as it is then). */
    sem_wait(&orphan_started);
    cpu_set_t set;
    CPU_ZERO(&set);
    if (syscall(SYS_sched_getaffinity, 0, sizeof set, &set) > 0) sched_setaffinity(0, sizeof set, &set);
}

static pid_t tls_exiting_tid;

static void *tls_exiting_worker(void *arg) {
    (void)arg;
    tls_exiting_tid = lc_tid();
    __cxa_thread_atexit_impl(tls_destructor, NULL, &__dso_handle);
    return NULL;
}

static int mode_tlsdtor(void) {
    note("main");
    sem_init(&orphan_started, 0, 0);
    agent_t *w = agent_new("W");
    agent_do(w, task_configure, (void *)0);
    /* Joined: its destructor waited for the orphan to start. */
    agent_do(w, task_run_and_join, (void *)tls_exiting_worker);
    /* Gone and joined: the library must answer that it no longer knows the tid. */
    lc_say("EXITED %d role=%d", (int)tls_exiting_tid, lc_role(tls_exiting_tid));
    phase("configured");
    lc_report("configured");
    agent_do(w, task_release_all, NULL);
    phase("released");
    return 0;
}

/* ---- SCHED_FIFO threads of two priorities on one CPU -------------------------------------- */

static volatile int stop_fifo;
static volatile long fifo_rounds[2];

static void *fifo_low(void *arg) {
    (void)arg;
    while (!stop_fifo) {
        pthread_t t;
        if (pthread_create(&t, NULL, trivial, NULL) == 0) pthread_join(t, NULL);
        fifo_rounds[0]++;
    }
    return NULL;
}

static void *fifo_high(void *arg) {
    (void)arg;
    while (!stop_fifo) {
        /* Sleeps so the low-priority thread runs, and wakes (preempting it) now and then while it
         * holds a lock of the library. */
        struct timespec nap = {0, 200000};
        nanosleep(&nap, NULL);
        pthread_t t;
        if (pthread_create(&t, NULL, trivial, NULL) == 0) pthread_join(t, NULL);
        fifo_rounds[1]++;
    }
    return NULL;
}

static int start_fifo(pthread_t *t, int priority, void *(*fn)(void *)) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    pthread_attr_setaffinity_np(&attr, sizeof one, &one);
    pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED);
    pthread_attr_setschedpolicy(&attr, SCHED_FIFO);
    struct sched_param param = {.sched_priority = priority};
    pthread_attr_setschedparam(&attr, &param);
    int rc = pthread_create(t, &attr, fn, NULL);
    pthread_attr_destroy(&attr);
    return rc;
}

static int mode_fifo(int ms) {
    pthread_t low, high;
    int rc = start_fifo(&low, 1, fifo_low);
    if (rc != 0) {
        lc_say("FIFO unavailable: %s", strerror(rc));
        return 0;
    }
    if ((rc = start_fifo(&high, 2, fifo_high)) != 0) {
        stop_fifo = 1;
        pthread_join(low, NULL);
        lc_say("FIFO unavailable: %s", strerror(rc));
        return 0;
    }
    usleep((useconds_t)ms * 1000);
    stop_fifo = 1;
    pthread_join(high, NULL);
    pthread_join(low, NULL);
    lc_say("FIFO done low=%ld high=%ld", fifo_rounds[0], fifo_rounds[1]);
    return 0;
}

/* ---- launchvar ---------------------------------------------------------------------------- */

static int mode_launchvar(void) {
    const char *v = getenv("TLLM_AFFINITY_LAUNCH");
    lc_say("LAUNCHVAR %s threads=%d", v ? v : "(unset)", lc_task_count());
    return 0;
}

int main(int argc, char **argv) {
    lc_init();
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "signals")) return mode_signals(argc > 2 ? atoi(argv[2]) : 2000);
    if (!strcmp(mode, "vfork")) return mode_vfork();
    if (!strcmp(mode, "chain")) return mode_chain(argc > 2 ? atol(argv[2]) : 20000);
    if (!strcmp(mode, "glibc")) return mode_glibc();
    if (!strcmp(mode, "tsd")) return mode_tsd();
    if (!strcmp(mode, "tlsdtor")) return mode_tlsdtor();
    if (!strcmp(mode, "timers")) return mode_timers();
    if (!strcmp(mode, "launchvar")) return mode_launchvar();
    if (!strcmp(mode, "fifo")) return mode_fifo(argc > 2 ? atoi(argv[2]) : 2000);
    fprintf(stderr, "usage: hostile signals|vfork|chain|glibc|tsd|tlsdtor|launchvar|fifo\n");
    return 64;
}
