/* Runs the library calls its arguments name, in order, on the main thread:
 *
 *   configure <device>   tllm_affinity_configure(device)  -> "CONFIGURE <lease>"
 *   scope <device>       tllm_affinity_begin_worker_scope -> "SCOPE <lease>"
 *   step <device>        tllm_affinity_pin_step_thread    -> "STEP <rc>"
 *   thread               makes a thread and joins it      -> "THREAD <rc>"
 *   wait                 "WAIT <pid>", then waits for a line on stdin
 *   kill                 ends the process with SIGKILL: no exit handler runs
 *
 * Without the library loaded each call answers -1. Nothing else creates a thread, so a run
 * without "thread" stays single-threaded.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int64_t call64(const char *name, int32_t arg) {
    int64_t (*f)(int32_t) = (int64_t (*)(int32_t))dlsym(RTLD_DEFAULT, name);
    return f ? f(arg) : -1;
}

static int32_t call32(const char *name, int32_t arg) {
    int32_t (*f)(int32_t) = (int32_t (*)(int32_t))dlsym(RTLD_DEFAULT, name);
    return f ? f(arg) : -1;
}

static void *nothing(void *arg) { return arg; }

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *what = argv[i];
        int device = i + 1 < argc ? atoi(argv[i + 1]) : 0;
        if (!strcmp(what, "configure")) {
            printf("CONFIGURE %lld\n", (long long)call64("tllm_affinity_configure", device));
            i++;
        } else if (!strcmp(what, "scope")) {
            printf("SCOPE %lld\n", (long long)call64("tllm_affinity_begin_worker_scope", device));
            i++;
        } else if (!strcmp(what, "step")) {
            printf("STEP %d\n", (int)call32("tllm_affinity_pin_step_thread", device));
            i++;
        } else if (!strcmp(what, "thread")) {
            pthread_t t;
            int rc = pthread_create(&t, NULL, nothing, NULL);
            if (rc == 0) pthread_join(t, NULL);
            printf("THREAD %d\n", rc);
        } else if (!strcmp(what, "wait")) {
            printf("WAIT %d\n", (int)getpid());
            fflush(stdout);
            char line[64];
            if (!fgets(line, sizeof line, stdin)) break;
        } else if (!strcmp(what, "kill")) {
            fflush(stdout);
            raise(SIGKILL);
        } else {
            fprintf(stderr, "calls: unknown action %s\n", what);
            return 64;
        }
        fflush(stdout);
    }
    return 0;
}
