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

/* Sets `*value` and wakes every waiter. */
__attribute__((unused)) static void set_and_wake(pthread_mutex_t *m, pthread_cond_t *c, int *value,
                                                 int to) {
    pthread_mutex_lock(m);
    *value = to;
    pthread_cond_broadcast(c);
    pthread_mutex_unlock(m);
}

__attribute__((unused)) static void raise_flag(pthread_mutex_t *m, pthread_cond_t *c, int *flag) {
    set_and_wake(m, c, flag, 1);
}

/* A count threads add themselves to (count_in) while whoever started them waits for it to reach n
 * (wait_count); also a step counter that only grows (set_and_wake, wait_count). */
__attribute__((unused)) static void count_in(pthread_mutex_t *m, pthread_cond_t *c, int *count) {
    pthread_mutex_lock(m);
    (*count)++;
    pthread_cond_broadcast(c);
    pthread_mutex_unlock(m);
}

__attribute__((unused)) static void wait_count(pthread_mutex_t *m, pthread_cond_t *c, const int *count,
                                               int n) {
    pthread_mutex_lock(m);
    while (*count < n) pthread_cond_wait(c, m);
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
