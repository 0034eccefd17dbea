/* A threaded program for the old-glibc root filesystems of tests/wheel.rs, built against glibc
 * 2.17 (zig cc) so that it runs there. Threads: the main thread, a host thread, and a worker
 * that calls tllm_affinity_configure(0) and starts two children. It prints one line:
 *
 *   version=<tllm_affinity_version() or none> lease=<id> roles=<host,host,worker,worker,worker>
 *
 * The library's functions are looked up with dlsym, so the program also runs without it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int64_t (*configure_fn)(int32_t);
typedef int32_t (*role_fn)(int32_t);
typedef const char *(*version_fn)(void);

static configure_fn configure;
static role_fn role;
static int64_t lease;
static char roles[5][8];

static void note(int slot) {
    int32_t r = role ? role(0) : -1;
    snprintf(roles[slot], sizeof roles[slot], "%s", r == 0 ? "host" : r == 1 ? "worker" : "none");
}

static void *child(void *arg) {
    note((int)(intptr_t)arg);
    return NULL;
}

static void *host(void *arg) {
    (void)arg;
    note(1);
    return NULL;
}

static void *worker(void *arg) {
    (void)arg;
    lease = configure ? configure(0) : -1;
    note(2);
    pthread_t a, b;
    pthread_create(&a, NULL, child, (void *)(intptr_t)3);
    pthread_create(&b, NULL, child, (void *)(intptr_t)4);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    return NULL;
}

int main(void) {
    configure = (configure_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    role = (role_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_role");
    version_fn version = (version_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_version");
    note(0);
    pthread_t h, w;
    pthread_create(&h, NULL, host, NULL);
    pthread_join(h, NULL);
    pthread_create(&w, NULL, worker, NULL);
    pthread_join(w, NULL);
    printf("version=%s lease=%lld roles=%s,%s,%s,%s,%s\n", version ? version() : "none",
           (long long)lease, roles[0], roles[1], roles[2], roles[3], roles[4]);
    return 0;
}
