/* Loading and unloading tests/programs/reload_plugin.c, for the reload_*.c programs. */
#ifndef RELOAD_COMMON_H
#define RELOAD_COMMON_H

#include "agents.h"

struct plugin {
    void *handle;
    int (*start)(void);
    void (*stop)(void);
    void *routine;
};

static struct plugin plugin_load(const char *path) {
    struct plugin p;
    p.handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!p.handle) {
        fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
        exit(5);
    }
    p.start = (int (*)(void))dlsym(p.handle, "plugin_start");
    p.stop = (void (*)(void))dlsym(p.handle, "plugin_stop");
    void *(*routine)(void) = (void *(*)(void))dlsym(p.handle, "plugin_routine");
    if (!p.start || !p.stop || !routine) {
        fprintf(stderr, "%s: plugin symbols missing\n", path);
        exit(5);
    }
    p.routine = routine();
    return p;
}

static void plugin_unload(struct plugin *p) {
    if (dlclose(p->handle) != 0) {
        fprintf(stderr, "dlclose: %s\n", dlerror());
        exit(6);
    }
    p->handle = NULL;
}

#endif
