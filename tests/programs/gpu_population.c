/* A mixed population that configures one GPU after another, for the NVML tests and
 * scripts/device-check (which carries it, prebuilt, to a GPU host without a compiler).
 *
 * Threads: the main thread and H, a host thread started first; for each device named on the
 * command line, W (a thread that calls tllm_affinity_configure(device)) and C, a thread W creates
 * after configuring (born a worker). Per device it prints one line
 *
 *   DEVICE <device> LEASE <lease or -errno> WORKER <W's mask> CHILD <C's mask> HOST <H's mask>
 *
 * with masks as cpulists read from the kernel, then releases the lease. An argument "fork" forks
 * there: the child goes on with the rest (with a new H), the parent waits for it and exits with
 * its status. The library's functions
 * are looked up with dlsym, so the binary runs (and says so) without it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "abi.h"
#include "cpulist.h"
#include "park.h"

static void own_mask(char *out, size_t len) {
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof set, &set);
    cpulist(&set, out, len);
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int quit;

static void *host(void *arg) {
    (void)arg;
    park_until(&lock, &changed, &quit);
    return NULL;
}

static void *child(void *arg) {
    own_mask((char *)arg, 8192);
    return NULL;
}

struct job { int device; int64_t lease; char worker[8192]; char child[8192]; };

static void *worker(void *arg) {
    struct job *j = arg;
    j->lease = tllm_configure(j->device);
    own_mask(j->worker, sizeof j->worker);
    pthread_t c;
    pthread_create(&c, NULL, child, j->child);
    pthread_join(c, NULL);
    return NULL;
}

int main(int argc, char **argv) {
    tllm_abi_load();
    tllm_abi_require(tllm_configure && tllm_release);
    pthread_t h;
    pthread_create(&h, NULL, host, NULL);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "fork") == 0) {
            fflush(stdout);
            pid_t pid = fork();
            if (pid > 0) {
                int status = 0;
                waitpid(pid, &status, 0);
                return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
            }
            /* Only the forking thread lives on in the child: a new host thread. */
            pthread_create(&h, NULL, host, NULL);
            continue;
        }
        static struct job j;
        memset(&j, 0, sizeof j);
        j.device = atoi(argv[i]);
        pthread_t w;
        pthread_create(&w, NULL, worker, &j);
        pthread_join(w, NULL);
        cpu_set_t set;
        CPU_ZERO(&set);
        pthread_getaffinity_np(h, sizeof set, &set);
        char hostmask[8192];
        cpulist(&set, hostmask, sizeof hostmask);
        printf("DEVICE %d LEASE %lld WORKER %s CHILD %s HOST %s\n", j.device, (long long)j.lease,
               j.worker, j.child, hostmask);
        fflush(stdout);
        if (j.lease > 0) tllm_release(j.lease);
    }
    raise_flag(&lock, &changed, &quit);
    pthread_join(h, NULL);
    return 0;
}
