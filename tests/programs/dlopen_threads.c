/* A shared object whose constructor starts three threads and waits until each has started: the
 * constructor runs inside dlopen, with the loader lock held, so a library whose new threads
 * needed the loader would hang here. lc_dl_tids() names the threads, which park for good. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#define N 3
static pid_t tids[N];
static int started;
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;

static void *dl_thread(void *arg) {
    pthread_mutex_lock(&m);
    tids[(long)arg] = (pid_t)syscall(SYS_gettid);
    started++;
    pthread_cond_broadcast(&c);
    pthread_mutex_unlock(&m);
    for (;;) pause();
    return NULL;
}

__attribute__((constructor)) static void lc_dl_start(void) {
    for (long i = 0; i < N; i++) {
        pthread_t t;
        int rc = pthread_create(&t, NULL, dl_thread, (void *)i);
        if (rc != 0) {
            fprintf(stderr, "dlopen_threads: pthread_create -> %d\n", rc);
            return;
        }
    }
    pthread_mutex_lock(&m);
    while (started < N) pthread_cond_wait(&c, &m);
    pthread_mutex_unlock(&m);
}

int lc_dl_tids(pid_t *out, int max) {
    int n = 0;
    pthread_mutex_lock(&m);
    for (; n < N && n < max; n++) out[n] = tids[n];
    pthread_mutex_unlock(&m);
    return n;
}
