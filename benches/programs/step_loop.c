/* The step loop of scripts/bench --server: a step thread hands each iteration to a result thread
 * while host threads load the CPUs.
 *
 * usage: step_loop <iterations> <host threads>
 *
 * The step thread computes one step (~50 µs of arithmetic), stamps the hand-off, bumps a futex
 * word and wakes the result thread, then waits (futex) until the result thread has taken the
 * iteration: an engine whose next step needs the last step's output handed on. The result thread
 * wakes, stamps, acknowledges. Each host thread loops on ~300 µs of arithmetic then a ~200 µs
 * sleep (request handlers between packets). The step thread calls tllm_affinity_pin_step_thread(0)
 * and the result thread tllm_affinity_pin_result_thread(0) first, looked up with dlsym (the C ABI
 * the Python module's pin_step_thread calls): with TLLM_AFFINITY_STEP_CORE unset they pin nothing,
 * so the two runs differ by that variable alone.
 *
 * Prints "handoff_p50_ns N handoff_p99_ns N iter_p50_ns N iter_p99_ns N step_rc N result_rc N
 * step_cpu N result_cpu N": the hand-off (stamp to result thread running) and the iteration (step
 * start to the next step start), percentiles over the iterations after the first 200. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int (*pin_step)(int);
static int (*pin_result)(int);
static long iterations;
static uint32_t posted, taken; /* futex words */
static volatile int stop_hosts;
static uint64_t *post_ns, *woke_ns, *start_ns;
static int step_rc, result_rc, step_cpu = -1, result_cpu = -1;
static volatile double sink;

static uint64_t now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void fwait(uint32_t *word, uint32_t seen) {
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == seen)
        syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void fpost(uint32_t *word) {
    __atomic_add_fetch(word, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void spin_ns(uint64_t ns) {
    uint64_t end = now() + ns;
    double x = 1.0;
    while (now() < end)
        for (int k = 0; k < 64; k++) x = x * 1.0000001 + 1e-9;
    sink = x;
}

static void *result_main(void *arg) {
    (void)arg;
    result_rc = pin_result ? pin_result(0) : -1;
    result_cpu = sched_getcpu();
    for (long i = 0; i < iterations; i++) {
        fwait(&posted, (uint32_t)i);
        woke_ns[i] = now();
        fpost(&taken);
    }
    return NULL;
}

static void *step_main(void *arg) {
    (void)arg;
    step_rc = pin_step ? pin_step(0) : -1;
    step_cpu = sched_getcpu();
    for (long i = 0; i < iterations; i++) {
        start_ns[i] = now();
        spin_ns(50000);
        post_ns[i] = now();
        fpost(&posted);
        fwait(&taken, (uint32_t)i);
    }
    return NULL;
}

static void *host_main(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg;
    while (!stop_hosts) {
        spin_ns(200000 + rand_r(&seed) % 200000);
        usleep(100 + rand_r(&seed) % 200);
    }
    return NULL;
}

static int cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t pct(uint64_t *v, long n, int p) { return v[(n - 1) * p / 100]; }

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: step_loop <iterations> <host threads>\n");
        return 2;
    }
    iterations = atol(argv[1]);
    int hosts = atoi(argv[2]);
    pin_step = (int (*)(int))dlsym(RTLD_DEFAULT, "tllm_affinity_pin_step_thread");
    pin_result = (int (*)(int))dlsym(RTLD_DEFAULT, "tllm_affinity_pin_result_thread");
    post_ns = calloc(iterations, 8);
    woke_ns = calloc(iterations, 8);
    start_ns = calloc(iterations, 8);
    pthread_t host[64], step, result;
    for (int h = 0; h < hosts && h < 64; h++)
        pthread_create(&host[h], NULL, host_main, (void *)(uintptr_t)(h + 1));
    pthread_create(&result, NULL, result_main, NULL);
    pthread_create(&step, NULL, step_main, NULL);
    pthread_join(step, NULL);
    pthread_join(result, NULL);
    stop_hosts = 1;
    for (int h = 0; h < hosts && h < 64; h++) pthread_join(host[h], NULL);
    long skip = iterations > 400 ? 200 : 0, n = iterations - skip - 1;
    uint64_t *hand = calloc(n, 8), *iter = calloc(n, 8);
    for (long i = 0; i < n; i++) {
        hand[i] = woke_ns[skip + i] - post_ns[skip + i];
        iter[i] = start_ns[skip + i + 1] - start_ns[skip + i];
    }
    qsort(hand, n, 8, cmp);
    qsort(iter, n, 8, cmp);
    printf("handoff_p50_ns %llu handoff_p99_ns %llu iter_p50_ns %llu iter_p99_ns %llu step_rc %d "
           "result_rc %d step_cpu %d result_cpu %d\n",
           (unsigned long long)pct(hand, n, 50), (unsigned long long)pct(hand, n, 99),
           (unsigned long long)pct(iter, n, 50), (unsigned long long)pct(iter, n, 99), step_rc,
           result_rc, step_cpu, result_cpu);
    return 0;
}
