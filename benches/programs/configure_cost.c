/* The cost of tllm_affinity_configure on one thread: the first call (which resolves the device:
 * NVML loaded and asked, sysfs read) and later calls (the cached set), each followed by an untimed
 * release. Prints "first_ns <n> later_ns <median of the later calls> lease <first lease>". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int later = argc > 1 ? atoi(argv[1]) : 200;
    int64_t (*configure)(int32_t) = (int64_t(*)(int32_t))dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    int32_t (*release)(int64_t) = (int32_t(*)(int64_t))dlsym(RTLD_DEFAULT, "tllm_affinity_release");
    if (!configure || !release || later < 1) return 2;
    int64_t start = now_ns();
    int64_t first_lease = configure(0);
    int64_t first = now_ns() - start;
    if (first_lease > 0) release(first_lease);
    int64_t *t = calloc((size_t)later, sizeof *t);
    for (int i = 0; i < later; i++) {
        start = now_ns();
        int64_t lease = configure(0);
        t[i] = now_ns() - start;
        if (lease > 0) release(lease);
    }
    qsort(t, (size_t)later, sizeof *t, cmp);
    printf("first_ns %lld later_ns %lld lease %lld\n", (long long)first, (long long)t[later / 2],
           (long long)first_lease);
    return 0;
}
