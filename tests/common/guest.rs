//! The real-kernel tiers' harness (tests/guests/guest.rs, x86_64; tests/guests/guest_aarch64.rs, aarch64): a
//! guest machine booted with virtme-ng (`vng`) under QEMU's software emulation, one script of
//! `tests/guest/` run inside it, and the lines each of its scenarios printed
//! (`tests/guest/scenario.sh` prefixes them), parsed for the tests.
//!
//! A guest that cannot boot fails with one line saying why (QEMU error, timeout). A boot that
//! times out is tried once more; nothing else is retried.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{on_path, repo};

/// Where `scripts/setup` puts virtme-ng (a virtual environment, so that its `virtme-run` is
/// beside `vng` for the `PATH` vng needs).
pub const VNG_VENV: &str = "/var/cache/tllm-affinity/virtme-ng";

/// A guest machine and the script it runs.
pub struct Machine {
    pub name: &'static str,
    pub cpus: usize,
    pub memory: &'static str,
    /// `--numa` values: `SIZE[,cpus=A-B][,nodeid=N]` (vng passes what follows the size to
    /// QEMU's `-numa node`).
    pub numa: &'static [&'static str],
    pub qemu_opts: String,
    /// `--numa-distance SRC,DST=VAL` values.
    pub distances: Vec<String>,
    /// `/sys/devices/system/node/online` the guest must show.
    pub nodes: &'static str,
    pub script: &'static str,
    pub program: &'static str,
    /// Whether the script also runs the seed deployments (it then gets the Python, the test
    /// programs' directory and the native libraries the apps load).
    pub deployments: bool,
}

impl Machine {
    /// vng's options for this machine's CPUs, memory, NUMA nodes, distances and QEMU options.
    pub fn vng_args(&self) -> Vec<String> {
        let mut args = vec![
            "--disable-kvm".to_string(),
            "--cpus".to_string(),
            self.cpus.to_string(),
            "--memory".to_string(),
            self.memory.to_string(),
        ];
        for node in self.numa {
            args.extend(["--numa".to_string(), node.to_string()]);
        }
        for distance in &self.distances {
            args.extend(["--numa-distance".to_string(), distance.clone()]);
        }
        // One argument, with `=`: a value starting with `-` is otherwise read as an option.
        args.push(format!("--qemu-opts={}", self.qemu_opts));
        args
    }
}

/// Transparent huge pages at one phase of a move: the buffer's `AnonHugePages` from the
/// process's smaps, the host's from /proc/meminfo, and the kernel's count of huge page splits so
/// far (vmstat's `thp_split_page`, `thp_split_pmd`, `thp_migration_split`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Huge {
    pub buffer_kib: u64,
    pub host_kib: u64,
    pub splits: u64,
}

/// The move split no huge page: the kernel counted no split, and the host maps as many huge
/// pages after as before. (Not the buffer's smaps: NUMA balancing marks a huge page for a
/// hinting fault without splitting it, and smaps leaves such pages out; measured in the arm64
/// guest: 407 552 kB before and 188 416 kB after in smaps, with meminfo at 407 552 kB both times
/// and no split counted.) Returns the buffer's huge pages before, in kB.
pub fn huge_pages_stay_whole(run: &Scenario) -> u64 {
    let (before, after) = (run.huge("before"), run.huge("after"));
    println!("huge pages before {before:?}, after {after:?}");
    assert_eq!(
        after.splits,
        before.splits,
        "huge pages split:\n{}",
        run.stderr()
    );
    assert_eq!(
        after.host_kib,
        before.host_kib,
        "the host's huge pages:\n{}",
        run.stderr()
    );
    before.buffer_kib
}

/// What one scenario printed: stdout lines, stderr lines, exit status.
#[derive(Debug, Default, Clone)]
pub struct Scenario {
    pub out: Vec<String>,
    pub err: Vec<String>,
    pub status: Option<i32>,
}

impl Scenario {
    pub fn text(&self) -> String {
        self.out.join("\n")
    }

    pub fn stderr(&self) -> String {
        self.err.join("\n")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.text())
            .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}\n{}", self.text(), self.stderr()))
    }

    /// The words after `prefix` on each line that starts with it.
    pub fn lines(&self, prefix: &str) -> Vec<Vec<String>> {
        self.out
            .iter()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(|rest| rest.split_whitespace().map(str::to_string).collect())
            .collect()
    }

    /// `MASK <phase> <thread> <cpulist> [role]` → (cpulist, role).
    pub fn mask(&self, phase: &str, thread: &str) -> (String, Option<i32>) {
        self.lines("MASK ")
            .into_iter()
            .find(|w| w[0] == phase && w[1] == thread)
            .map(|w| (w[2].clone(), w.get(3).and_then(|r| r.parse().ok())))
            .unwrap_or_else(|| panic!("no MASK {phase} {thread}:\n{}", self.text()))
    }

    /// `PAGES <buffer> <node>=<n> ... fail=<n>` → pages per node, and the failures.
    pub fn pages(&self, buffer: &str) -> (BTreeMap<usize, usize>, usize) {
        let words = self
            .lines("PAGES ")
            .into_iter()
            .find(|w| w[0] == buffer)
            .unwrap_or_else(|| panic!("no PAGES {buffer}:\n{}", self.text()));
        let mut nodes = BTreeMap::new();
        let mut failed = usize::MAX;
        for w in &words[1..] {
            let (k, v) = w.split_once('=').expect("key=value");
            match k {
                "cpu" => {}
                "fail" => failed = v.parse().unwrap(),
                node => {
                    nodes.insert(node.parse().unwrap(), v.parse().unwrap());
                }
            }
        }
        (nodes, failed)
    }

    /// `HUGE <phase> <buffer kB> <host kB> <splits>` (tests/programs/memory_follows.c).
    pub fn huge(&self, phase: &str) -> Huge {
        let words = self
            .lines("HUGE ")
            .into_iter()
            .find(|w| w[0] == phase)
            .unwrap_or_else(|| panic!("no HUGE {phase}:\n{}", self.text()));
        let number = |i: usize| -> u64 {
            words
                .get(i)
                .and_then(|w| w.parse().ok())
                .unwrap_or_else(|| panic!("HUGE {phase}: word {i} of {words:?}"))
        };
        Huge {
            buffer_kib: number(1),
            host_kib: number(2),
            splits: number(3),
        }
    }

    /// `REPORT <json>`.
    pub fn report(&self) -> serde_json::Value {
        let line = self
            .out
            .iter()
            .find_map(|l| l.strip_prefix("REPORT "))
            .unwrap_or_else(|| panic!("no REPORT:\n{}", self.text()));
        serde_json::from_str(line).unwrap()
    }

    /// `POLICY <thread> <phase> <mode>`.
    pub fn policy(&self, thread: &str, phase: &str) -> i32 {
        self.lines("POLICY ")
            .into_iter()
            .find(|w| w[0] == thread && w[1] == phase)
            .and_then(|w| w[2].parse().ok())
            .unwrap_or_else(|| panic!("no POLICY {thread} {phase}:\n{}", self.text()))
    }
}

/// A booted guest's scenarios, by name, and how long the boot took.
#[derive(Debug)]
pub struct Booted {
    pub machine: &'static str,
    pub kernel_release: String,
    pub nodes: &'static str,
    pub scenarios: BTreeMap<String, Scenario>,
    pub wall: Duration,
}

impl Booted {
    /// A scenario that ran and exited 0.
    pub fn ok(&self, name: &str) -> &Scenario {
        let s = self.ran(name);
        assert_eq!(
            s.status,
            Some(0),
            "{}: scenario {name} failed:\n{}\n{}",
            self.machine,
            s.text(),
            s.stderr()
        );
        s
    }

    pub fn ran(&self, name: &str) -> &Scenario {
        self.scenarios.get(name).unwrap_or_else(|| {
            panic!(
                "{}: scenario {name} did not run; ran: {:?}",
                self.machine,
                self.scenarios.keys().collect::<Vec<_>>()
            )
        })
    }

    /// What every test checks first: the lines come from the guest's kernel, with the nodes the
    /// topology asked for, read from the real /sys.
    pub fn check_identity(&self) {
        let id = self.ok("guest");
        let value = |key: &str| {
            id.out
                .iter()
                .find_map(|l| l.strip_prefix(&format!("{key}=")))
                .unwrap_or_else(|| panic!("no {key}= from the guest:\n{}", id.text()))
                .to_string()
        };
        assert_eq!(value("uname"), self.kernel_release, "the guest's kernel");
        assert_eq!(value("nodes"), self.nodes, "the guest's NUMA nodes");
        assert_eq!(value("sysfs_root"), "unset", "no simulated sysfs root");
        assert_eq!(value("cgroup"), "cgroup2fs", "the guest's cgroup v2");
    }
}

/// Why there is no boot: something to install (a skip, or a failure in CI), or a guest that did
/// not boot (always a failure).
#[derive(Debug, Clone)]
pub enum NoBoot {
    Missing(String),
    Failed(String),
}

/// `vng`, and the `PATH` it runs with, or what is missing.
pub struct Vng {
    pub vng: PathBuf,
    pub path: OsString,
}

/// virtme-ng from its virtual environment (or `PATH`), with busybox for its initramfs.
pub fn vng() -> Result<Vng, String> {
    let venv_bin = Path::new(VNG_VENV).join("bin");
    let mut dirs = vec![venv_bin.clone()];
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let vng = dirs
        .iter()
        .map(|d| d.join("vng"))
        .find(|p| p.is_file())
        .ok_or(
            "virtme-ng (`vng`; scripts/setup installs it into /var/cache/tllm-affinity/virtme-ng)",
        )?;
    // vng runs `virtme-run` from PATH: its own directory first.
    let mut path_dirs = vec![vng.parent().unwrap().to_path_buf()];
    path_dirs.extend(dirs);
    let path = std::env::join_paths(path_dirs).unwrap();
    if !on_path("busybox") && !Path::new("/bin/busybox").exists() {
        return Err(
            "busybox (virtme-ng's initramfs; scripts/setup installs busybox-static)".into(),
        );
    }
    Ok(Vng { vng, path })
}

/// The guest's kernel image and its release (`uname -r` inside).
pub struct Kernel {
    pub image: PathBuf,
    pub release: String,
}

/// The newest `vmlinuz-*` of `boot_dir`, or None.
pub fn newest_kernel(boot_dir: &Path) -> Option<Kernel> {
    let mut kernels: Vec<PathBuf> = std::fs::read_dir(boot_dir)
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("vmlinuz-"))
                })
                .collect()
        })
        .unwrap_or_default();
    kernels.sort();
    let image = kernels.pop()?;
    let release = image.file_name()?.to_str()?["vmlinuz-".len()..].to_string();
    Some(Kernel { image, release })
}

/// One boot: vng's arguments (the kernel's `--run` and `--exec` aside) and the command it runs.
pub struct Boot<'a> {
    pub machine: &'a Machine,
    pub vng: &'a Vng,
    pub kernel: &'a Kernel,
    /// Everything vng is told besides the kernel and the command.
    pub args: Vec<OsString>,
    pub exec: String,
}

/// One guest at a time: each emulates its CPUs on this machine's.
static ONE_GUEST: Mutex<()> = Mutex::new(());

/// Boots `boot.machine` and runs its command; a boot past `limit` is tried once more.
pub fn boot(boot: &Boot, limit: Duration) -> Result<Booted, NoBoot> {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let name = boot.machine.name;
    let mut attempts = 0;
    loop {
        attempts += 1;
        match attempt(boot, limit) {
            Ok(booted) => return Ok(booted),
            Err(Attempt::TimedOut { finished }) if attempts == 1 => {
                println!(
                    "{name}: the guest did not finish in {} s (last scenario finished: {}); booting it once more",
                    limit.as_secs(),
                    finished.as_deref().unwrap_or("none")
                );
            }
            Err(Attempt::TimedOut { finished }) => {
                println!(
                    "{name}: timed out again (last scenario finished: {})",
                    finished.as_deref().unwrap_or("none")
                );
                return Err(NoBoot::Failed(format!(
                    "guest {name} did not boot: timeout, {} s twice (QEMU TCG under {})",
                    limit.as_secs(),
                    boot.kernel.image.display()
                )));
            }
            Err(Attempt::Failed(why)) => {
                return Err(NoBoot::Failed(format!("guest {name} did not boot: {why}")))
            }
        }
    }
}

enum Attempt {
    /// Killed at its limit; the last scenario that had finished by then, so that a slow one shows.
    TimedOut {
        finished: Option<String>,
    },
    Failed(String),
}

fn attempt(boot: &Boot, limit: Duration) -> Result<Booted, Attempt> {
    let logs = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (logs.path().join("out"), logs.path().join("err"));
    let mut cmd = Command::new(&boot.vng.vng);
    cmd.arg("--run")
        .arg(&boot.kernel.image)
        .args(&boot.args)
        .args(["--exec", &boot.exec])
        .env("PATH", &boot.vng.path)
        .env_remove("TLLM_AFFINITY_SYSFS_ROOT")
        .current_dir(repo())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .process_group(0);
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| Attempt::Failed(format!("{}: {e}", boot.vng.vng.display())))?;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            // SAFETY: killpg on the process group this function created for vng and its QEMU.
            unsafe { libc::killpg(child.id() as i32, libc::SIGKILL) };
            let _ = child.wait();
            let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
            let finished = stdout.lines().rev().find_map(|l| {
                let (name, rest) = l.split_at(l.find(['|', '!', '='])?);
                rest.starts_with('=').then(|| name.to_string())
            });
            return Err(Attempt::TimedOut { finished });
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let wall = started.elapsed();
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let scenarios = parse(&stdout);
    if !scenarios.contains_key("guest") {
        let last = stderr
            .lines()
            .chain(stdout.lines())
            .rfind(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return Err(Attempt::Failed(format!(
            "QEMU error (vng exited with {status}): {last}"
        )));
    }
    println!(
        "{}: booted {} and ran {} scenarios in {:.0} s",
        boot.machine.name,
        boot.kernel.release,
        scenarios.len(),
        wall.as_secs_f64()
    );
    Ok(Booted {
        machine: boot.machine.name,
        kernel_release: boot.kernel.release.clone(),
        nodes: boot.machine.nodes,
        scenarios,
        wall,
    })
}

/// The guest script's lines: `<name>| <stdout line>`, `<name>! <stderr line>`, `<name>= <status>`.
pub fn parse(stdout: &str) -> BTreeMap<String, Scenario> {
    let mut scenarios: BTreeMap<String, Scenario> = BTreeMap::new();
    for line in stdout.lines() {
        let line = line.trim_end_matches('\r');
        let Some(at) = line.find(['|', '!', '=']) else {
            continue;
        };
        let (name, rest) = line.split_at(at);
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            continue;
        }
        let text = rest[1..]
            .strip_prefix(' ')
            .unwrap_or(&rest[1..])
            .to_string();
        let s = scenarios.entry(name.to_string()).or_default();
        match rest.as_bytes()[0] {
            b'|' => s.out.push(text),
            b'!' => s.err.push(text),
            _ => s.status = text.trim().parse().ok(),
        }
    }
    scenarios
}

/// A boot made once per test binary (`make` boots), shared by its tests: the guest after its
/// identity check, what is missing (for `require!`), or a panic with why it did not boot.
pub fn booted(
    cell: &'static OnceLock<Result<Booted, NoBoot>>,
    make: impl FnOnce() -> Result<Booted, NoBoot>,
) -> Result<&'static Booted, String> {
    match cell.get_or_init(make) {
        Ok(b) => {
            b.check_identity();
            Ok(b)
        }
        Err(NoBoot::Missing(what)) => Err(what.clone()),
        Err(NoBoot::Failed(why)) => panic!("{why}"),
    }
}

/// What `numa_placement`'s `placement` scenario shows on every guest: after `configure(0)` the
/// worker `W` and its child `C` on `gpu_cpus` with the worker role, `main` and the host thread `H`
/// on `all` as hosts; after release all four on `all`; a worker scope's caller keeps `all` while
/// the thread `S` it creates inside is a worker on `gpu_cpus`; the report names `gpu` and its CPUs.
/// The report, for what a guest checks beyond this.
pub fn check_placement_and_release(
    run: &Scenario,
    gpu_cpus: &str,
    all: &str,
    gpu: &str,
) -> serde_json::Value {
    println!("{}", run.text());
    for (thread, mask, role) in [
        ("main", all, 0),
        ("H", all, 0),
        ("W", gpu_cpus, 1),
        ("C", gpu_cpus, 1),
    ] {
        assert_eq!(
            run.mask("configured", thread),
            (mask.to_string(), Some(role)),
            "{thread} after configure(0)\n{}",
            run.stderr()
        );
        assert_eq!(
            run.mask("released", thread).0,
            all,
            "{thread} after release"
        );
    }
    assert_eq!(run.mask("scope", "main").0, all);
    assert_eq!(run.mask("scope", "S"), (gpu_cpus.to_string(), Some(1)));
    let report = run.report();
    assert_eq!(report["worker_mask"], gpu_cpus, "{report}");
    assert_eq!(report["worker_device"], gpu, "{report}");
    report
}

/// `topo`'s entry for a GPU (`device`), `plan --gpu` of it and the mask a real `configure` of it
/// gave (`configured`) all name `cpus` as the GPU's CPUs.
pub fn topo_plan_and_configure_agree(
    device: &serde_json::Value,
    plan: &serde_json::Value,
    configured: &str,
    cpus: &str,
) {
    for (who, named) in [
        ("topo", device["local_cpus"].clone()),
        ("plan", plan["worker"]["cpus"].clone()),
        ("configure", serde_json::json!(configured)),
    ] {
        assert_eq!(named, cpus, "{who}: {}'s CPUs", device["address"]);
    }
}

/// The host threads of `numa_placement` (main and H) have the default memory policy (MPOL_DEFAULT,
/// 0) before and after the configure.
pub fn host_threads_keep_the_default_policy(run: &Scenario) {
    for (thread, phase) in [
        ("main", "before"),
        ("main", "configured"),
        ("H", "before"),
        ("H", "configured"),
    ] {
        assert_eq!(run.policy(thread, phase), 0, "{thread} {phase}");
    }
}

/// Every page `numa_placement`'s workers first touched (a worker, its child, a scope's caller)
/// lies on `node`, and `move_pages` placed each.
pub fn workers_pages_all_on(run: &Scenario, node: usize) {
    for buffer in ["worker", "child", "scoped"] {
        let (nodes, failed) = run.pages(buffer);
        println!("pages {buffer}: {nodes:?}");
        assert_eq!(failed, 0, "{buffer}: pages move_pages could not place");
        assert_eq!(
            nodes.keys().copied().collect::<Vec<_>>(),
            [node],
            "{buffer}: every page on node {node}, {nodes:?}"
        );
    }
}

/// `tllm-affinity ps PID --json` (`ps`) shows a worker thread whose mask is `cpus`.
pub fn ps_shows_a_worker_on(ps: &serde_json::Value, cpus: &str) {
    let threads = ps["threads"].as_array().unwrap();
    assert!(
        threads
            .iter()
            .any(|t| t["role"] == "worker" && t["mask"] == cpus),
        "{ps}"
    );
}
