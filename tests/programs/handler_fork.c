/* A signal handler that forks (a crash reporter's or a profiler's way) while its thread is inside
 * the library (tests/common/never_hang.rs):
 *
 *   handler_fork [MS]    (default 2000)
 *
 * One thread: a SIGALRM every 200 us whose handler forks a child that _exits at once, while the
 * main thread calls sched_setaffinity in a loop (the library's shim holds the registry lock
 * across the real call). One thread, so glibc's fork takes no malloc lock: a hang is the
 * library's. Prints HANDLERFORK forks=N failed=N calls=N threads=N, then DONE.
 */
#include "agents.h"

#include <signal.h>
#include <sys/time.h>

static volatile sig_atomic_t handler_forks, handler_fork_failures;

static void fork_and_go(int sig) {
    (void)sig;
    int saved = errno;
    pid_t child = fork();
    if (child == 0) _exit(0);
    if (child > 0)
        handler_forks++;
    else
        handler_fork_failures++;
    errno = saved;
}

int main(int argc, char **argv) {
    lc_init();
    setvbuf(stdout, NULL, _IOLBF, 0);
    int ms = argc > 1 ? atoi(argv[1]) : 2000;
    /* Children reaped by the kernel: the handler need not wait for them. */
    signal(SIGCHLD, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = fork_and_go;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval every = {{0, 200}, {0, 200}};
    setitimer(ITIMER_REAL, &every, NULL);
    uint64_t until = lc_now_ns() + (uint64_t)ms * 1000000ull;
    long calls = 0;
    while (lc_now_ns() < until) {
        cpu_set_t set;
        CPU_ZERO(&set);
        syscall(SYS_sched_getaffinity, 0, sizeof set, &set);
        sched_setaffinity(0, sizeof set, &set);
        calls++;
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    lc_say("HANDLERFORK forks=%d failed=%d calls=%ld threads=%d", (int)handler_forks,
           (int)handler_fork_failures, calls, lc_task_count());
    lc_say("DONE");
    return 0;
}
