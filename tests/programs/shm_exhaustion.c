/* A program whose /dev/shm runs out while it runs, as a container's 64 MiB /dev/shm does when
 * NCCL or DataLoader workers fill it. Its steps, in the order its arguments give:
 *
 *   thread           makes a thread and joins it (the library maps its table here)  -> "THREAD"
 *   fill             fills the directory of $FILL_DIR (default /dev/shm) with a file until
 *                    ENOSPC, so that no page is left                                -> "FILLED <bytes>"
 *   live <n>         starts n threads that stay alive until the end                 -> "LIVE <n>"
 *   configure <dev>  tllm_affinity_configure(dev)                                   -> "CONFIGURE <ok|rc>"
 *   note             tllm_affinity_note_adapter("probe", "ready")                   -> "NOTE <rc>"
 *   worker           makes a thread and joins it, reporting its CPU count           -> "WORKER <cpus>"
 *   first-birth      times the process's first pthread_create + join                -> "FIRST_BIRTH_US <us>"
 *   wait             "WAIT <pid>", then waits for a line on stdin
 *
 * Without the library each library call answers -1; every other step is the same, so a run with
 * the library must print what a run without it prints, but for the library calls' answers.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t hold = PTHREAD_MUTEX_INITIALIZER;

static void *nothing(void *arg) { return arg; }

static void *held(void *arg) {
    pthread_mutex_lock(&hold);
    pthread_mutex_unlock(&hold);
    return arg;
}

static void *cpus(void *arg) {
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof set, &set);
    *(int *)arg = CPU_COUNT(&set);
    return NULL;
}

static int64_t call64(const char *name, int32_t arg) {
    int64_t (*f)(int32_t) = (int64_t (*)(int32_t))dlsym(RTLD_DEFAULT, name);
    return f ? f(arg) : -1;
}

static long fill(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/shm_exhaustion.fill.%d", dir, (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        perror("fill: open");
        exit(2);
    }
    static char page[4096];
    long written = 0;
    for (;;) {
        ssize_t n = write(fd, page, sizeof page);
        if (n <= 0)
            break;
        written += n;
    }
    close(fd);
    return written;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    pthread_t live[4096];
    int nlive = 0;
    pthread_mutex_lock(&hold);
    for (int i = 1; i < argc; i++) {
        const char *step = argv[i];
        if (!strcmp(step, "thread")) {
            pthread_t t;
            if (pthread_create(&t, NULL, nothing, NULL) != 0) {
                printf("THREAD failed\n");
                return 3;
            }
            pthread_join(t, NULL);
            printf("THREAD\n");
        } else if (!strcmp(step, "fill")) {
            const char *dir = getenv("FILL_DIR");
            printf("FILLED %s\n", fill(dir ? dir : "/dev/shm") > 0 ? "some" : "none");
        } else if (!strcmp(step, "live") && i + 1 < argc) {
            int n = atoi(argv[++i]);
            for (int k = 0; k < n && nlive < 4096; k++) {
                if (pthread_create(&live[nlive], NULL, held, NULL) != 0) {
                    printf("LIVE failed at %d\n", k);
                    return 3;
                }
                nlive++;
            }
            printf("LIVE %d\n", n);
        } else if (!strcmp(step, "configure") && i + 1 < argc) {
            int64_t rc = call64("tllm_affinity_configure", atoi(argv[++i]));
            printf("CONFIGURE %s\n", rc > 0 ? "ok" : "refused");
        } else if (!strcmp(step, "note")) {
            int32_t (*f)(const char *, const char *) =
                (int32_t (*)(const char *, const char *))dlsym(RTLD_DEFAULT,
                                                               "tllm_affinity_note_adapter");
            printf("NOTE %d\n", f ? f("probe", "ready") : -1);
        } else if (!strcmp(step, "worker")) {
            pthread_t t;
            int n = 0;
            if (pthread_create(&t, NULL, cpus, &n) != 0) {
                printf("WORKER failed\n");
                return 3;
            }
            pthread_join(t, NULL);
            printf("WORKER %d\n", n);
        } else if (!strcmp(step, "first-birth")) {
            struct timespec a, b;
            pthread_t t;
            clock_gettime(CLOCK_MONOTONIC, &a);
            if (pthread_create(&t, NULL, nothing, NULL) != 0)
                return 3;
            pthread_join(t, NULL);
            clock_gettime(CLOCK_MONOTONIC, &b);
            long us = (b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000;
            printf("FIRST_BIRTH_US %ld\n", us);
        } else if (!strcmp(step, "wait")) {
            printf("WAIT %d\n", (int)getpid());
            char line[16];
            if (!fgets(line, sizeof line, stdin))
                return 4;
        } else {
            fprintf(stderr, "shm_exhaustion: unknown step %s\n", step);
            return 2;
        }
    }
    pthread_mutex_unlock(&hold);
    for (int k = 0; k < nlive; k++)
        pthread_join(live[k], NULL);
    printf("DONE\n");
    return 0;
}
