//! `tllm-affinity metrics` against the real parts of a fleet's monitoring, started and stopped
//! by the tests on loopback ports: a real Prometheus (Debian's `prometheus`) scraping the
//! exporter both ways, node_exporter's textfile collector (`prometheus-node-exporter`, fed by
//! `--textfile DIR --every 1`) and `--listen`; processes under the real library on the simulated
//! two-GPU host, whose values Prometheus' HTTP API must give as `ps --json` gives them; the flag
//! for workers of two GPUs sharing CPUs; a table it cannot read; series gone once the processes
//! exit; a command name with quotes, backslashes and a newline escaped as the format requires;
//! `promtool` on the output, the alert rules and their unit tests. Without Prometheus the tests fail under
//! `CI=true` (require!) and say they are skipped elsewhere.

use crate::common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::host_view_target::HostViewTarget as Server;
use common::*;
use serde_json::Value;
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};

/// How long Prometheus gets to show what a test waits for (it scrapes every second).
const WAIT: Duration = Duration::from_secs(40);

/// Debian's Prometheus, node_exporter and promtool, or what is missing (for require!).
fn prometheus_installed() -> Result<(), String> {
    let missing: Vec<&str> = ["prometheus", "promtool", "prometheus-node-exporter"]
        .into_iter()
        .filter(|p| !on_path(p))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} (Debian's prometheus and prometheus-node-exporter; scripts/setup installs them)",
            missing.join(", ")
        ))
    }
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A daemon the test started (Prometheus, node_exporter, an exporter), its output in a file;
/// killed and reaped when dropped, also when the test fails.
struct Daemon {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn start(name: &'static str, mut cmd: Command, dir: &Path) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {cmd:?}: {e}"));
        Daemon { name, child, log }
    }

    /// Its output so far, for a failure's message.
    fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        format!("--- {} ---\n{text}", self.name)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET path` on 127.0.0.1:`port`: the status and the body (HTTP/1.0: no chunks, the server
/// closes the connection at the end of the body). `None` when nothing listens yet.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let response = String::from_utf8(response).expect("a UTF-8 response");
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// `text` percent-encoded for a query string.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One series of an instant query: its labels and value.
type Sample = (BTreeMap<String, String>, f64);

/// The monitoring of one simulated host: an exporter on `--listen`, one writing node_exporter's
/// textfile every second, node_exporter, and Prometheus scraping both every second (jobs
/// `tllm` and `node`) with docs/monitoring/rules.yml loaded.
struct Monitoring {
    _dir: tempfile::TempDir,
    prometheus_port: u16,
    listen_port: u16,
    textfile: PathBuf,
    daemons: Vec<Daemon>,
}

/// The two ways Prometheus gets the metrics: its job names.
const JOBS: [&str; 2] = ["tllm", "node"];

impl Monitoring {
    fn start(host: &Sysfs) -> Monitoring {
        let dir = tempfile::tempdir().unwrap();
        let textfile = dir.path().join("textfile");
        std::fs::create_dir(&textfile).unwrap();
        let (prometheus_port, listen_port, node_port) = (free_port(), free_port(), free_port());
        let mut daemons = Vec::new();

        let mut listen = clean(cli());
        listen
            .args(["metrics", "--listen", &format!("127.0.0.1:{listen_port}")])
            .arg("--sysfs-root")
            .arg(host.path());
        daemons.push(Daemon::start("metrics --listen", listen, dir.path()));
        let mut writer = clean(cli());
        writer
            .args(["metrics", "--every", "1", "--textfile"])
            .arg(&textfile)
            .arg("--sysfs-root")
            .arg(host.path());
        daemons.push(Daemon::start("metrics --textfile", writer, dir.path()));
        let mut node = Command::new("prometheus-node-exporter");
        node.arg(format!("--web.listen-address=127.0.0.1:{node_port}"))
            .arg("--collector.disable-defaults")
            .arg("--collector.textfile")
            .arg(format!(
                "--collector.textfile.directory={}",
                textfile.display()
            ));
        daemons.push(Daemon::start("node_exporter", node, dir.path()));

        let rules = repo().join("docs/monitoring/rules.yml");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {}\n\
                 scrape_configs:\n\
                 \x20 - job_name: tllm\n    static_configs:\n      - targets: ['127.0.0.1:{listen_port}']\n\
                 \x20 - job_name: node\n    static_configs:\n      - targets: ['127.0.0.1:{node_port}']\n",
                rules.display()
            ),
        )
        .unwrap();
        let mut prometheus = Command::new("prometheus");
        prometheus
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prometheus_port}"));
        daemons.push(Daemon::start("prometheus", prometheus, dir.path()));
        let monitoring = Monitoring {
            _dir: dir,
            prometheus_port,
            listen_port,
            textfile,
            daemons,
        };
        monitoring.until("Prometheus ready and both targets up", || {
            let up = monitoring
                .query("up == 1")
                .ok_or("Prometheus does not answer")?;
            if up.len() == JOBS.len() {
                Ok(())
            } else {
                Err(format!("up: {up:?}"))
            }
        });
        monitoring
    }

    /// Every daemon's output, for a failure's message.
    fn logs(&self) -> String {
        self.daemons
            .iter()
            .map(Daemon::log)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// An instant query at the present time, or `None` while Prometheus does not answer.
    fn query(&self, promql: &str) -> Option<Vec<Sample>> {
        let (status, body) = get(
            self.prometheus_port,
            &format!("/api/v1/query?query={}", encode(promql)),
        )?;
        if status != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(v["status"], "success", "{promql}: {v}");
        let samples = v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let labels = s["metric"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                    .collect();
                let value = s["value"][1].as_str().unwrap().parse().unwrap();
                (labels, value)
            })
            .collect();
        Some(samples)
    }

    /// Waits until `check` gives a value, at most [`WAIT`]; fails with `what`, what `check` said
    /// last and the daemons' output.
    fn until<T>(&self, what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            let why = match check() {
                Ok(found) => return found,
                Err(why) => why,
            };
            assert!(
                Instant::now() < deadline,
                "{what}: not within {WAIT:?}; last: {why}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The exposition `--listen` serves now.
    fn scrape(&self) -> String {
        let (status, body) = get(self.listen_port, "/metrics").expect("the exporter answers");
        assert_eq!(status, 200, "{body}");
        body
    }
}

fn ps_json(host: &Sysfs) -> Value {
    let out = succeeded(
        clean(cli())
            .args(["ps", "--json", "--sysfs-root"])
            .arg(host.path()),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What the metrics of process `pid` must be, from `ps --json`'s view `v` (and the kernel's
/// nodes, for the share of memory off the workers' node): each family's series (labels other
/// than pid, command, job and instance) and values.
fn expected(v: &Value, pid: u32) -> BTreeMap<String, BTreeMap<String, f64>> {
    let p = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .unwrap_or_else(|| panic!("no process {pid} in {v:#}"));
    let mut families: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    let mut add = |family: &str, labels: String, value: f64| {
        *families
            .entry(family.into())
            .or_default()
            .entry(labels)
            .or_default() += value;
    };
    for (role, n) in p["threads"].as_object().unwrap() {
        add(
            "tllm_affinity_threads",
            format!("role={role}"),
            n.as_f64().unwrap(),
        );
    }
    let workers = mask(p["worker_cpus"].as_str().unwrap());
    if !workers.is_empty() {
        add(
            "tllm_affinity_worker_cpus_info",
            format!("cpus={}", workers.to_list()),
            1.0,
        );
        for node in v["nodes"].as_array().unwrap() {
            let on = workers.intersection(&mask(node["cpus"].as_str().unwrap()));
            if !on.is_empty() {
                add(
                    "tllm_affinity_worker_cpus",
                    format!("node={}", node["node"]),
                    on.count() as f64,
                );
            }
        }
    }
    let mut slices = BTreeMap::new();
    for lease in p["leases"].as_array().unwrap() {
        let device = format!(
            "gpu={},pci_bus_id={}",
            lease["gpu"],
            lease["device"].as_str().unwrap()
        );
        add("tllm_affinity_leases", device.clone(), 1.0);
        if let Some(slice) = lease["slice"].as_str() {
            slices.insert(format!("{device},cpus={slice}"), mask(slice).count() as f64);
        }
    }
    // One series per GPU, however many of its leases are open.
    for (labels, cpus) in slices {
        add("tllm_affinity_lease_slice_cpus", labels, cpus);
    }
    let mut resident = BTreeMap::new();
    for (node, bytes) in p["memory"]["bytes_per_node"].as_object().unwrap() {
        let (node, bytes) = (node.parse::<usize>().unwrap(), bytes.as_u64().unwrap());
        resident.insert(node, bytes);
        add(
            "tllm_affinity_memory_resident_bytes",
            format!("node={node}"),
            bytes as f64,
        );
    }
    // The share off the workers' node, judged on the kernel's nodes with CPUs (whatever tree
    // the CPUs were read from), for workers on one of them.
    let kernel = Topology::read(&SysfsRoot::new("/"))
        .map(|t| t.nodes_with_cpus())
        .unwrap_or_default();
    let workers_on: Vec<usize> = kernel
        .iter()
        .filter(|(_, cpus)| !cpus.intersection(&workers).is_empty())
        .map(|(id, _)| *id)
        .collect();
    if let [node] = workers_on[..] {
        let on_kernel_nodes = |n: &usize| kernel.iter().any(|(id, _)| id == n);
        let total: u64 = resident
            .iter()
            .filter(|(n, _)| on_kernel_nodes(n))
            .map(|(_, b)| b)
            .sum();
        let off: u64 = resident
            .iter()
            .filter(|(n, _)| on_kernel_nodes(n) && **n != node)
            .map(|(_, b)| b)
            .sum();
        if total > 0 {
            add(
                "tllm_affinity_memory_off_workers_node_ratio",
                format!("node={node}"),
                off as f64 / total as f64,
            );
        }
    }
    families
}

/// The same from Prometheus, for `job`, checking the command label against `command`.
fn scraped(
    m: &Monitoring,
    job: &str,
    pid: u32,
    command: &str,
) -> Option<BTreeMap<String, BTreeMap<String, f64>>> {
    let mut families: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for family in [
        "tllm_affinity_threads",
        "tllm_affinity_worker_cpus_info",
        "tllm_affinity_worker_cpus",
        "tllm_affinity_leases",
        "tllm_affinity_lease_slice_cpus",
        "tllm_affinity_memory_resident_bytes",
        "tllm_affinity_memory_off_workers_node_ratio",
    ] {
        for (labels, value) in m.query(&format!("{family}{{job=\"{job}\",pid=\"{pid}\"}}"))? {
            assert_eq!(labels["command"], command, "{family} of {pid}: {labels:?}");
            let rest: Vec<String> = labels
                .iter()
                .filter(|(k, _)| {
                    !["__name__", "pid", "command", "job", "instance"].contains(&k.as_str())
                })
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            families
                .entry(family.into())
                .or_default()
                .insert(rest.join(","), value);
        }
    }
    Some(families)
}

/// The value of the one series `promql` gives, 0 for none.
/// Prometheus's `value` against `in_ps`, what `ps --json` counts: equal, and at least 1.
fn as_in_ps(value: Option<f64>, in_ps: f64) -> Result<(), String> {
    let count = value.ok_or("Prometheus does not answer")?;
    if count == in_ps && count >= 1.0 {
        Ok(())
    } else {
        Err(format!("{count} in Prometheus, {in_ps} in ps --json"))
    }
}

fn one_value(m: &Monitoring, promql: &str) -> Option<f64> {
    let samples = m.query(promql)?;
    assert!(samples.len() <= 1, "{promql}: {samples:?}");
    Some(samples.first().map_or(0.0, |s| s.1))
}

/// The `ps --json` flags of `kind` that name only pids among `pids`.
fn flags_among(v: &Value, kind: &str, pids: &[u32]) -> usize {
    flags_of_kind(v, kind)
        .filter(|(_, named)| named.iter().all(|p| pids.contains(p)))
        .count()
}

/// The `command` label value as the exposition must write it.
fn escaped(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `promtool check metrics` on `text`: accepted, with no lint complaint.
fn promtool_accepts(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}\n{text}",
        output_text(&out)
    );
}

/// A process without the library and a file that is no table planted where its table would be:
/// a table the host view cannot read. Both gone when dropped.
struct Unreadable {
    process: Child,
    planted: PathBuf,
}

impl Unreadable {
    fn plant() -> Unreadable {
        use tllm_affinity_core::table::threadtable;
        let process = Command::new("sleep").arg("120").spawn().unwrap();
        let namespace =
            threadtable::pid_namespace(Path::new(&format!("/proc/{}", process.id()))).unwrap();
        let planted = threadtable::directory(Path::new("/tmp"))
            .join(threadtable::file_name(process.id(), namespace));
        std::fs::write(&planted, b"not a table").unwrap();
        Unreadable { process, planted }
    }
}

impl Drop for Unreadable {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.planted);
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// Three servers on the simulated host (GPU 0 on node 1's CPUs; GPU 1 on node 0's; another on
/// GPU 1 whose workers have every CPU, so they share GPU 0's) and a fourth with a hostile name:
/// Prometheus has, through either way, what `ps --json` says of each; the one shared-CPU flag;
/// the alert pending; the hostile name escaped; and once they exit, none of their series.
#[test]
fn prometheus_scrapes_what_the_host_view_sees_both_ways_and_forgets_processes_that_exit() {
    require!(prometheus_installed());
    let host = Sysfs::two_nodes();
    require!(host.cpus("two GPUs on CPUs of their own"));
    let began = Instant::now();
    let step = |what: &str| println!("{:>6.1} s  {what}", began.elapsed().as_secs_f64());
    cli();
    step("library and CLI built");
    let numa = [("TLLM_AFFINITY_POLICY", "numa")];
    let first = Server::start(&host, &["--gpu", "0"], &numa);
    let second = Server::start(&host, &["--gpu", "1"], &numa);
    let sharing = Server::start(&host, &["--gpu", "1"], &[("TLLM_AFFINITY_POLICY", "clear")]);
    let hostile_name = "a\"b\\c\nd";
    let hostile = Server::named(&host, &[], &numa, hostile_name);
    let pids = [first.pid(), second.pid(), sharing.pid(), hostile.pid()];
    let unreadable = Unreadable::plant();
    step("four processes started");
    let m = Monitoring::start(&host);
    step("Prometheus up, both targets scraped");

    // Each process, each way: what ps --json says. The figures are taken anew until a scrape
    // after ps agrees (memory may move a page between two scans).
    for job in JOBS {
        for pid in pids {
            m.until(
                &format!("{job}: process {pid} as ps --json gives it"),
                || {
                    let v = ps_json(&host);
                    let command = v["processes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|p| p["pid"] == pid)
                        .and_then(|p| p["command"].as_str())
                        .ok_or_else(|| format!("no row for {pid} in ps --json: {v:#}"))?
                        .to_string();
                    let want = expected(&v, pid);
                    let got =
                        scraped(&m, job, pid, &command).ok_or("Prometheus does not answer")?;
                    if got == want {
                        Ok(())
                    } else {
                        Err(format!("ps --json: {want:?}\nPrometheus: {got:?}"))
                    }
                },
            );
        }
    }
    step("every process as ps --json gives it, both ways");
    let v = ps_json(&host);
    let hostile_command = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == hostile.pid())
        .unwrap()["command"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        hostile_command.contains('"') && hostile_command.contains('\\'),
        "{hostile_command:?}"
    );

    // The one flag: the first's workers (GPU 0) and the sharer's (GPU 1) on the same CPUs.
    assert_eq!(flags_among(&v, "workers-share-cpus", &pids), 1, "{v:#}");
    for job in JOBS {
        m.until(&format!("{job}: the shared-CPU flag counted"), || {
            let v = ps_json(&host);
            let on_host = v["flags"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|f| f["kind"] == "workers-share-cpus")
                .count() as f64;
            as_in_ps(
                one_value(
                    &m,
                    &format!("tllm_affinity_flags{{job=\"{job}\",kind=\"workers-share-cpus\"}}"),
                ),
                on_host,
            )
        });
        for (pid, n) in [
            (first.pid(), 1.0),
            (sharing.pid(), 1.0),
            (second.pid(), 0.0),
            (hostile.pid(), 0.0),
        ] {
            let named = one_value(
                &m,
                &format!(
                    "tllm_affinity_process_flags{{job=\"{job}\",pid=\"{pid}\",kind=\"workers-share-cpus\"}}"
                ),
            )
            .unwrap();
            assert_eq!(named, n, "{job}: flags naming {pid}");
        }
        // The alert for it is pending (its `for:` is minutes).
        m.until(&format!("{job}: the shared-CPU alert pending"), || {
            let alerts = m
                .query(&format!(
                    "ALERTS{{alertname=\"TllmAffinityWorkersShareCpus\",job=\"{job}\"}}"
                ))
                .ok_or("Prometheus does not answer")?;
            if alerts
                .iter()
                .any(|(labels, _)| labels["alertstate"] == "pending")
            {
                Ok(())
            } else {
                Err(format!("ALERTS: {alerts:?}"))
            }
        });
    }

    step("the flag counted, named and alerted");
    // The planted table: one process the host view cannot read, counted as ps --json counts.
    let planted = unreadable.process.id();
    for job in JOBS {
        m.until(&format!("{job}: the unreadable table counted"), || {
            let v = ps_json(&host);
            let lines = v["processes"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["error"].is_string())
                .count() as f64;
            if !v["processes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["pid"] == planted && p["error"].is_string())
            {
                return Err(format!("ps --json has no line for {planted}: {v:#}"));
            }
            as_in_ps(
                one_value(
                    &m,
                    &format!("tllm_affinity_tables_unreadable{{job=\"{job}\"}}"),
                ),
                lines,
            )
        });
    }
    drop(unreadable);
    step("the unreadable table counted");
    // The hostile name: escaped in the exposition, read back whole by Prometheus (above), and
    // promtool accepts both outputs.
    let exposition = m.scrape();
    let line = format!(
        "tllm_affinity_threads{{pid=\"{}\",command=\"{}\",role=\"host\"}}",
        hostile.pid(),
        escaped(&hostile_command)
    );
    assert!(
        exposition.lines().any(|l| l.starts_with(&line)),
        "{line}\n{exposition}"
    );
    promtool_accepts(&exposition);
    let written = std::fs::read_to_string(m.textfile.join("tllm_affinity.prom")).unwrap();
    promtool_accepts(&written);
    let others: Vec<_> = std::fs::read_dir(&m.textfile)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "tllm_affinity.prom")
        .collect();
    assert!(
        others.iter().all(|n| n.to_string_lossy().starts_with('.')),
        "{others:?}"
    );

    step("the hostile name escaped, promtool accepts the output");
    // They exit: the next scrapes have none of their series.
    for server in [first, second, sharing, hostile] {
        server.finish();
    }
    let any_of = pids.map(|p| p.to_string()).join("|");
    for job in JOBS {
        m.until(&format!("{job}: the processes' series gone"), || {
            let left = m
                .query(&format!(
                    "{{__name__=~\"tllm_affinity_.+\",job=\"{job}\",pid=~\"{any_of}\"}}"
                ))
                .ok_or("Prometheus does not answer")?;
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("still: {left:?}"))
            }
        });
    }
    step("their series gone");
}

/// A process whose lease was opened under `TLLM_AFFINITY_SLICE=gpu` and one without, on the
/// simulated host (GPU 0 alone on node 1's CPUs: its slice is all of them): the exporter's scan
/// gives the first one's slice as `ps --json` reads it from the process's table, with its CPU
/// list and count, and nothing for the second; promtool accepts the text.
#[test]
fn a_lease_opened_on_a_slice_shows_the_slice_in_the_metrics() {
    let host = Sysfs::two_nodes();
    let sliced = Server::start(&host, &["--gpu", "0"], &[("TLLM_AFFINITY_SLICE", "gpu")]);
    let whole = Server::start(&host, &["--gpu", "0"], &[]);
    let v = ps_json(&host);
    let row = |pid: u32| {
        v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap_or_else(|| panic!("no process {pid} in {v:#}"))
            .clone()
    };
    let slice = &row(sliced.pid())["leases"][0]["slice"];
    assert_eq!(slice.as_str(), Some(host.node1.to_list().as_str()), "{v:#}");
    assert_eq!(row(whole.pid())["leases"][0].get("slice"), None, "{v:#}");

    let out = succeeded(
        clean(cli())
            .args(["metrics", "--sysfs-root"])
            .arg(host.path()),
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("tllm_affinity_lease_slice_cpus{"))
        .collect();
    let command = escaped(row(sliced.pid())["command"].as_str().unwrap());
    let want = format!(
        "tllm_affinity_lease_slice_cpus{{pid=\"{}\",command=\"{command}\",gpu=\"0\",\
         pci_bus_id=\"0000:3b:00.0\",cpus=\"{}\"}} {}",
        sliced.pid(),
        host.node1.to_list(),
        host.node1.count()
    );
    assert_eq!(series, [want.as_str()], "{text}");
    if prometheus_installed().is_ok() {
        promtool_accepts(&text);
    }
}

/// The alert rules pass `promtool check rules` and their unit tests (each alert fires on
/// series written for it, after its `for:`, and none on a clean host).
#[test]
fn the_alert_rules_are_valid_and_their_unit_tests_pass() {
    require!(prometheus_installed());
    let dir = repo().join("docs/monitoring");
    let check = succeeded(
        Command::new("promtool")
            .args(["check", "rules"])
            .arg(dir.join("rules.yml")),
    );
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(said.contains("SUCCESS: 6 rules found"), "{said}");
    let test = succeeded(
        Command::new("promtool")
            .args(["test", "rules"])
            .arg(dir.join("rules_test.yml")),
    );
    let said = String::from_utf8_lossy(&test.stdout);
    assert!(said.contains("SUCCESS"), "{said}");
}

/// Bad arguments are one line each, naming the argument, the value and what was expected.
#[test]
fn bad_arguments_are_one_line() {
    for (args, says) in [
        (
            vec!["metrics", "--textfile", "/tmp", "--every", "0"],
            "--every \"0\": expected a number of seconds",
        ),
        (
            vec!["metrics", "--every", "5"],
            "--every needs --textfile DIR",
        ),
        (
            vec!["metrics", "--listen", "0.0.0.0:9477"],
            "0.0.0.0 is not a loopback address",
        ),
        (
            vec!["metrics", "--listen", "somewhere"],
            "--listen \"somewhere\": expected ADDR:PORT",
        ),
        (
            vec!["metrics", "--textfile", "/nonexistent/dir"],
            "--textfile /nonexistent/dir: cannot write",
        ),
    ] {
        let out = clean(cli()).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.starts_with("tllm-affinity metrics: ") && err.contains(says),
            "{args:?}: {err}"
        );
    }
}

/// How long a scrape may take while other clients misbehave: half Prometheus' default scrape
/// timeout (10 s); 5 s is what a scrape took, and failed, before the server bounded its clients.
const SCRAPE_LIMIT: Duration = Duration::from_secs(5);

/// One `GET /metrics` on 127.0.0.1:`port`, given up after `limit`: how long the whole answer
/// took, or why there was none.
fn timed_scrape(port: u16, limit: Duration) -> Result<Duration, String> {
    let started = Instant::now();
    let mut stream =
        TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(limit)).unwrap();
    stream.set_write_timeout(Some(limit)).unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut response = Vec::new();
    // Asked to close the connection after the body, the server does; a read that times out is
    // the failure this measures.
    stream
        .read_to_end(&mut response)
        .map_err(|e| format!("no whole answer within {limit:?}: {e}"))?;
    let took = started.elapsed();
    let response = String::from_utf8_lossy(&response);
    if !response.starts_with("HTTP/1.1 200") || !response.contains("tllm_affinity_build_info") {
        return Err(format!("not the metrics: {response:.200}"));
    }
    if took > limit {
        return Err(format!("answered in {took:?}"));
    }
    Ok(took)
}

/// One local client pipelining 50 000 `GET /metrics` on connections it never reads (opening
/// another when the server closes one), 50 idle connections and one that reads a byte every
/// half second: another client's scrapes each answer whole within [`SCRAPE_LIMIT`], during the
/// flood and after it, the exporter's threads stay within its caps (64 connections, 32
/// readers) and it shows `tllm_affinity_scan_readers_stuck`. Loopback only, at most 20 s of
/// flood.
#[test]
fn clients_that_never_read_delay_no_other_scrape() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    let host = Sysfs::two_nodes();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut listen = clean(cli());
    listen
        .args(["metrics", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--sysfs-root")
        .arg(host.path());
    let exporter = Daemon::start("metrics --listen", listen, dir.path());
    let up = Instant::now() + Duration::from_secs(30);
    while timed_scrape(port, Duration::from_secs(20)).is_err() {
        assert!(Instant::now() < up, "not serving\n{}", exporter.log());
        std::thread::sleep(Duration::from_millis(100));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let flood = {
        let (stop, sent) = (stop.clone(), sent.clone());
        std::thread::spawn(move || {
            let request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
            let until = Instant::now() + Duration::from_secs(20);
            let mut connections = 0;
            while sent.load(Ordering::Relaxed) < 50_000
                && !stop.load(Ordering::Relaxed)
                && Instant::now() < until
            {
                let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                connections += 1;
                stream
                    .set_write_timeout(Some(Duration::from_secs(1)))
                    .unwrap();
                while sent.load(Ordering::Relaxed) < 50_000 && !stop.load(Ordering::Relaxed) {
                    if stream.write_all(request).is_err() {
                        break;
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            }
            connections
        })
    };
    let idle: Vec<TcpStream> = (0..50)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    let slow = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
                return;
            };
            let _ = write!(stream, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
            let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
            let mut byte = [0u8; 1];
            while !stop.load(Ordering::Relaxed) {
                if let Ok(0) = stream.read(&mut byte) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };

    // The exporter's threads: one a connection (at most 64), the scan's readers (at most 32),
    // and its main thread.
    let threads_of =
        |pid: u32| std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |tasks| tasks.count());
    let mut most_threads = 0;
    let mut during = Vec::new();
    let flood_ends = Instant::now() + Duration::from_secs(20);
    while during.len() < 8 || (!flood.is_finished() && Instant::now() < flood_ends) {
        let took = timed_scrape(port, SCRAPE_LIMIT).unwrap_or_else(|why| {
            stop.store(true, Ordering::Relaxed);
            panic!(
                "scrape {} during the flood ({} requests sent): {why}\n{}",
                during.len() + 1,
                sent.load(Ordering::Relaxed),
                exporter.log()
            )
        });
        during.push(took);
        most_threads = most_threads.max(threads_of(exporter.child.id()));
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    let connections = flood.join().unwrap();
    slow.join().unwrap();
    drop(idle);
    let mut after = Vec::new();
    for _ in 0..3 {
        let took = timed_scrape(port, SCRAPE_LIMIT)
            .unwrap_or_else(|why| panic!("a scrape after the flood: {why}\n{}", exporter.log()));
        after.push(took);
    }
    assert!(most_threads <= 64 + 32 + 1, "{most_threads} threads");
    let exposition = get(port, "/metrics").expect("the exporter answers").1;
    assert!(
        exposition
            .lines()
            .any(|l| l.starts_with("tllm_affinity_scan_readers_stuck ")),
        "{exposition}"
    );
    eprintln!(
        "flood: {} requests on {connections} connections; scrapes during: {} (slowest {:?}), \
         after: slowest {:?}; the exporter's threads at most {most_threads}",
        sent.load(Ordering::Relaxed),
        during.len(),
        during.iter().max().unwrap(),
        after.iter().max().unwrap()
    );
}

/// `--textfile` into a world-writable sticky directory (as /tmp is) where another user planted
/// symbolic links at the temporary names a writer would predict (its pid's, planted by the
/// shell that then execs the writer under the same pid, and a few guesses) and at the file's
/// own name, all to a file of root's: that file is unchanged, the `.prom` is a regular file,
/// not a link, and its mode is 0644 under umask 077 (node_exporter, its own user, reads it).
#[test]
fn the_textfile_follows_no_planted_link_and_is_0644_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;

    let host = Sysfs::two_nodes();
    let shared = tempfile::tempdir().unwrap();
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let victim = elsewhere.path().join("shadow");
    let content = "root:x:0:0:root:/root:/bin/bash\n";
    std::fs::write(&victim, content).unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    for guess in [
        ".tllm_affinity.prom.tmp",
        "tllm_affinity.prom.tmp",
        ".tllm_affinity.prom.1.tmp",
        ".tllm_affinity.prom.0.tmp",
        "tllm_affinity.prom",
    ] {
        std::os::unix::fs::symlink(&victim, shared.path().join(guess)).unwrap();
    }
    for round in 0..2 {
        let mut writer = clean("sh");
        writer
            .arg("-c")
            .arg(r#"ln -s "$VICTIM" "$DIR/.tllm_affinity.prom.$$.tmp" && umask 077 && exec "$@""#)
            .arg("sh")
            .arg(cli())
            .args(["metrics", "--textfile"])
            .arg(shared.path())
            .arg("--sysfs-root")
            .arg(host.path())
            .env("VICTIM", &victim)
            .env("DIR", shared.path());
        let out = writer.output().unwrap();
        assert!(out.status.success(), "round {round}: {}", output_text(&out));
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            content,
            "round {round}: the planted link's target was written"
        );
        let victim_mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777;
        assert_eq!(
            victim_mode, 0o600,
            "round {round}: the target's mode changed"
        );
        let written = shared.path().join("tllm_affinity.prom");
        let facts = std::fs::symlink_metadata(&written).unwrap();
        assert!(
            facts.file_type().is_file(),
            "round {round}: the .prom is {:?}, not a regular file",
            facts.file_type()
        );
        assert_eq!(
            facts.permissions().mode() & 0o7777,
            0o644,
            "round {round}: mode under umask 077"
        );
        let text = std::fs::read_to_string(&written).unwrap();
        assert!(text.contains("tllm_affinity_build_info"), "{text}");
    }
}
