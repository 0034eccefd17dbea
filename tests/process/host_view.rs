//! `tllm-affinity ps` without a PID, the host view, against real processes under the real
//! library on the simulated two-GPU host: their rows (the GPU of each lease, the CPUs of their
//! workers, step and result threads), the grid of the host's CPUs, the flags, `--json`, and the
//! processes it cannot read. Other processes under the library (other tests running at once) may
//! be on the host too: every check looks at the pids it started.

use crate::common;

use std::process::{Command, Output};

use common::host_view_target::HostViewTarget as Server;
use common::*;
use serde_json::Value;
use tllm_affinity_core::host::simulated;

/// A table given to another user, given back to root when dropped (also when a test fails): a
/// killed process's table owned by another user would stay in /dev/shm, where only that user's
/// next process removes it.
struct GivenAway(std::path::PathBuf);

impl GivenAway {
    fn to_nobody(table: std::path::PathBuf) -> GivenAway {
        std::os::unix::fs::chown(&table, Some(65534), Some(65534)).unwrap();
        GivenAway(table)
    }
}

impl Drop for GivenAway {
    fn drop(&mut self) {
        let _ = std::os::unix::fs::chown(&self.0, Some(0), Some(0));
    }
}

fn ps(host: &Sysfs, extra: &[&str]) -> Output {
    succeeded(
        clean(cli())
            .args(["ps", "--sysfs-root"])
            .arg(host.path())
            .args(extra),
    )
}

fn text(host: &Sysfs) -> String {
    let out = ps(host, &["--no-color"]);
    String::from_utf8(out.stdout).unwrap()
}

fn json(host: &Sysfs) -> Value {
    let out = ps(host, &["--json"]);
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// The host view's entry for `pid`.
fn process(v: &Value, pid: u32) -> &Value {
    row(v, "processes", "pid", pid)
}

/// The flags of `kind` that name exactly the pids `pids` (in any order).
fn flags_naming(v: &Value, kind: &str, pids: &[u32]) -> Vec<Value> {
    let mut wanted: Vec<u32> = pids.to_vec();
    wanted.sort_unstable();
    flags_of_kind(v, kind)
        .filter_map(|(f, mut named)| {
            named.sort_unstable();
            (named == wanted).then(|| f.clone())
        })
        .collect()
}

/// The flags that name `pid` among others.
fn flags_of(v: &Value, pid: u32) -> Vec<Value> {
    v["flags"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["pids"].as_array().unwrap().iter().any(|p| p == pid))
        .cloned()
        .collect()
}

/// The grid row of `pid` in the text: its cells after the command.
fn grid_row(text: &str, pid: u32) -> String {
    let line = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("NODE"))
        .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
        .unwrap_or_else(|| panic!("no grid row for {pid}:\n{text}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    words[2..].join(" ")
}

/// What the grid shows for a process whose workers are on `workers` and whose host threads have
/// every allowed CPU, over the view's CPUs grouped by node.
fn expected_row(v: &Value, workers: &tllm_affinity_core::mask::CpuMask) -> String {
    let allowed = allowed_cpus();
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            mask(n["cpus"].as_str().unwrap())
                .iter()
                .map(|c| {
                    if workers.contains(c) {
                        'w'
                    } else if allowed.contains(c) {
                        'h'
                    } else {
                        '.'
                    }
                })
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn three_servers_then_a_fourth_whose_workers_overlap_the_firsts() {
    let host = Sysfs::two_nodes();
    require!(host.cpus("two GPUs on CPUs of their own"));
    let numa = [("TLLM_AFFINITY_POLICY", "numa")];
    let first = Server::start(&host, &["--gpu", "0"], &numa);
    let second = Server::start(&host, &["--gpu", "1"], &numa);
    let host_only = Server::start(&host, &[], &numa);
    let ours = [first.pid(), second.pid(), host_only.pid()];

    let v = json(&host);
    let entry = |pid| process(&v, pid).clone();
    let (a, b, c) = (entry(ours[0]), entry(ours[1]), entry(ours[2]));
    assert_eq!(
        a["leases"][0]["device"], "0000:3b:00.0",
        "GPU 0's lease: {a:#}"
    );
    assert_eq!(a["leases"][0]["gpu"], 0, "{a:#}");
    assert_eq!(mask(a["worker_cpus"].as_str().unwrap()), host.node1);
    assert_eq!(b["leases"][0]["device"], "0000:86:00.0", "{b:#}");
    assert_eq!(b["leases"][0]["gpu"], 1, "{b:#}");
    assert_eq!(mask(b["worker_cpus"].as_str().unwrap()), host.node0);
    assert_eq!(c["leases"], serde_json::json!([]), "{c:#}");
    assert_eq!(c["worker_cpus"], "", "{c:#}");
    for r in [&a, &b] {
        assert_eq!(r["threads"]["worker"], 1, "{r:#}");
        assert_eq!(mask(r["host_cpus"].as_str().unwrap()), allowed_cpus());
    }
    assert_eq!(c["threads"].get("worker"), None, "{c:#}");
    assert!(c["threads"]["host"].as_u64().unwrap() >= 2, "{c:#}");
    for r in [&a, &b, &c] {
        assert_eq!(r["command"], "python3", "{r:#}");
        let resident: u64 = r["memory"]["bytes_per_node"]
            .as_object()
            .unwrap_or_else(|| panic!("no memory: {r:#}"))
            .values()
            .map(|b| b.as_u64().unwrap())
            .sum();
        assert!(resident > 0, "{r:#}");
    }
    // Every CPU lists the processes on it, with their roles.
    let on_cpu = |cpu: usize, pid: u32| -> Vec<String> {
        row(&v, "cpus", "cpu", cpu)["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .map(|p| {
                p["roles"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| r.as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let node1_cpu = host.node1.first().unwrap();
    assert_eq!(on_cpu(node1_cpu, ours[0]), ["worker", "host"]);
    assert_eq!(on_cpu(node1_cpu, ours[1]), ["host"]);
    // Two GPUs, two nodes: nothing collides among these three.
    for pid in ours {
        assert_eq!(flags_of(&v, pid), Vec::<Value>::new(), "{v:#}");
    }

    // A fourth on GPU 1 whose policy gives its workers every CPU: they share GPU 0's CPUs with
    // the first's workers. With the second, on its own GPU, nothing is flagged.
    let fourth = Server::start(&host, &["--gpu", "1"], &[("TLLM_AFFINITY_POLICY", "clear")]);
    let d = fourth.pid();
    let v = json(&host);
    assert_eq!(
        mask(process(&v, d)["worker_cpus"].as_str().unwrap()),
        allowed_cpus()
    );
    let overlap = flags_naming(&v, "workers-share-cpus", &[ours[0], d]);
    assert_eq!(overlap.len(), 1, "{v:#}");
    assert_eq!(mask(overlap[0]["cpus"].as_str().unwrap()), host.node1);
    assert_eq!(
        flags_naming(&v, "workers-share-cpus", &[ours[1], d]),
        Vec::<Value>::new()
    );
    assert_eq!(
        flags_naming(&v, "workers-share-cpus", &[ours[0], ours[1]]),
        Vec::<Value>::new()
    );

    let text = text(&host);
    println!("$ tllm-affinity ps --sysfs-root <simulated> --no-color\n{text}");
    assert!(!text.contains('\x1b'), "{text}");
    let line_of = |pid: u32| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
            .unwrap_or_else(|| panic!("no row for {pid}:\n{text}"))
    };
    assert!(
        line_of(ours[0]).contains(&format!("GPU 0 (0000:3b:00.0)  {}", host.node1.to_list())),
        "{text}"
    );
    assert!(
        line_of(ours[1]).contains(&format!("GPU 1 (0000:86:00.0)  {}", host.node0.to_list())),
        "{text}"
    );
    assert!(line_of(ours[2]).contains("python3  -  "), "{text}");
    assert_eq!(grid_row(&text, ours[0]), expected_row(&v, &host.node1));
    assert_eq!(grid_row(&text, ours[1]), expected_row(&v, &host.node0));
    assert_eq!(
        grid_row(&text, ours[2]),
        expected_row(&v, &Default::default())
    );
    assert_eq!(grid_row(&text, d), expected_row(&v, &allowed_cpus()));
    let flag = format!(
        "flag: workers of {} on GPU 0 (0000:3b:00.0) and {d} on GPU 1 (0000:86:00.0) share CPU",
        ours[0]
    );
    assert!(text.lines().any(|l| l.starts_with(&flag)), "{flag}\n{text}");
    for server in [first, second, host_only, fourth] {
        server.finish();
    }
}

#[test]
fn two_step_threads_on_one_cpu_are_flagged() {
    let host = Sysfs::two_nodes();
    require!(host.cpus("a worker set of each GPU"));
    let cpu = host.node1.first().unwrap().to_string();
    let env = [
        ("TLLM_AFFINITY_POLICY", "numa"),
        ("TLLM_AFFINITY_STEP_CORE", cpu.as_str()),
    ];
    let first = Server::start(&host, &["--gpu", "0", "--step", "0"], &env);
    let second = Server::start(&host, &["--gpu", "1", "--step", "1"], &env);
    let v = json(&host);
    for s in [&first, &second] {
        assert_eq!(process(&v, s.pid())["step_cpus"], cpu.as_str(), "{v:#}");
    }
    let flags = flags_naming(
        &v,
        "step-threads-share-a-core",
        &[first.pid(), second.pid()],
    );
    assert_eq!(flags.len(), 1, "{v:#}");
    assert_eq!(flags[0]["cpus"], cpu.as_str());
    let text = text(&host);
    let (a, b) = (first.pid().min(second.pid()), first.pid().max(second.pid()));
    let line = format!("flag: step threads of {a} and {b} on one core: CPU {cpu}");
    assert!(text.lines().any(|l| l == line), "{line}\n{text}");
    assert!(grid_row(&text, first.pid()).contains('s'), "{text}");
    first.finish();
    second.finish();
}

/// A table owned by another user than the process's, a file that is no table at a process's
/// path: one line each, and every other process still shown.
#[test]
fn a_table_it_may_not_believe_is_one_line() {
    let host = Sysfs::two_nodes();
    let shown = Server::start(&host, &["--gpu", "0"], &[]);
    // A process without the library, and a file planted at the path its table would have.
    let mut plain = Command::new("sleep").arg("120").spawn().unwrap();
    let ns = |pid: u32| {
        tllm_affinity_core::table::threadtable::pid_namespace(std::path::Path::new(&format!(
            "/proc/{pid}"
        )))
        .unwrap()
    };
    let dir = tllm_affinity_core::table::threadtable::directory(std::path::Path::new("/tmp"));
    let planted = dir.join(tllm_affinity_core::table::threadtable::file_name(
        plain.id(),
        ns(plain.id()),
    ));
    std::fs::write(&planted, b"not a table").unwrap();
    let mut owned_by_another = None;
    let mut given_away = None;
    if root() {
        let other = Server::start(&host, &[], &[]);
        let table = dir.join(tllm_affinity_core::table::threadtable::file_name(
            other.pid(),
            ns(other.pid()),
        ));
        given_away = Some(GivenAway::to_nobody(table));
        owned_by_another = Some(other);
    } else {
        missing("root (to give a table to another user)");
    }
    let v = json(&host);
    let text = text(&host);
    let _ = std::fs::remove_file(&planted);
    let _ = plain.kill();
    let _ = plain.wait();
    assert!(process(&v, shown.pid())["worker_cpus"].is_string(), "{v:#}");
    let e = process(&v, plain.id());
    assert_eq!(e["command"], "sleep");
    assert!(
        e["error"]
            .as_str()
            .unwrap()
            .contains("not a tllm-affinity thread table"),
        "{e:#}"
    );
    let line = format!(
        "{:>8}  sleep: not shown: thread table not read: ",
        plain.id()
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with(&line)).count(),
        1,
        "{text}"
    );
    if let Some(other) = &owned_by_another {
        let e = process(&v, other.pid());
        let why = e["error"].as_str().unwrap_or_else(|| panic!("{e:#}"));
        assert!(
            why.contains("owned by uid 65534") && why.contains("not believed"),
            "{e:#}"
        );
        let line = format!("{:>8}  python3: not shown: ", other.pid());
        assert!(text.lines().any(|l| l.starts_with(&line)), "{text}");
    }
    drop(given_away);
    for server in owned_by_another.into_iter().chain([shown]) {
        server.finish();
    }
}

/// Processes under the library that start and end while `ps` reads the host: every run succeeds
/// with one JSON document, and each of them is a row, one line, or absent.
#[test]
fn processes_that_end_while_it_reads_never_abort_it() {
    let host = Sysfs::two_nodes();
    let calls = Program::c("calls").build();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let stop = stop.clone();
        let lib = library();
        let root = host.path().to_path_buf();
        std::thread::spawn(move || {
            let mut pids = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut children: Vec<_> = (0..4)
                    .map(|_| {
                        clean(&calls)
                            .arg("thread")
                            .env("LD_PRELOAD", &lib)
                            .env("TLLM_AFFINITY_SYSFS_ROOT", &root)
                            .stdout(std::process::Stdio::null())
                            .spawn()
                            .unwrap()
                    })
                    .collect();
                for c in &mut children {
                    pids.push(c.id());
                    let _ = c.wait();
                }
            }
            pids
        })
    };
    let mut seen = Vec::new();
    for _ in 0..8 {
        seen.push(json(&host));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pids = churn.join().unwrap();
    assert!(!pids.is_empty());
    for v in &seen {
        for p in v["processes"].as_array().unwrap() {
            let row = p["worker_cpus"].is_string() && p["threads"].is_object();
            let line = p["error"].is_string();
            assert!(row != line, "neither a row nor one line: {p:#}");
        }
    }
}

/// The written full-scale hosts: a name, the tree, and the GPU each of three servers works for
/// (two per node where a node has several, so that GPUs sharing a node's CPUs are shown).
fn full_scale_hosts() -> Vec<(&'static str, simulated::SimulatedHost, [usize; 3])> {
    use simulated::GpuMemoryMode;
    vec![
        (
            "GB200 tray, 144 CPUs",
            simulated::gb200_tray(GpuMemoryMode::Numa).host,
            [0, 1, 2],
        ),
        ("8×H100, 224 CPUs", simulated::dgx_h100_like(), [0, 1, 4]),
        (
            "quad GH200, 288 CPUs",
            simulated::quad_gh200().host,
            [0, 1, 2],
        ),
    ]
}

/// `ps` (PID or none) with `--no-color` and `COLUMNS=columns` on `host`: its text, each line
/// checked to be within `columns`.
fn ps_within(host: &Sysfs, pid: Option<u32>, columns: usize, name: &str) -> String {
    let mut cmd = clean(cli());
    cmd.arg("ps");
    if let Some(pid) = pid {
        cmd.arg(pid.to_string());
    }
    cmd.args(["--no-color", "--sysfs-root"])
        .arg(host.path())
        .env("COLUMNS", columns.to_string());
    let text = String::from_utf8(succeeded(&mut cmd).stdout).unwrap();
    for line in text.lines() {
        assert!(
            line.chars().count() <= columns,
            "{name}, COLUMNS={columns}, ps {pid:?}: a line of {} characters:\n{line}\n\n{text}",
            line.chars().count()
        );
    }
    text
}

/// Four servers on 144-, 224- and 288-CPU hosts (a GB200 tray, an 8×H100 host, a quad GH200):
/// at 80, 120 and 200 columns every line of the host view and of `ps PID` fits, and each
/// server, its GPU, and every role and placement its threads have is there without colour
/// (`x` explicit, `!` external included).
#[test]
fn the_grid_fits_80_120_and_200_columns_on_144_224_and_288_cpu_hosts() {
    require!(two_cpus(
        "an explicit or external mask apart from the worker's"
    ));
    for (name, shape, gpus) in full_scale_hosts() {
        let host = Sysfs::written(&shape);
        // This machine's CPUs are a few of the host's: the step core is named, not found.
        let step_cpu = allowed_cpus().first().unwrap().to_string();
        let step = [("TLLM_AFFINITY_STEP_CORE", step_cpu.as_str())];
        let g = gpus.map(|g| g.to_string());
        let servers = [
            Server::start(
                &host,
                &["--gpu", &g[0], "--step", &g[0], "--result", &g[0]],
                &step,
            ),
            Server::start(&host, &["--gpu", &g[1]], &[]),
            Server::start(&host, &["--gpu", &g[2], "--explicit"], &[]),
            // Its lease released after its mask was changed behind the library's back (on the
            // first GPU's node, whose CPUs include this machine's: the library placed it).
            Server::start(&host, &["--external", &g[0]], &[]),
        ];
        let pids = servers.each_ref().map(Server::pid);
        let v = json(&host);
        // Each server's threads' marks (`ps PID` gives each thread a row), and the one mark of
        // its own its host-view row shows: this machine's few CPUs may share one column, which
        // shows the most particular of them.
        let marks = [
            &[('h', "host"), ('w', "worker"), ('s', "step")][..],
            &[('h', "host"), ('w', "worker")],
            &[('h', "host"), ('w', "worker"), ('x', "explicit")],
            &[('h', "host"), ('!', "external")],
        ];
        let own = ['s', 'w', 'x', '!'];
        for columns in [80, 120, 200] {
            let text = ps_within(&host, None, columns, name);
            for (i, pid) in pids.iter().enumerate() {
                let entry = process(&v, *pid);
                let row = grid_row(&text, *pid);
                assert!(
                    row.contains(own[i]),
                    "{name}, COLUMNS={columns}: no {} in {pid}'s row {row:?}:\n{text}\n{entry:#}",
                    own[i]
                );
                // The roles its row counts.
                for (role, n) in entry["threads"].as_object().unwrap() {
                    assert!(
                        text.contains(&format!("{n} {role}")),
                        "{name}, COLUMNS={columns}: {pid}'s {n} {role} not shown:\n{text}"
                    );
                }
                if i < 3 {
                    let lease = &entry["leases"][0];
                    assert_eq!(lease["gpu"], gpus[i], "{name}: {entry:#}");
                    let gpu = format!("GPU {} ({})", gpus[i], lease["device"].as_str().unwrap());
                    assert!(
                        text.contains(&gpu),
                        "{name}, COLUMNS={columns}: {pid}'s {gpu} not shown:\n{text}"
                    );
                }
            }
            for item in ["x explicit", "! external", "s step"] {
                assert!(
                    text.lines()
                        .skip_while(|l| !l.starts_with("legend:"))
                        .take_while(|l| l.starts_with("legend:") || l.starts_with(' '))
                        .any(|l| l.contains(item)),
                    "{name}, COLUMNS={columns}: no {item:?} in the legend:\n{text}"
                );
            }
            for (i, pid) in pids.iter().enumerate() {
                let text = ps_within(&host, Some(*pid), columns, name);
                for (mark, named) in marks[i] {
                    assert!(
                        text.contains(&format!("{mark} {named}")),
                        "{name}, COLUMNS={columns}: ps {pid} shows no {mark} {named}:\n{text}"
                    );
                }
            }
        }
        for server in servers {
            server.finish();
        }
    }
}
