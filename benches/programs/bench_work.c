/* A start routine that lives in a "worker library" (matched by TLLM_AFFINITY_WORKER_LIBS in the
 * benchmark), so a host creator's child must be moved onto the worker mask: the apply path. */
void *bench_work_routine(void *arg) { return arg; }
