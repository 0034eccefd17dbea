/* A shared object whose constructor starts a thread the library cannot see: it calls the
 * pthread_create that comes after it in the search order (glibc's, when it is preloaded after
 * libtllm_affinity.so), as a library bound past the interposer would. Its constructor runs
 * before the library's, so the process already has two threads when the library loads. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

static void *parked(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

__attribute__((constructor)) static void start_unseen_thread(void) {
    int (*real_create)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *) =
        (int (*)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *))dlsym(
            RTLD_NEXT, "pthread_create");
    pthread_t t;
    if (!real_create || real_create(&t, NULL, parked, NULL) != 0)
        fprintf(stderr, "unseen_early_thread: no thread started\n");
}
