/* The threads a program names in its PHASE lines: note() records the calling thread (note_tid()
 * another), wait_for_count() waits until so many are named. `lock` and `changed` also guard the
 * program's own shared state, as they did when each program had its own copy. */
#ifndef TLLM_NAMED_THREADS_H
#define TLLM_NAMED_THREADS_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_THREADS 64
static struct { char name[16]; pid_t tid; } threads[MAX_THREADS];
static int n_threads;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;

static void note_tid(const char *name, pid_t tid) {
    pthread_mutex_lock(&lock);
    if (n_threads < MAX_THREADS) {
        snprintf(threads[n_threads].name, sizeof threads[n_threads].name, "%s", name);
        threads[n_threads].tid = tid;
        n_threads++;
    }
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
}

static void note(const char *name) { note_tid(name, (pid_t)syscall(SYS_gettid)); }

static void wait_for_count(int n) {
    pthread_mutex_lock(&lock);
    while (n_threads < n) pthread_cond_wait(&changed, &lock);
    pthread_mutex_unlock(&lock);
}

#endif
