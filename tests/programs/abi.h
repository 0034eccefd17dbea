/* The library's C ABI looked up with dlsym, so that a program also runs (and can say so) without
 * the library preloaded: a NULL pointer is a function it does not have. */
#ifndef TLLM_ABI_H
#define TLLM_ABI_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

typedef int64_t (*configure_fn)(int32_t);
typedef int32_t (*release_fn)(int64_t);
typedef int32_t (*role_fn)(int32_t);
typedef int64_t (*report_fn)(char *, uint64_t);

static configure_fn tllm_configure;
static release_fn tllm_release;
static role_fn tllm_role;
static report_fn tllm_report;

static void tllm_abi_load(void) {
    tllm_configure = (configure_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    tllm_release = (release_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_release");
    tllm_role = (role_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_role");
    tllm_report = (report_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_report");
}

#endif
