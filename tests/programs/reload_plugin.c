/* A plugin for tests/reload.rs, built from this one source under sonames of the same length
 * (libreload_worker.so.2, which the tests name in TLLM_AFFINITY_WORKER_LIBS, and
 * libreload_hosted.so.2, which they do not): both map to the same size, so the one loaded after
 * the other was unloaded lands, as a rule, at the address the first one had.
 * plugin_start() starts a thread whose start routine lives here and returns its tid;
 * plugin_stop() ends and joins it (before dlclose: its code goes away with the object). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "park.h"

static pthread_t thread;
static pid_t tid;
static int started, quit;
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;

static void *plugin_thread(void *arg) {
    (void)arg;
    tid = (pid_t)syscall(SYS_gettid); /* read by plugin_start once `started` is counted */
    park_counted(&m, &c, &started, &quit);
    return NULL;
}

/* The thread's tid, or minus pthread_create's error. */
int plugin_start(void) {
    started = quit = 0;
    int rc = pthread_create(&thread, NULL, plugin_thread, NULL);
    if (rc != 0) return -rc;
    park_until(&m, &c, &started);
    return tid;
}

void plugin_stop(void) {
    raise_flag(&m, &c, &quit);
    pthread_join(thread, NULL);
}

/* Where the start routine is, to tell whether a later plugin was mapped at this one's place. */
void *plugin_routine(void) { return (void *)plugin_thread; }
