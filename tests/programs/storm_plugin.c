/* A plugin whose constructor and destructor each create and join a thread: both run inside
 * dlopen/dlclose, with the loader's locks held, so every load and unload of it is a thread
 * creation that the library must classify while another thread of the process may fork. Built
 * under two names by tests/never_hang.rs, so that two loaders really load and unload. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>

static void *nothing(void *arg) { return arg; }

static void create_and_join(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, nothing, NULL) == 0) pthread_join(t, NULL);
}

__attribute__((constructor)) static void storm_plugin_loaded(void) { create_and_join(); }
__attribute__((destructor)) static void storm_plugin_unloaded(void) { create_and_join(); }

/* Loads and unloads `path` `n` times: for a Python caller, through ctypes, which releases the
 * GIL around the call, so the loads overlap the interpreter's forks. Returns the loads made. */
int storm_plugin_cycle(const char *path, int n) {
    int done = 0;
    for (; done < n; done++) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) break;
        dlclose(h);
    }
    return done;
}
