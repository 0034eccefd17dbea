/* A child made by glibc's _Fork() (no fork handlers run) exits through exit(): the atexit
 * handlers it inherited run in it. It must leave its parent's thread table alone.
 * Prints "TABLE <path> before=<0|1> after=<0|1>", then waits for a line on stdin. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void *nothing(void *arg) { return arg; }

int main(void) {
    pthread_t t;
    /* The first thread creation maps the table. */
    pthread_create(&t, NULL, nothing, NULL);
    pthread_join(t, NULL);
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/tllm-affinity.%d.threads", (int)getpid());
    int before = access(path, F_OK) == 0;
    pid_t pid = _Fork();
    if (pid == 0) exit(0);
    int status;
    waitpid(pid, &status, 0);
    int after = access(path, F_OK) == 0;
    printf("TABLE %s before=%d after=%d\n", path, before, after);
    fflush(stdout);
    char line[8];
    if (!fgets(line, sizeof line, stdin)) return 0;
    return 0;
}
