/* A start routine that lives in a worker library, for malloc_arenas.c and churn_stress.c. Built as
 * libnccl_routine.so.2, which the default TLLM_AFFINITY_WORKER_LIBS (libnccl*.so*) classifies: a
 * thread started on it is a worker whoever creates it, and a host creating one takes the apply
 * path (the new thread moves itself onto the worker mask). It runs the program's own function
 * from the closure it is given. */
struct lc_closure {
    void *(*fn)(void *);
    void *arg;
};

void *lc_in_worker_lib(void *closure) {
    struct lc_closure *c = closure;
    return c->fn(c->arg);
}
