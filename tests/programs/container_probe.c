/* A small threaded program for the container images of tests/containers.rs that must run exactly
 * as without the library (musl, static, no libgcc): it starts a thread and prints the main
 * thread's and the thread's CPU masks, then whether tllm_affinity_role is in the process.
 *
 *   main=<cpus> thread=<cpus> library=<yes|no>
 *
 * Built with musl-gcc (dynamic musl), cc -static, and cc (dynamic glibc).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

static void cpus(char *out, size_t len) {
    cpu_set_t set;
    CPU_ZERO(&set);
    out[0] = '\0';
    if (sched_getaffinity(0, sizeof set, &set) != 0) {
        snprintf(out, len, "error");
        return;
    }
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (CPU_ISSET(cpu, &set)) {
            size_t used = strlen(out);
            snprintf(out + used, len - used, "%s%d", used ? "," : "", cpu);
        }
    }
}

static char thread_cpus[4096];

static void *thread(void *arg) {
    (void)arg;
    cpus(thread_cpus, sizeof thread_cpus);
    return NULL;
}

int main(void) {
    char main_cpus[4096];
    pthread_t t;
    cpus(main_cpus, sizeof main_cpus);
    if (pthread_create(&t, NULL, thread, NULL) != 0 || pthread_join(t, NULL) != 0) {
        return 3;
    }
    printf("main=%s thread=%s library=%s\n", main_cpus, thread_cpus,
           dlsym(RTLD_DEFAULT, "tllm_affinity_role") ? "yes" : "no");
    return 0;
}
