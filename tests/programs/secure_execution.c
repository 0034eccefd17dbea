/* What a secure-execution (AT_SECURE) process sees of the library: run setgid or with file
 * capabilities by a non-root user, with LD_PRELOAD set (the loader ignores it there) and the
 * library's path in argv[1] (dlopen'd, so that its constructor runs in the secure process).
 * Prints one line: SECURE at_secure=<0|1> preloaded=<0|1> state=<report state> role=<..>
 * configure=<..> mask_before=<..> mask_after=<..> */
#include "agents.h"

#include <sys/auxv.h>

static void *nothing(void *arg) { return arg; }

int main(int argc, char **argv) {
    int preloaded = dlsym(RTLD_DEFAULT, "tllm_affinity_report") != NULL;
    if (argc > 1 && !preloaded && !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) {
        printf("SECURE dlopen failed: %s\n", dlerror());
        return 5;
    }
    lc_init();
    char before[64], after[64];
    lc_mask_of(0, before, sizeof before);
    int64_t lease = lc_configure(0);
    lc_mask_of(0, after, sizeof after);
    pthread_t t;
    pthread_create(&t, NULL, nothing, NULL);
    pthread_join(t, NULL);
    char *json = lc_report_json();
    const char *state = strstr(json, "\"state\":\"");
    char state_name[32] = "none";
    if (state) sscanf(state + 9, "%31[a-z]", state_name);
    printf("SECURE at_secure=%lu preloaded=%d state=%s role=%d configure=%lld mask_before=%s mask_after=%s uid=%d euid=%d "
           "gid=%d egid=%d\n",
           getauxval(AT_SECURE), preloaded, state_name, lc_role(0), (long long)lease, before, after, (int)getuid(),
           (int)geteuid(), (int)getgid(), (int)getegid());
    free(json);
    return 0;
}
