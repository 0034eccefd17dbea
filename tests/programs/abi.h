/* The library's C ABI looked up with dlsym, so that a program also runs (and can say so) without
 * the library preloaded: a NULL pointer is a function it does not have. */
#ifndef TLLM_ABI_H
#define TLLM_ABI_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef int64_t (*configure_fn)(int32_t);
typedef int32_t (*release_fn)(int64_t);
typedef int32_t (*role_fn)(int32_t);
typedef int64_t (*report_fn)(char *, uint64_t);
typedef int64_t (*begin_scope_fn)(int32_t);
typedef int32_t (*end_scope_fn)(int64_t);
typedef int32_t (*pin_fn)(int32_t);

static configure_fn tllm_configure;
static release_fn tllm_release;
static role_fn tllm_role;
static report_fn tllm_report;
static begin_scope_fn tllm_begin_scope;
static end_scope_fn tllm_end_scope;
static pin_fn tllm_pin_step;
static pin_fn tllm_pin_result;

static void tllm_abi_load(void) {
    tllm_configure = (configure_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
    tllm_release = (release_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_release");
    tllm_role = (role_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_role");
    tllm_report = (report_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_report");
    tllm_begin_scope = (begin_scope_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_begin_worker_scope");
    tllm_end_scope = (end_scope_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_end_worker_scope");
    tllm_pin_step = (pin_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_pin_step_thread");
    tllm_pin_result = (pin_fn)dlsym(RTLD_DEFAULT, "tllm_affinity_pin_result_thread");
}

/* For the programs that cannot run without the library: when `loaded` (the functions they need,
 * all found) is false, says so ("NOLIB ...") and exits with status 3. */
__attribute__((unused)) static void tllm_abi_require(int loaded) {
    if (loaded) return;
    printf("NOLIB libtllm_affinity.so is not loaded\n");
    exit(3);
}

#endif
