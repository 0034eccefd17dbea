/* One Slurm task of tests/slurm.rs: a mixed population. The main thread starts a host thread
 * `host`; thread `worker` calls configure(-1) (the device comes from SLURM_LOCALID) and starts
 * `worker_child`; the main thread then starts `host_late`. With every thread alive it prints
 *
 *   TASK rank=<SLURM_LOCALID> lease=<configure's answer> cpuset=<list> main=<mask>:<role> ...
 *   REPORT task <json>
 *
 * (masks from sched_getaffinity, roles from tllm_affinity_role, the cpuset from the cgroup v1
 * file of /proc/self/cpuset, `-` where there is none) and ends. */
#include "agents.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static int quit;
static int up;
static pid_t tids[5];
static int64_t lease;

static void wait_for_quit(void) {
    pthread_mutex_lock(&lock);
    up++;
    pthread_cond_broadcast(&cond);
    while (!quit) pthread_cond_wait(&cond, &lock);
    pthread_mutex_unlock(&lock);
}

static void wait_up(int n) {
    pthread_mutex_lock(&lock);
    while (up < n) pthread_cond_wait(&cond, &lock);
    pthread_mutex_unlock(&lock);
}

static void *parked(void *slot) {
    tids[(intptr_t)slot] = lc_tid();
    wait_for_quit();
    return NULL;
}

static void *worker(void *unused) {
    (void)unused;
    tids[2] = lc_tid();
    lease = lc_configure(-1);
    pthread_t child;
    pthread_create(&child, NULL, parked, (void *)(intptr_t)3);
    wait_for_quit();
    pthread_join(child, NULL);
    return NULL;
}

/* The CPUs of this process's cpuset cgroup, read from the kernel's files. */
static void cpuset_cpus(char *out, size_t len) {
    snprintf(out, len, "-");
    char path[512] = {0}, file[700];
    FILE *f = fopen("/proc/self/cpuset", "r");
    if (!f) return;
    if (!fgets(path, sizeof path, f)) path[0] = 0;
    fclose(f);
    path[strcspn(path, "\n")] = 0;
    snprintf(file, sizeof file, "/sys/fs/cgroup/cpuset%s/cpuset.cpus", path);
    f = fopen(file, "r");
    if (!f) return;
    if (!fgets(out, (int)len, f)) snprintf(out, len, "-");
    fclose(f);
    out[strcspn(out, "\n")] = 0;
}

int main(void) {
    lc_init();
    tids[0] = lc_tid();
    pthread_t host, work, late;
    pthread_create(&host, NULL, parked, (void *)(intptr_t)1);
    wait_up(1);
    pthread_create(&work, NULL, worker, NULL);
    wait_up(3);
    pthread_create(&late, NULL, parked, (void *)(intptr_t)4);
    wait_up(4);
    static const char *names[5] = {"main", "host", "worker", "worker_child", "host_late"};
    char line[2048];
    const char *rank = getenv("SLURM_LOCALID");
    char cpuset[512];
    cpuset_cpus(cpuset, sizeof cpuset);
    int used = snprintf(line, sizeof line, "TASK rank=%s lease=%lld cpuset=%s", rank ? rank : "-",
                        (long long)lease, cpuset);
    for (int i = 0; i < 5; i++) {
        char mask[512];
        lc_mask_of(tids[i], mask, sizeof mask);
        used += snprintf(line + used, sizeof line - (size_t)used, " %s=%s:%d", names[i], mask,
                         lc_role(tids[i]));
    }
    lc_say("%s", line);
    lc_report("task");
    pthread_mutex_lock(&lock);
    quit = 1;
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
    pthread_join(host, NULL);
    pthread_join(work, NULL);
    pthread_join(late, NULL);
    return 0;
}
