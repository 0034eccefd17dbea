/* A start routine in a worker library, for lc_arenas.c: built as libnccl_park.so.2, which the
 * default TLLM_AFFINITY_WORKER_LIBS (libnccl*.so*) classifies, so a host thread starting it makes
 * a worker that the library must move onto the worker mask itself (the apply path). */
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

struct lc_park {
    int *tid;
    pthread_barrier_t *parked, *leave;
};

void *lc_park_in_worker_lib(void *p) {
    struct lc_park *a = p;
    *a->tid = (int)syscall(SYS_gettid);
    pthread_barrier_wait(a->parked);
    pthread_barrier_wait(a->leave);
    return 0;
}
