/* Starts "native progress threads" for the deployment programs (tests/programs/deploy_*.py),
 * as a communication library's init would: spawn_progress(fn, name) calls pthread_create from
 * the calling thread with start routine fn (fake_nccl_progress, which lives in libnccl.so.2, a
 * TLLM_AFFINITY_WORKER_LIBS object) and returns the new thread's tid once it has noted itself
 * through rt_note (installed as the fake library's note callback with fake_nccl_set_note). The
 * pthread_create call itself is made here, in an object that is not a worker library: only the
 * start routine decides. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_NOTES 64
static struct { char *name; int tid; } notes[MAX_NOTES];
static int n_notes;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;

void rt_note(const char *name) {
    pthread_mutex_lock(&lock);
    if (n_notes < MAX_NOTES) {
        notes[n_notes].name = (char *)name;
        notes[n_notes].tid = (int)syscall(SYS_gettid);
        n_notes++;
    }
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&lock);
}

int spawn_progress(void *(*fn)(void *), const char *name) {
    char *copy = strdup(name);
    pthread_t t;
    if (!copy || pthread_create(&t, NULL, fn, copy) != 0) return -1;
    pthread_detach(t);
    int tid = 0;
    pthread_mutex_lock(&lock);
    while (!tid) {
        for (int i = 0; i < n_notes; i++)
            if (notes[i].name == copy) tid = notes[i].tid;
        if (!tid) pthread_cond_wait(&changed, &lock);
    }
    pthread_mutex_unlock(&lock);
    return tid;
}
