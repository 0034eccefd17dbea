/* tests/device_variables.rs: a dedicated worker's vfork child sets CUDA_VISIBLE_DEVICES before it
 * exits; it shares the worker's memory (environ included) but is not the worker. Phases:
 *   vforked   after the child exited: main and T
 *   set       after the worker itself set CUDA_VISIBLE_DEVICES=1
 * then `ERRNO setenv=<rc>/<errno> unsetenv=<rc>/<errno>` for a name with '=' in it (EINVAL). */
#include "agents.h"
#include "park.h"
#include <sys/wait.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static int quit;

static void *parked(void *unused) {
    (void)unused;
    note("T");
    park_until(&lock, &cond, &quit);
    return NULL;
}

int main(void) {
    lc_init();
    note("main");
    pthread_t t;
    pthread_create(&t, NULL, parked, NULL);
    while (lc_n_named < 2) usleep(1000);
    pid_t child = vfork();
    if (child == 0) {
        setenv("CUDA_VISIBLE_DEVICES", "1", 1);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    phase("vforked");
    setenv("CUDA_VISIBLE_DEVICES", "1", 1);
    phase("set");
    errno = 0;
    int rc = setenv("BAD=NAME", "1", 1);
    int e1 = errno;
    errno = 0;
    int rc2 = unsetenv("BAD=NAME");
    int e2 = errno;
    lc_say("ERRNO setenv=%d/%d unsetenv=%d/%d", rc, e1, rc2, e2);
    raise_flag(&lock, &cond, &quit);
    pthread_join(t, NULL);
    return 0;
}
