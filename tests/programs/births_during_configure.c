/* Threads born while configure sweeps the process (tests/runtimes.rs): the worker thread W has
 * a child C that keeps creating threads (G0, G1, ...) while W calls tllm_affinity_configure.
 * Every G is a descendant of W, so every G must end up a worker on the worker mask, whether it
 * was born before configure (promoted), after it (inherits the worker role), or across it.
 *
 * Prints "PHASE configured <thread>=<tid>:<role> ..." once C has made RT_RACE_AFTER (default
 * 20) more threads after configure returned, waits for a line on stdin, and exits. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef int64_t (*configure_fn)(int32_t);
typedef int32_t (*role_fn)(int32_t);

#define MAX 2048
static pid_t tids[MAX];
static int n;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int quit, configured_at = -1;

static void note(void) {
    pthread_mutex_lock(&lock);
    if (n < MAX) tids[n++] = (pid_t)syscall(SYS_gettid);
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
}

static void *parked(void *unused) {
    (void)unused;
    note();
    pthread_mutex_lock(&lock);
    while (!quit) pthread_cond_wait(&changed, &lock);
    pthread_mutex_unlock(&lock);
    return NULL;
}

static int after_count;

static void *creator(void *unused) {
    (void)unused;
    for (;;) {
        pthread_mutex_lock(&lock);
        int done = configured_at >= 0 && n >= configured_at + after_count;
        int full = n >= MAX - 1;
        pthread_mutex_unlock(&lock);
        if (done || full) break;
        pthread_t t;
        if (pthread_create(&t, NULL, parked, NULL) != 0) break;
        pthread_detach(t);
    }
    pthread_mutex_lock(&lock);
    quit = quit ? quit : 0;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return NULL;
}

static configure_fn tllm_configure;

static void *worker(void *unused) {
    (void)unused;
    pthread_t c;
    pthread_create(&c, NULL, creator, NULL);
    pthread_mutex_lock(&lock);
    while (n < 20) pthread_cond_wait(&changed, &lock);
    pthread_mutex_unlock(&lock);
    int64_t lease = tllm_configure ? tllm_configure(0) : -1;
    pthread_mutex_lock(&lock);
    configured_at = n;
    pthread_mutex_unlock(&lock);
    fprintf(stderr, "configure -> %lld\n", (long long)lease);
    pthread_join(c, NULL);
    return NULL;
}

int main(void) {
    tllm_configure = (configure_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    role_fn role = (role_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_role");
    after_count = getenv("RT_RACE_AFTER") ? atoi(getenv("RT_RACE_AFTER")) : 20;
    pthread_t w;
    pthread_create(&w, NULL, worker, NULL);
    pthread_join(w, NULL);
    pthread_mutex_lock(&lock);
    printf("PHASE configured");
    for (int i = 0; i < n; i++)
        printf(" G%d=%d:%d", i, tids[i], role ? role(tids[i]) : -1);
    printf("\n");
    fflush(stdout);
    pthread_mutex_unlock(&lock);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 3;
    pthread_mutex_lock(&lock);
    quit = 1;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
    return 0;
}
