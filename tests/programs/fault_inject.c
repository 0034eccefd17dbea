/* Fault injection for tests/fault_injection.rs: one system call fails with one errno, for a
 * program and everything it runs, the way SQLite and glibc test their failure paths.
 *
 *   fault_inject <syscall name or number> <errno name or number> -- PROGRAM [ARGS...]
 *
 * installs a seccomp filter (no new privileges first, as an unprivileged process must) that
 * answers that call with SECCOMP_RET_ERRNO | errno and lets every other call through, then execs
 * PROGRAM: the loader, the preloaded library and the program all see the failure. Status 125 for
 * a usage error or a filter the kernel refused, 126 when the exec failed (the injected call may
 * be execve itself).
 *
 * Built with -shared -DFAULT_INJECT_AT_LOAD it is instead a preload object whose constructor
 * installs the same filter from FAULT_INJECT="<number> <errno>": put last in LD_PRELOAD, its
 * constructor runs after the loader has mapped everything and before the constructors of the
 * objects in front of it (the library's), so a call the loader needs (openat, mmap) fails only
 * for the library and the program.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#define FAULT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define FAULT_ARCH AUDIT_ARCH_AARCH64
#else
#error "fault_inject knows the seccomp arch of x86_64 and aarch64 only"
#endif

#ifndef FAULT_INJECT_AT_LOAD

struct name { const char *name; long value; };

/* The errnos the tier injects, and a few more for use by hand. */
static const struct name errnos[] = {
    {"EPERM", EPERM},   {"ENOENT", ENOENT}, {"EINTR", EINTR},   {"EIO", EIO},
    {"EBADF", EBADF},   {"EAGAIN", EAGAIN}, {"ENOMEM", ENOMEM}, {"EACCES", EACCES},
    {"EFAULT", EFAULT}, {"EBUSY", EBUSY},   {"EEXIST", EEXIST}, {"EINVAL", EINVAL},
    {"ENFILE", ENFILE}, {"EMFILE", EMFILE}, {"ENOSPC", ENOSPC}, {"EROFS", EROFS},
    {"ENOSYS", ENOSYS}, {"ENOLCK", ENOLCK}, {"ESRCH", ESRCH},   {"EOVERFLOW", EOVERFLOW},
};

/* Names for use by hand; the test passes numbers (it reads them from the kernel's headers, so
 * every call strace names is covered on either arch). */
#define CALL(n) {#n, SYS_##n},
static const struct name calls[] = {
#ifdef SYS_open
    CALL(open)
#endif
#ifdef SYS_clone3
    CALL(clone3)
#endif
    CALL(openat) CALL(close) CALL(read) CALL(write) CALL(mmap) CALL(munmap) CALL(mprotect)
    CALL(madvise) CALL(clone) CALL(futex) CALL(sched_setaffinity) CALL(sched_getaffinity)
    CALL(fallocate) CALL(ftruncate) CALL(flock) CALL(fstat) CALL(newfstatat) CALL(statx)
    CALL(getdents64) CALL(readlinkat) CALL(unlinkat) CALL(getrandom) CALL(prctl)
    CALL(rt_sigaction) CALL(rt_sigprocmask) CALL(set_robust_list) CALL(rseq) CALL(brk)
    CALL(execve) CALL(gettid) CALL(getpid) CALL(sched_yield) CALL(set_mempolicy) CALL(mbind)
    CALL(get_mempolicy) CALL(move_pages) CALL(pread64) CALL(lseek) CALL(fcntl) CALL(dup)
};

/* A number, or a name of `table`; -1 when it is neither. */
static long lookup(const char *word, const struct name *table, size_t n) {
    char *end;
    long value = strtol(word, &end, 10);
    if (*word && !*end) return value;
    for (size_t i = 0; i < n; i++)
        if (strcmp(word, table[i].name) == 0) return table[i].value;
    return -1;
}

#endif

static int install(long nr, long err) {
    struct sock_filter filter[] = {
        /* Another arch's numbering (a 32-bit call) is not the call asked for: allowed. */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, FAULT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nr, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ((unsigned)err & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

#ifdef FAULT_INJECT_AT_LOAD

__attribute__((constructor)) static void arm(void) {
    const char *spec = getenv("FAULT_INJECT");
    long nr, err;
    if (!spec || sscanf(spec, "%ld %ld", &nr, &err) != 2) return;
    /* A filter that did not go in would make the run a run without the fault: stop loudly. */
    if (install(nr, err) != 0) {
        perror("fault_inject: seccomp");
        _exit(125);
    }
}

#else

int main(int argc, char **argv) {
    if (argc < 5 || strcmp(argv[3], "--") != 0) {
        fprintf(stderr, "usage: %s SYSCALL ERRNO -- PROGRAM [ARGS...]\n", argv[0]);
        return 125;
    }
    long nr = lookup(argv[1], calls, sizeof calls / sizeof calls[0]);
    long err = lookup(argv[2], errnos, sizeof errnos / sizeof errnos[0]);
    if (nr < 0 || err <= 0 || err > SECCOMP_RET_DATA) {
        fprintf(stderr, "fault_inject: unknown system call '%s' or errno '%s'\n", argv[1],
                argv[2]);
        return 125;
    }
    if (install(nr, err) != 0) {
        perror("fault_inject: seccomp");
        return 125;
    }
    execvp(argv[4], argv + 4);
    /* The message may not get out (write may be the call that fails); the status does. */
    fprintf(stderr, "fault_inject: exec %s: %s\n", argv[4], strerror(errno));
    return 126;
}

#endif
