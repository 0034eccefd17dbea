/*
 * tllm_affinity.h: the C ABI of libtllm_affinity.so (SPEC §7).
 *
 * libtllm_affinity.so is an LD_PRELOAD library: it must be preloaded into the process
 * (`tllm-affinity run -- prog`, or LD_PRELOAD=/abs/path/libtllm_affinity.so prog) so that it sees
 * every thread being created. A program that should also run without it can look the functions up
 * at run time instead of linking them:
 *
 *     #include <dlfcn.h>
 *     #include "tllm_affinity.h"
 *     __typeof__(tllm_affinity_configure) *configure =
 *         (__typeof__(tllm_affinity_configure) *)dlsym(RTLD_DEFAULT, "tllm_affinity_configure");
 *     if (configure) { int64_t lease = configure(-1); ... }
 *
 * All functions are thread-safe, never block on another thread for long, and fail open: an error
 * is a negative errno return, never a crash. While the library is passive (a malformed setting
 * was reported at load) or disabled (secure execution), configure and the pin calls return
 * -ENOTSUP and role returns -ENOENT.
 *
 * The symbols are exported unversioned.
 */
#ifndef TLLM_AFFINITY_H
#define TLLM_AFFINITY_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Makes the calling thread a worker, with every live descendant still on the mask it was born
 * with, and applies the policy (SPEC §3) to every worker thread of the process; while a lease is
 * open, new worker threads are born on the worker mask.
 *
 * device_id: a CUDA logical device number (mapped through CUDA_VISIBLE_DEVICES and
 * CUDA_DEVICE_ORDER), or -1 for TLLM_AFFINITY_GPU, else the launcher's local rank modulo the
 * visible GPUs.
 *
 * Returns a lease id > 0, or -errno: -ENODEV (no such device), -EIO (sysfs unreadable),
 * -ENOTSUP (library passive or disabled). A second call for the same device changes nothing and
 * returns a new lease; a call for another device retargets the worker threads.
 */
int64_t tllm_affinity_configure(int32_t device_id);     /* lease id > 0, or -errno */

/*
 * Closes a lease. The last open lease restores every mask the library set, except masks changed
 * since by someone else, which are kept. Returns 0, or -ENOENT for an unknown or already released
 * lease (so releasing twice is harmless).
 */
int32_t tllm_affinity_release(int64_t lease);           /* 0; -ENOENT if unknown or already released */

/*
 * The role of thread `tid` (a kernel thread id, as gettid(2) returns; 0 = the calling thread):
 * 0 host, 1 worker, -ENOENT for a thread the library does not know (created before it loaded,
 * by raw clone, or already exited).
 */
int32_t tllm_affinity_role(int32_t tid);                /* 0 host, 1 worker, -errno if unknown; tid 0 = caller */

/*
 * Pins the calling thread as device_id's step thread (TLLM_AFFINITY_STEP_CORE, SPEC §6): to one
 * core's hardware threads. Returns the number of CPUs pinned to; 0 when not pinned (setting off,
 * pool too small, GPU locked by another process; a warning says why); -EINVAL when
 * TLLM_AFFINITY_STEP_CORE names a CPU outside the process mask; other -errno on failure.
 */
int32_t tllm_affinity_pin_step_thread(int32_t device_id);   /* CPUs pinned to; 0 = not pinned (warned); -errno */

/* Pins the calling thread as device_id's result thread: one CPU of another core. As above. */
int32_t tllm_affinity_pin_result_thread(int32_t device_id); /* same */

/*
 * A JSON snapshot of the process (schema 1, docs/report.md). Like snprintf: writes at most
 * len - 1 bytes and a NUL into buf (nothing when buf is NULL or len is 0) and returns the length
 * of the whole report, without the NUL. Call with (NULL, 0) for the size, then with a buffer of
 * size + 1; ask again if the second answer is larger (a thread was born in between).
 */
int64_t tllm_affinity_report(char *buf, uint64_t len);  /* JSON snapshot; returns bytes needed, like snprintf */

/* The library's version, e.g. "0.1.0": a static string, never freed. */
const char *tllm_affinity_version(void);

#ifdef __cplusplus
}
#endif

#endif /* TLLM_AFFINITY_H */
