/* Step and result threads, and masks across a CPU coming back online (tests/guest.rs runs it
 * inside a guest where a CPU is offline; it runs on any Linux).
 *
 * Threads: main and H (host threads the library never touches), W (calls
 * tllm_affinity_configure(device)), ST and RT (W's children, born workers, which then pin
 * themselves as the device's step and result threads), and T, a host thread that writes its own
 * mask (the one it has) with sched_setaffinity while the CPU is offline: what the kernel does
 * with any mask written then. The lease is released, then the program prints READY and waits
 * for a line on stdin (the guest script brings the CPU online there), and prints the masks
 * again, with N, a thread created after the CPU came back.
 *
 *   PIN step <rc> result <rc>
 *   MASK <phase> <thread> <cpulist>          phase: configured, released, online
 *   REPORT <the library's JSON report while configured>
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
#include <unistd.h>
#include "abi.h"
#include "cpulist.h"
#include "park.h"

static int device;
static pid_t tids[7];
static const char *names[7] = {"main", "H", "W", "ST", "RT", "T", "N"};
static int step_rc = -999, result_rc = -999;
static int64_t lease;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int ready, quit;

static void mark_ready(void) { count_in(&lock, &changed, &ready); }
static void wait_ready(int n) { wait_count(&lock, &changed, &ready, n); }

static void wait_quit(void) { park_until(&lock, &changed, &quit); }

static pid_t gettid_(void) { return (pid_t)syscall(SYS_gettid); }

static void masks(const char *phase, int count) {
    for (int i = 0; i < count; i++) {
        cpu_set_t set;
        CPU_ZERO(&set);
        char list[1024] = "gone";
        if (sched_getaffinity(tids[i], sizeof set, &set) == 0) cpulist(&set, list, sizeof list);
        printf("MASK %s %s %s\n", phase, names[i], list);
    }
    fflush(stdout);
}

/* H (slot 1) and N (slot 6): a thread that only lives. */
static void *parked_thread(void *slot) {
    tids[(intptr_t)slot] = gettid_();
    mark_ready();
    wait_quit();
    return NULL;
}

/* ST (slot 3) and RT (slot 4): W's children, which pin themselves as the device's step or
 * result thread. */
static void *pinned_thread(void *slot) {
    tids[(intptr_t)slot] = gettid_();
    if ((intptr_t)slot == 3)
        step_rc = tllm_pin_step(device);
    else
        result_rc = tllm_pin_result(device);
    mark_ready();
    wait_quit();
    return NULL;
}

static void *worker_thread(void *arg) {
    (void)arg;
    tids[2] = gettid_();
    lease = tllm_configure(device);
    pthread_t st, rt;
    pthread_create(&st, NULL, pinned_thread, (void *)3);
    pthread_create(&rt, NULL, pinned_thread, (void *)4);
    mark_ready();
    wait_quit();
    pthread_join(st, NULL);
    pthread_join(rt, NULL);
    return NULL;
}

static void *self_set_thread(void *arg) {
    (void)arg;
    tids[5] = gettid_();
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof set, &set);
    sched_setaffinity(0, sizeof set, &set);
    mark_ready();
    wait_quit();
    return NULL;
}

int main(int argc, char **argv) {
    device = argc > 1 ? atoi(argv[1]) : 0;
    tllm_abi_load();
    tllm_abi_require(tllm_configure && tllm_release && tllm_pin_step && tllm_pin_result &&
                     tllm_report);
    tids[0] = gettid_();
    pthread_t h, t, w, n;
    pthread_create(&h, NULL, parked_thread, (void *)1);
    pthread_create(&t, NULL, self_set_thread, NULL);
    wait_ready(2);
    pthread_create(&w, NULL, worker_thread, NULL);
    wait_ready(5); /* W configured, ST and RT pinned */
    printf("PIN step %d result %d\nLEASE %lld\n", step_rc, result_rc, (long long)lease);
    masks("configured", 6);
    static char json[1 << 16];
    int64_t need = tllm_report(json, sizeof json);
    if (need > 0 && (size_t)need < sizeof json) printf("REPORT %s\n", json);
    if (lease > 0) tllm_release(lease);
    masks("released", 6);
    printf("READY\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 4;
    pthread_create(&n, NULL, parked_thread, (void *)6);
    wait_ready(6);
    masks("online", 7);
    raise_flag(&lock, &changed, &quit);
    pthread_join(w, NULL);
    pthread_join(h, NULL);
    pthread_join(t, NULL);
    pthread_join(n, NULL);
    return 0;
}
