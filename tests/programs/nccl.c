/* Stands in for a communication library (NCCL, UCX, MPI) whose progress threads the library must
 * recognise by the object their start routine lives in. Built as libnccl.so.2, so that the default TLLM_AFFINITY_WORKER_LIBS matches it. */
#include <pthread.h>
#include <unistd.h>

static void (*note)(const char *);
static volatile int stop;

void fake_nccl_set_note(void (*fn)(const char *)) { note = fn; }

void *fake_nccl_progress(void *name) {
    if (note) note((const char *)name);
    while (!stop) pause();
    return 0;
}
