/* Children made by glibc's _Fork() (no fork handlers run), in a process whose table is mapped:
 *
 *   fork_without_handlers exit     the child exits through exit(), running the exit handlers
 *                                  it inherited; prints "TABLE <path> before=<0|1> after=<0|1>"
 *   fork_without_handlers thread   the child creates a thread and stays; prints "CHILD <pid>
 *                                  <thread tid>" once it runs, then "TABLE <path>"
 *
 * Then each waits for a line on stdin (the test reads the parent's table meanwhile). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void *nothing(void *arg) { return arg; }

static int ready[2];
static void *parked(void *arg) {
    (void)arg;
    pid_t tid = (pid_t)syscall(SYS_gettid);
    if (write(ready[1], &tid, sizeof tid) != sizeof tid) _exit(3);
    for (;;) pause();
    return NULL;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "exit";
    pthread_t t;
    /* The first thread creation maps the table. */
    pthread_create(&t, NULL, nothing, NULL);
    pthread_join(t, NULL);
    char path[160];
    struct stat ns;
    if (stat("/proc/self/ns/pid", &ns) != 0) return 3;
    snprintf(path, sizeof path, "/dev/shm/tllm-affinity.%llu.%d.threads",
             (unsigned long long)ns.st_ino, (int)getpid());
    int before = access(path, F_OK) == 0;
    if (pipe(ready) != 0) return 3;
    pid_t pid = _Fork();
    if (pid == 0) {
        if (!strcmp(mode, "exit")) exit(0);
        pthread_t p;
        pthread_create(&p, NULL, parked, NULL);
        for (;;) pause();
    }
    int status;
    if (!strcmp(mode, "exit")) {
        waitpid(pid, &status, 0);
    } else {
        pid_t tid = 0;
        if (read(ready[0], &tid, sizeof tid) != sizeof tid) return 3;
        printf("CHILD %d %d\n", (int)pid, (int)tid);
    }
    int after = access(path, F_OK) == 0;
    printf("TABLE %s before=%d after=%d\n", path, before, after);
    fflush(stdout);
    char line[8];
    char *answered = fgets(line, sizeof line, stdin);
    if (strcmp(mode, "exit")) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    return answered ? 0 : 0;
}
