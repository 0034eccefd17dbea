/* The engine of scripts/bench --server: a native step thread doing a fixed amount of CPU work per
 * step, stepping without pause whatever the request load, never touching the GIL. Built as a
 * shared object; server_app.py calls it through ctypes (which releases the GIL).
 *
 * engine_wait() is the stand-in executor loop's forward step: its first call starts the step
 * thread from the calling thread (the engine's loop thread, so the step thread is born a worker
 * as an engine's native threads are), then it blocks until the step in progress ends and returns
 * the count of steps done. The loop takes its batch before the call and answers it after, so a
 * request waits for a step boundary, and the engine's pace shows in request latency, but the
 * steps happen whether or not anyone waits: the step rate measures how much CPU the engine
 * thread gets, not how busy the server is.
 *
 * Each step runs ENGINE_WORK iterations of a dependent multiply-add chain (a fixed instruction
 * count: no clock in the loop, so a step preempted half-way still does all its work) and
 * accumulates its own CPU time (CLOCK_THREAD_CPUTIME_ID) and wall time (CLOCK_MONOTONIC). The
 * thread never blocks, so wall - CPU is time it was runnable but off the CPU.
 *
 * engine_stats(out[8]): tid, steps, CPU ns, wall ns (sums over steps), now (CLOCK_MONOTONIC ns),
 * loop turns (engine_wait calls), work per step, 0. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ENGINE_WORK 500000L /* ~0.9 ms of CPU on the 2-vCPU VM */

static pthread_once_t once = PTHREAD_ONCE_INIT;
static uint32_t steps32, waiters; /* futex word: low 32 bits of the step count */
static int64_t steps, cpu_ns, wall_ns, turns;
static int tid;
static volatile double sink;

static int64_t clock_ns(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *step_main(void *arg) {
    (void)arg;
    __atomic_store_n(&tid, (int)syscall(SYS_gettid), __ATOMIC_RELEASE);
    pthread_setname_np(pthread_self(), "engine_step");
    double x = 1.0;
    for (;;) {
        int64_t c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID), w0 = clock_ns(CLOCK_MONOTONIC);
        for (long k = 0; k < ENGINE_WORK; k++) x = x * 1.0000001 + 1e-9;
        sink = x;
        int64_t c1 = clock_ns(CLOCK_THREAD_CPUTIME_ID), w1 = clock_ns(CLOCK_MONOTONIC);
        __atomic_add_fetch(&cpu_ns, c1 - c0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&wall_ns, w1 - w0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&steps, 1, __ATOMIC_RELEASE);
        __atomic_add_fetch(&steps32, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&waiters, __ATOMIC_SEQ_CST))
            syscall(SYS_futex, &steps32, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
    }
    return NULL;
}

static void start(void) {
    pthread_t t;
    /* Default attributes: the thread's mask and role come from its creator, as upstream's are. */
    if (pthread_create(&t, NULL, step_main, NULL) != 0) abort();
    pthread_detach(t);
    while (!__atomic_load_n(&tid, __ATOMIC_ACQUIRE)) usleep(100);
}

long engine_wait(void) {
    pthread_once(&once, start);
    __atomic_add_fetch(&turns, 1, __ATOMIC_RELAXED);
    uint32_t seen = __atomic_load_n(&steps32, __ATOMIC_ACQUIRE);
    __atomic_add_fetch(&waiters, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&steps32, __ATOMIC_SEQ_CST) == seen)
        syscall(SYS_futex, &steps32, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
    __atomic_sub_fetch(&waiters, 1, __ATOMIC_ACQ_REL);
    return (long)__atomic_load_n(&steps, __ATOMIC_ACQUIRE);
}

void engine_stats(int64_t *out) {
    out[0] = __atomic_load_n(&tid, __ATOMIC_ACQUIRE);
    out[1] = __atomic_load_n(&steps, __ATOMIC_ACQUIRE);
    out[2] = __atomic_load_n(&cpu_ns, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&wall_ns, __ATOMIC_RELAXED);
    out[4] = clock_ns(CLOCK_MONOTONIC);
    out[5] = __atomic_load_n(&turns, __ATOMIC_RELAXED);
    out[6] = ENGINE_WORK;
    out[7] = 0;
}
