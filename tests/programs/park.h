/* Threads that must stay alive until a program is done with them wait on a flag under a mutex
 * and condition variable; raising it wakes them all. */
#ifndef TLLM_PARK_H
#define TLLM_PARK_H

#include <pthread.h>

/* Not every program uses every one. */
__attribute__((unused)) static void park_until(pthread_mutex_t *m, pthread_cond_t *c, const int *flag) {
    pthread_mutex_lock(m);
    while (!*flag) pthread_cond_wait(c, m);
    pthread_mutex_unlock(m);
}

__attribute__((unused)) static void raise_flag(pthread_mutex_t *m, pthread_cond_t *c, int *flag) {
    pthread_mutex_lock(m);
    *flag = 1;
    pthread_cond_broadcast(c);
    pthread_mutex_unlock(m);
}

/* park_until, counting itself in first, so that whoever started the thread can wait for it. */
__attribute__((unused)) static void park_counted(pthread_mutex_t *m, pthread_cond_t *c, int *count,
                                                 const int *flag) {
    pthread_mutex_lock(m);
    (*count)++;
    pthread_cond_broadcast(c);
    while (!*flag) pthread_cond_wait(c, m);
    pthread_mutex_unlock(m);
}

#endif
