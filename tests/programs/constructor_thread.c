/* A shared object whose constructor starts a thread: loaded before libtllm_affinity.so (in
 * LD_PRELOAD, or linked into the program), its thread may be created before the library's own
 * constructor has run. The thread parks for the process's life; lc_early_tid() names it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

static pid_t early_tid;
static int started;
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;

static void *early_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&m);
    early_tid = (pid_t)syscall(SYS_gettid);
    started = 1;
    pthread_cond_broadcast(&c);
    pthread_mutex_unlock(&m);
    for (;;) pause();
    return NULL;
}

__attribute__((constructor)) static void lc_early_start(void) {
    pthread_t t;
    int rc = pthread_create(&t, NULL, early_main, NULL);
    if (rc != 0) {
        fprintf(stderr, "lc_early: pthread_create -> %d\n", rc);
        return;
    }
    pthread_mutex_lock(&m);
    while (!started) pthread_cond_wait(&c, &m);
    pthread_mutex_unlock(&m);
}

pid_t lc_early_tid(void) { return early_tid; }
