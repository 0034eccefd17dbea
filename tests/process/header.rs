//! `include/tllm_affinity.h` against the library (SPEC §7): the header declares exactly the
//! `tllm_affinity_*` functions the `.so` exports (unversioned), with SPEC's prototypes, and a C
//! program (and a C++ one) that includes it calls every function of the preloaded library.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::Value;

/// The prototypes of SPEC §7, and the adapters' note, as they must read in the header
/// (whitespace aside).
const SPEC_PROTOTYPES: [&str; 11] = [
    "int64_t tllm_affinity_configure(int32_t device_id);",
    "int64_t tllm_affinity_begin_worker_scope(int32_t device_id);",
    "int32_t tllm_affinity_end_worker_scope(int64_t lease);",
    "int32_t tllm_affinity_release(int64_t lease);",
    "int32_t tllm_affinity_role(int32_t tid);",
    "int32_t tllm_affinity_pin_step_thread(int32_t device_id);",
    "int32_t tllm_affinity_pin_result_thread(int32_t device_id);",
    "int64_t tllm_affinity_report(char *buf, uint64_t len);",
    "const char *tllm_affinity_version(void);",
    "int32_t tllm_affinity_note_adapter(const char *adapter, const char *state);",
    "int32_t tllm_affinity_note_adapter_detail(const char *adapter, const char *detail);",
];

fn header() -> PathBuf {
    repo().join("include/tllm_affinity.h")
}

/// `text` without C comments.
fn strip_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                rest = rest[b..].find("*/").map_or("", |end| &rest[b + end + 2..]);
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |end| &rest[l + end..]);
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

fn squeeze(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The `tllm_affinity_*` functions the header declares (an identifier followed by `(`).
fn declared(header_text: &str) -> BTreeSet<String> {
    let code = strip_comments(header_text);
    let mut names = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("tllm_affinity_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if tail[end..].trim_start().starts_with('(') {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// `nm -D --defined-only` of the library: the exported names starting with `tllm_affinity_`.
fn exported(lib: &Path) -> BTreeSet<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib)
        .output()
        .expect("run nm");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|name| name.starts_with("tllm_affinity_"))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_header_declares_exactly_what_the_library_exports() {
    let text = std::fs::read_to_string(header()).unwrap();
    let declared = declared(&text);
    let exported = exported(&library());
    assert_eq!(declared.len(), SPEC_PROTOTYPES.len(), "{declared:?}");
    assert!(
        exported.iter().all(|name| !name.contains('@')),
        "versioned symbols: {exported:?}"
    );
    let missing_from_library: Vec<_> = declared.difference(&exported).collect();
    let missing_from_header: Vec<_> = exported.difference(&declared).collect();
    assert!(
        missing_from_library.is_empty(),
        "declared, not exported: {missing_from_library:?}"
    );
    assert!(
        missing_from_header.is_empty(),
        "exported, not declared: {missing_from_header:?}"
    );
    let code = squeeze(&strip_comments(&text));
    for prototype in SPEC_PROTOTYPES {
        assert!(
            code.contains(&squeeze(prototype)),
            "the header lacks SPEC's `{prototype}`"
        );
    }
}

/// Looks every function up with `dlsym`, typed by the header's declarations, and calls it.
const PROGRAM: &str = r#"
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tllm_affinity.h"

#define LOOKUP(name)                                                                  \
    __typeof__(name) *name##_p = (__typeof__(name) *)dlsym(RTLD_DEFAULT, #name);      \
    if (!name##_p) {                                                                  \
        printf("{\"missing\": \"%s\"}\n", #name);                                     \
        return 3;                                                                     \
    }

static __typeof__(tllm_affinity_role) *role_p;

static void *child(void *out) {
    ((int32_t *)out)[0] = role_p(0);
    ((int32_t *)out)[1] = (int32_t)syscall(SYS_gettid);
    return NULL;
}

int main(void) {
    LOOKUP(tllm_affinity_configure)
    LOOKUP(tllm_affinity_begin_worker_scope)
    LOOKUP(tllm_affinity_end_worker_scope)
    LOOKUP(tllm_affinity_release)
    LOOKUP(tllm_affinity_role)
    LOOKUP(tllm_affinity_pin_step_thread)
    LOOKUP(tllm_affinity_pin_result_thread)
    LOOKUP(tllm_affinity_report)
    LOOKUP(tllm_affinity_version)
    LOOKUP(tllm_affinity_note_adapter)
    role_p = tllm_affinity_role_p;

    const char *version = tllm_affinity_version_p();
    /* A worker scope: the caller stays a host, its thread in the scope is a worker. */
    int64_t scope = tllm_affinity_begin_worker_scope_p(0);
    int32_t scope_role = tllm_affinity_role_p(0);
    int32_t in_scope[2] = {-1, -1};
    pthread_t s;
    pthread_create(&s, NULL, child, in_scope);
    pthread_join(s, NULL);
    int32_t scope_ended = tllm_affinity_end_worker_scope_p(scope);
    int32_t scope_ended_again = tllm_affinity_end_worker_scope_p(scope);
    int32_t after_scope[2] = {-1, -1};
    pthread_create(&s, NULL, child, after_scope);
    pthread_join(s, NULL);
    int32_t scope_released = tllm_affinity_release_p(scope);
    int32_t role_before = tllm_affinity_role_p(0);
    int64_t lease = tllm_affinity_configure_p(0);
    int32_t role_after = tllm_affinity_role_p(0);
    int32_t born[2] = {-1, -1};
    pthread_t t;
    pthread_create(&t, NULL, child, born);
    pthread_join(t, NULL);
    int32_t noted = tllm_affinity_note_adapter_p("trtllm", "engaged");
    int32_t noted_bad = tllm_affinity_note_adapter_p("two words", "engaged");
    int32_t step = tllm_affinity_pin_step_thread_p(0);
    int32_t result = tllm_affinity_pin_result_thread_p(0);
    int64_t need = tllm_affinity_report_p(NULL, 0);
    char *report = (char *)malloc((size_t)need + 1);
    int64_t got = tllm_affinity_report_p(report, (uint64_t)need + 1);
    char small[8];
    int64_t small_need = tllm_affinity_report_p(small, sizeof small);
    int32_t released = tllm_affinity_release_p(lease);
    int32_t released_again = tllm_affinity_release_p(lease);
    printf("{\"version\": \"%s\", \"role_before\": %" PRId32 ", \"lease\": %" PRId64
           ", \"role_after\": %" PRId32 ", \"child_role\": %" PRId32 ", \"step\": %" PRId32
           ", \"result\": %" PRId32 ", \"need\": %" PRId64 ", \"got\": %" PRId64
           ", \"report_len\": %zu, \"small_need\": %" PRId64 ", \"small_len\": %zu"
           ", \"released\": %" PRId32 ", \"released_again\": %" PRId32 ", \"enoent\": %d"
           ", \"scope\": %" PRId64 ", \"scope_role\": %" PRId32 ", \"in_scope_role\": %" PRId32
           ", \"scope_ended\": %" PRId32 ", \"scope_ended_again\": %" PRId32
           ", \"after_scope_role\": %" PRId32 ", \"scope_released\": %" PRId32
           ", \"noted\": %" PRId32 ", \"noted_bad\": %" PRId32 ", \"einval\": %d"
           ", \"report\": %s}\n",
           version, role_before, lease, role_after, born[0], step, result, need, got,
           strlen(report), small_need, strlen(small), released, released_again, ENOENT,
           scope, scope_role, in_scope[0], scope_ended, scope_ended_again, after_scope[0],
           scope_released, noted, noted_bad, EINVAL, report);
    free(report);
    return 0;
}
"#;

fn compile(dir: &Path, compiler: &str, args: &[&str]) -> std::process::Output {
    Command::new(compiler)
        .arg("-I")
        .arg(repo().join("include"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("run {compiler}: {e}"))
}

#[test]
fn a_c_program_calls_every_function_through_the_header() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("check.c"), PROGRAM).unwrap();
    let out = compile(
        dir.path(),
        "cc",
        &[
            "-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread", "check.c", "-o", "check", "-ldl",
        ],
    );
    assert!(
        out.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The header also compiles as C++ (extern "C").
    let out = compile(
        dir.path(),
        "c++",
        &["-x", "c++", "-Wall", "-Werror", "-fsyntax-only", "check.c"],
    );
    assert!(
        out.status.success(),
        "c++: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let host = Sysfs::two_nodes();
    let out = clean(dir.path().join("check"))
        .env("LD_PRELOAD", library())
        .env("TLLM_AFFINITY_SYSFS_ROOT", host.path())
        .env("TLLM_AFFINITY_LOCK_DIR", host.path())
        .env("TLLM_AFFINITY_POLICY", "numa")
        .env("TLLM_AFFINITY_LOG", "off")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{:?}: {stdout}", out.status);
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["scope"].as_i64().unwrap() > 0, "{v}");
    assert_eq!(
        v["scope_role"], 0,
        "a worker scope leaves its caller a host"
    );
    assert_eq!(
        v["in_scope_role"], 1,
        "a thread made in the scope is a worker"
    );
    assert_eq!(v["scope_ended"], 0);
    assert_eq!(v["scope_ended_again"], -v["enoent"].as_i64().unwrap());
    assert_eq!(v["after_scope_role"], 0, "a thread made after it is a host");
    assert_eq!(v["scope_released"], 0);
    assert_eq!(v["role_before"], 0, "the main thread is a host");
    assert!(v["lease"].as_i64().unwrap() > 0, "{v}");
    assert_eq!(v["role_after"], 1, "configure made it a worker");
    assert_eq!(v["child_role"], 1, "its thread is born a worker");
    // TLLM_AFFINITY_STEP_CORE is off: not pinned, warned, 0.
    assert_eq!(v["step"], 0);
    assert_eq!(v["result"], 0);
    // snprintf semantics: the size, the whole report, and a truncated copy of 7 bytes.
    let need = v["need"].as_i64().unwrap();
    assert!(need > 0);
    assert_eq!(v["got"], need);
    assert_eq!(v["report_len"].as_i64().unwrap(), need);
    assert!(v["small_need"].as_i64().unwrap() >= need);
    assert_eq!(v["small_len"], 7);
    assert_eq!(v["report"]["schema"], 1);
    assert_eq!(v["noted"], 0);
    assert_eq!(v["noted_bad"], -v["einval"].as_i64().unwrap());
    assert_eq!(v["report"]["adapters"]["trtllm"], "engaged");
    assert_eq!(v["released"], 0);
    assert_eq!(v["released_again"], -v["enoent"].as_i64().unwrap());

    // Without the library the lookups fail and the program says so: nothing links it.
    let out = clean(dir.path().join("check")).output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"missing\""));
}

#[test]
fn comments_do_not_count_as_declarations() {
    let names = declared(
        "/* tllm_affinity_gone(void) */ int tllm_affinity_here(void); // tllm_affinity_x(\n",
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["tllm_affinity_here"]
    );
}
