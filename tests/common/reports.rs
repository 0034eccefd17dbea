//! Reading what a program printed: its reports, lines, fields and JSON rows.

/// The thread ids the kernel lists for a live process.
pub fn task_tids(pid: u32) -> std::collections::BTreeSet<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The thread ids a JSON report lists.
pub fn report_tids(report: &serde_json::Value) -> std::collections::BTreeSet<i32> {
    report["threads"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t["tid"].as_i64())
                .map(|t| t as i32)
                .collect()
        })
        .unwrap_or_default()
}

/// One thread of a JSON report, by tid.
pub fn report_thread(report: &serde_json::Value, tid: i32) -> &serde_json::Value {
    row(report, "threads", "tid", tid)
}

/// The row of the JSON array `v[list]` whose `key` is `want` (`ps --json`'s threads by tid, the
/// host view's processes by pid, `topo --json`'s nodes by id); a panic naming all three and `v`
/// when there is none.
pub fn row<'a, T>(v: &'a serde_json::Value, list: &str, key: &str, want: T) -> &'a serde_json::Value
where
    serde_json::Value: PartialEq<T>,
    T: std::fmt::Debug,
{
    v[list]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r[key].eq(&want)))
        .unwrap_or_else(|| panic!("no row of {list} with {key} {want:?} in {v:#}"))
}

/// The placement the report gives thread `tid` (`worker`, `explicit`, ...; empty when absent).
pub fn report_placement(report: &serde_json::Value, tid: i32) -> String {
    report_thread(report, tid)["placement"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The last line of a program's stdout that is a JSON object, parsed (the test programs print
/// what they saw as one such line, after whatever else they print).
pub fn last_json_line(stdout: &[u8]) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in {stdout}"));
    serde_json::from_str(line).unwrap()
}

/// The lines of `text` (a program's stderr) that start with `prefix`: `"[tllm-affinity]"` for
/// every line of the library's, `"[tllm-affinity] error:"` for its errors.
pub fn lines_starting<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// Each of `parts` is in `text` (a program's output; the whole of it in the message).
#[track_caller]
pub fn says(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "no {part:?} in:\n{text}");
    }
}

/// None of `parts` is in `text` (the whole of it in the message).
#[track_caller]
pub fn never_says(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(!text.contains(part), "{part:?} in:\n{text}");
    }
}

/// `key=value` from a result line such as `CHILD main threads=1 role=0`.
pub fn field(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .to_string()
}

/// One field of every thread `ps PID --json` shows, in its order (`-` where it is no string).
pub fn ps_column(ps: &serde_json::Value, key: &str) -> Vec<String> {
    ps["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[key].as_str().unwrap_or("-").to_string())
        .collect()
}

/// The flags of kind `kind` in the host view's `ps --json`, each with the pids it names.
pub fn flags_of_kind<'a>(
    view: &'a serde_json::Value,
    kind: &'a str,
) -> impl Iterator<Item = (&'a serde_json::Value, Vec<u32>)> + 'a {
    view["flags"]
        .as_array()
        .unwrap()
        .iter()
        .filter(move |f| f["kind"] == kind)
        .map(|f| {
            let pids = f["pids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_u64().unwrap() as u32)
                .collect();
            (f, pids)
        })
}
