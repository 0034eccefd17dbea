/*
 * tllm_affinity.h: the C ABI of libtllm_affinity.so (docs/reference.md, "C ABI").
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
 * was reported at load) or disabled (secure execution), configure, begin_worker_scope and the pin
 * calls return -ENOTSUP, and role and end_worker_scope return -ENOENT. Under
 * TLLM_AFFINITY_DISABLE=1 (loaded and inert) configure, begin_worker_scope, end_worker_scope,
 * release, role and the pin calls all return -ENOTSUP.
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
 * with, and applies the policy (docs/reference.md, "Policy") to every worker thread of the
 * process; while a lease is open, new worker threads are born on the worker mask.
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
 * Opens a worker scope on the calling thread: the caller keeps its role (a main thread that
 * builds an engine and then serves HTTP stays a host), while the threads it creates until
 * tllm_affinity_end_worker_scope are born workers, and so are their descendants. The policy
 * applies to every worker thread as for tllm_affinity_configure, and device_id means the same.
 *
 * Returns a lease id > 0, or -errno as tllm_affinity_configure: -ENODEV, -EIO, -ENOTSUP. The
 * lease restores like any other when released. A thread holds one scope: a scope opened while
 * the caller's scope is open is a plain lease, and the outer scope stays open until it ends.
 */
int64_t tllm_affinity_begin_worker_scope(int32_t device_id); /* lease id > 0, or -errno; caller keeps its role */

/*
 * Ends the worker scope of `lease`: the threads its thread creates from now on take that
 * thread's role again. The lease stays open until tllm_affinity_release. Returns 0, or -ENOENT
 * when the lease is unknown, already released, or not an open scope (ended already, opened
 * inside another scope, or its thread exited).
 */
int32_t tllm_affinity_end_worker_scope(int64_t lease);  /* 0; later threads of the caller are born as before; the lease stays until released */

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
 * Pins the calling thread as device_id's step thread (TLLM_AFFINITY_STEP_CORE, docs/reference.md): to one
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

/*
 * Records what a language adapter did, for the report's "adapters" object: the Python adapter
 * notes "trtllm" as "engaged", "not-found" (no configure_cpu_affinity to wrap) or "signature",
 * so a report shows a server the library changed nothing in; the Python start-up hook notes
 * "python" as "hook" when it runs (an interpreter that started without that note is said once).
 * Both strings are short words
 * ([A-Za-z0-9_-], 1 to 32 bytes). Returns 0, -EINVAL for anything else, -ENOSPC past 8 adapters.
 */
int32_t tllm_affinity_note_adapter(const char *adapter, const char *state); /* 0, or -errno */

/*
 * One line of what an adapter that noted its state engaged, for the report's "adapter_details":
 * the Python adapter gives TensorRT-LLM's version and each call site it found or missed, with the
 * leases each opened and closed ("tensorrt_llm 1.2.0; base_worker found 1/1; visual_gen missing").
 * Printable ASCII, 1 to 512 bytes. Returns 0, -EINVAL for anything else, -ENOENT for an adapter
 * that noted no state.
 */
int32_t tllm_affinity_note_adapter_detail(const char *adapter, const char *detail);

/* The library's version, e.g. "0.1.0": a static string, never freed. */
const char *tllm_affinity_version(void);

#ifdef __cplusplus
}
#endif

#endif /* TLLM_AFFINITY_H */
