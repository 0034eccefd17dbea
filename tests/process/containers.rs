//! Containers (docs/containers.md): the CDI device `tllm-affinity cdi` writes, requested from real
//! podman containers (runc, as root) that run real programs with the real library, every mask
//! read by the host from `/proc`.
//!
//! No image registry is reachable, so the images are root filesystems built here: host files
//! copied with the libraries `ldd` names (a glibc image, one without libgcc, a musl image, a
//! scratch image with a static binary), and Debian bullseye (glibc 2.31) from `debootstrap`,
//! cached in `/var/cache/tllm-affinity` and shared with tests/process/wheel.rs. Each test writes its own
//! spec (a device of its own name) to `/var/run/cdi` and removes it when it ends.
//!
//! A container has its own PID namespace: the programs print the tids they see, and the host
//! finds each thread through the `NSpid:` lines of `/proc/<host pid>/task/*/status`.
//!
//! Simulated host (Sysfs::two_nodes, mounted at /sim): device 0's GPU is local to node 1. With two
//! CPUs: node0 = {0}, node1 = {1}.

use crate::common;
use crate::hostile_files;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use hostile_files::*;
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(60);
const CDI_DIR: &str = "/var/run/cdi";
const IN_CONTAINER_LIBRARY: &str = "/opt/tllm-affinity/libtllm_affinity.so";
/// Where the test programs sit inside the images.
const OPT: &str = "/opt/test";

// ---- podman and the device ----

/// Root, podman and runc: what every container case needs; the error (for `require!`) names
/// the first one missing.
fn container_tools() -> Result<(), String> {
    if !root() {
        return Err("root (podman, CDI)".into());
    }
    match ["podman", "runc"].into_iter().find(|p| !on_path(p)) {
        Some(missing) => Err(format!("`{missing}` on PATH")),
        None => Ok(()),
    }
}

fn text(out: &Output) -> String {
    output_text(out)
}

/// A CDI spec written by `tllm-affinity cdi --name <unique>` into /var/run/cdi, removed on drop.
struct Device {
    name: String,
    spec_path: PathBuf,
    _state: tempfile::TempDir,
    /// What `cdi` printed on stderr.
    stderr: String,
}

impl Device {
    /// The spec for `library` (None: the one `run` finds, target/release's).
    fn new(case: &str, library: Option<&Path>) -> Device {
        let name = format!("test-{}-{case}", std::process::id());
        let spec_path = Path::new(CDI_DIR).join(format!("tllm-affinity-{name}.json"));
        let state = tempfile::tempdir().unwrap();
        let mut cmd = clean(cli());
        cmd.args(["cdi", "--name", &name, "--output"])
            .arg(&spec_path)
            .arg("--state-dir")
            .arg(state.path());
        if let Some(library) = library {
            cmd.env("TLLM_AFFINITY_LIB", library);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "tllm-affinity cdi: {}", text(&out));
        Device {
            name,
            spec_path,
            _state: state,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn request(&self) -> String {
        format!("tllm-affinity.dev/preload={}", self.name)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.spec_path);
    }
}

/// `podman run` of `argv` in the root filesystem `root`, with the device when given, `options`
/// before the root; stdin open for programs driven phase by phase.
fn podman(root: &Path, device: Option<&Device>, options: &[&str], argv: &[&str]) -> Command {
    let mut cmd = Command::new("podman");
    // crun refuses this host's hybrid cgroups; default ulimits need CAP_SYS_RESOURCE.
    cmd.args([
        "--runtime",
        "runc",
        "run",
        "--rm",
        "-i",
        "--network",
        "none",
    ])
    .args([
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=1000:1000",
    ]);
    if let Some(device) = device {
        cmd.arg("--device").arg(device.request());
    }
    cmd.args(options).arg("--rootfs").arg(root).args(argv);
    cmd
}

/// `--name` for a container whose host pid the test needs.
fn container_name(case: &str) -> String {
    format!("tllm-affinity-test-{}-{case}", std::process::id())
}

/// The host pid of the named container's first process, once it runs.
fn host_pid(name: &str) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = Command::new("podman")
            .args(["inspect", "--format", "{{.State.Pid}}", name])
            .output()
            .unwrap();
        let pid: u32 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0);
        if pid > 0 {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "podman inspect {name}: {}",
            text(&out)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Threads of a host process by their id in its own PID namespace (the last `NSpid:` entry).
fn tids_by_namespace_tid(pid: u32) -> BTreeMap<i32, i32> {
    let mut map = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return map;
    };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let inner = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|v| v.split_whitespace().last()?.parse().ok());
        if let Some(inner) = inner {
            map.insert(inner, tid);
        }
    }
    map
}

/// The next `PHASE` line of a containerised program, each named thread's mask read by the host
/// from `/proc/<host pid>/task/<host tid>` (threads gone since are left out).
fn container_phase(run: &mut Driver, pid: u32) -> Phase {
    let line = run.line("PHASE ");
    std::thread::sleep(Duration::from_millis(50));
    phase_from_line(&line, pid)
}

// ---- Root filesystems ----

/// `path` (symbolic links followed) copied to the same path under `root`.
fn add(root: &Path, path: &Path) {
    let to = root.join(path.strip_prefix("/").unwrap_or(path));
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(path, &to).unwrap_or_else(|e| panic!("copy {}: {e}", path.display()));
}

/// The libraries `ldd` names for `files` (the loader included), absolute.
fn ldd_libraries(files: &[PathBuf]) -> Vec<PathBuf> {
    let out = Command::new("ldd").args(files).output().unwrap();
    let mut libs: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/') && !w.ends_with(':'))
        .map(PathBuf::from)
        .collect();
    libs.sort();
    libs.dedup();
    libs
}

/// `files` and their libraries copied into `root`.
fn add_with_libraries(root: &Path, files: &[PathBuf]) {
    for file in files.iter().chain(&ldd_libraries(files)) {
        add(root, file);
    }
}

/// A directory tree copied under `root`, at `to` (absolute inside the image).
fn add_tree(root: &Path, from: &Path, to: &str) {
    let dest = root.join(to.trim_start_matches('/'));
    std::fs::create_dir_all(&dest).unwrap();
    let status = Command::new("cp")
        .arg("-rL")
        .arg(format!("{}/.", from.display()))
        .arg(&dest)
        .status()
        .unwrap();
    assert!(status.success(), "cp -rL {}", from.display());
}

/// A fresh, empty image directory under target/containers (one test binary at a time builds
/// it: cargo runs test binaries one after another).
fn image_dir(name: &str) -> PathBuf {
    let dir = target_dir().join("containers").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A glibc image: coreutils, taskset, the C population with its worker library, the probe, and
/// the Python interpreter with its standard library and the zero-code fixture (tests/programs).
fn glibc_image() -> &'static Path {
    static IMAGE: OnceLock<PathBuf> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let root = image_dir("glibc");
        let mut files: Vec<PathBuf> = ["true", "ls", "cat", "env", "sh", "taskset"]
            .iter()
            .map(|p| which(p))
            .collect();
        files.push(python());
        // glibc loads it for pthread_exit and cancellation, which Python's threads use: every
        // image with a threaded interpreter has it (the image without it is another case).
        files.push(libgcc_s());
        add_with_libraries(&root, &files);
        let opt = root.join(OPT.trim_start_matches('/'));
        std::fs::create_dir_all(&opt).unwrap();
        for (built, name) in [
            (Program::c("population").build(), "population"),
            (Program::c("nccl").shared().build(), "libnccl.so.2"),
            (
                Program::c("container_probe").named("probe_glibc").build(),
                "probe",
            ),
            (openmp_library(), "libopenmp_region.so"),
        ] {
            std::fs::copy(&built, opt.join(name)).unwrap();
            add_with_libraries(&root, &[built]);
        }
        add_python_stdlib(&root);
        add_tree(&root, &programs_dir(), &format!("{OPT}/programs"));
        root
    })
}

/// The host's libgcc_s.so.1, as the C compiler names it.
fn libgcc_s() -> PathBuf {
    let out = Command::new("cc")
        .arg("-print-file-name=libgcc_s.so.1")
        .output()
        .unwrap();
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(path.is_absolute(), "cc does not know libgcc_s.so.1");
    path.canonicalize().unwrap()
}

/// A program on PATH, its symbolic links followed.
fn which(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not on PATH"))
        .canonicalize()
        .unwrap()
}

/// The interpreter's standard library (not its site-packages: the image has none of the host's
/// packages), with the libraries its extension modules need.
fn add_python_stdlib(root: &Path) {
    let out = Command::new(python())
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['stdlib']); \
             print(sysconfig.get_config_var('DESTSHARED') or '')",
        ])
        .output()
        .unwrap();
    let paths = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = paths.lines();
    let stdlib = PathBuf::from(lines.next().unwrap());
    let mut tar = Command::new("tar")
        .arg("-C")
        .arg("/")
        .args(["-ch", "--ignore-failed-read"])
        .args([
            "--exclude=site-packages",
            "--exclude=dist-packages",
            "--exclude=test",
            "--exclude=idlelib",
            "--exclude=tkinter",
            "--exclude=ensurepip",
            "--exclude=__pycache__",
            "--exclude=sitecustomize.py",
            "-f",
            "-",
        ])
        .arg(stdlib.strip_prefix("/").unwrap())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let untar = Command::new("tar")
        .arg("-C")
        .arg(root)
        .arg("-xf")
        .arg("-")
        .stdin(tar.stdout.take().unwrap())
        .status()
        .unwrap();
    // The reading side may say some files vanished or could not be read; the unpacking decides.
    let _ = tar.wait();
    assert!(untar.success(), "copying {}", stdlib.display());
    let mut modules: Vec<PathBuf> = Vec::new();
    for dir in [
        stdlib.join("lib-dynload"),
        PathBuf::from(lines.next().unwrap_or("")),
    ] {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            modules.extend(
                entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|e| e == "so")),
            );
        }
    }
    for lib in ldd_libraries(&modules) {
        add(root, &lib);
    }
    // Debian's interpreter keeps its extension modules outside the stdlib directory.
    for module in modules {
        if !root.join(module.strip_prefix("/").unwrap()).exists() {
            add(root, &module);
        }
    }
}

/// A copy of the glibc image's coreutils and the probe without `libgcc_s.so.1`, as distroless
/// and static-first images are.
fn no_libgcc_image() -> PathBuf {
    let root = image_dir("no-libgcc");
    let files: Vec<PathBuf> = ["true", "ls", "cat"].iter().map(|p| which(p)).collect();
    add_with_libraries(&root, &files);
    let built = Program::c("container_probe").named("probe_glibc").build();
    add_with_libraries(&root, std::slice::from_ref(&built));
    std::fs::create_dir_all(root.join(OPT.trim_start_matches('/'))).unwrap();
    std::fs::copy(&built, root.join("opt/test/probe")).unwrap();
    assert!(
        !walk(&root).iter().any(|p| p.ends_with("libgcc_s.so.1")),
        "the image must not hold libgcc_s.so.1"
    );
    root
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            found.extend(walk(&path));
        } else {
            found.push(path);
        }
    }
    found
}

/// A musl image (musl's loader and a musl-built probe, no glibc at all) that also holds a
/// statically linked probe, as a scratch image would.
fn musl_and_static_image() -> Result<PathBuf, String> {
    if !on_path("musl-gcc") {
        return Err("`musl-gcc` on PATH".into());
    }
    let root = image_dir("musl");
    let musl = Program::c("container_probe")
        .compiler(&["musl-gcc"])
        .named("probe_musl")
        .build();
    let stat = Program::c("container_probe")
        .named("probe_static")
        .flags(&["-static"])
        .build();
    let loader = Path::new("/lib/ld-musl-x86_64.so.1")
        .canonicalize()
        .unwrap();
    let to = root.join("lib/ld-musl-x86_64.so.1");
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(&loader, &to).unwrap();
    std::fs::create_dir_all(root.join("opt/test")).unwrap();
    std::fs::copy(&musl, root.join("opt/test/probe_musl")).unwrap();
    std::fs::copy(&stat, root.join("opt/test/probe_static")).unwrap();
    assert!(
        !walk(&root)
            .iter()
            .any(|p| p.to_string_lossy().contains("libc.so.6")),
        "the musl image must hold no glibc"
    );
    Ok(root)
}

/// Runs `argv` in `root` with and without the device: the two runs must be the same (status,
/// stdout, stderr), and succeed.
fn same_with_and_without(root: &Path, device: &Device, argv: &[&str]) -> String {
    let without = podman(root, None, &[], argv).output().unwrap();
    let with = podman(root, Some(device), &[], argv).output().unwrap();
    assert!(
        without.status.success(),
        "{argv:?} without the device: {}",
        text(&without)
    );
    assert_eq!(
        (with.status.code(), &with.stdout, &with.stderr),
        (without.status.code(), &without.stdout, &without.stderr),
        "{argv:?} with the device:\n{}\nwithout:\n{}",
        text(&with),
        text(&without)
    );
    String::from_utf8_lossy(&with.stdout).into_owned()
}

// ---- The library itself ----

/// `readelf -d`'s NEEDED entries of a file.
fn needed(file: &Path) -> Vec<String> {
    let out = Command::new("readelf")
        .arg("-d")
        .arg(file)
        .output()
        .unwrap();
    assert!(out.status.success(), "readelf -d: {}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l.split('[').nth(1)?.trim_end_matches(']').to_string()))
        .collect()
}

/// The library `cargo build --release` makes (the one `run` and `cdi` find beside the command)
/// needs glibc alone: an injected library that needed libgcc_s.so.1 stopped every program of an
/// image without it. The unwinder it links instead stays private (the engine's fail-open
/// catch_unwind needs one; the program's own C++ exceptions keep theirs).
#[test]
fn the_release_library_needs_glibc_alone() {
    require!(on_path("readelf"), "`readelf` on PATH");
    let lib = library();
    let needs = needed(&lib);
    println!("readelf -d {}: NEEDED {needs:?}", lib.display());
    for entry in &needs {
        assert!(
            [
                "libc.so.6",
                "ld-linux-x86-64.so.2",
                "libpthread.so.0",
                "libdl.so.2",
                "libm.so.6"
            ]
            .contains(&entry.as_str()),
            "{} needs {entry} beyond glibc: {needs:?}",
            lib.display()
        );
    }
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .unwrap();
    let exported = String::from_utf8_lossy(&out.stdout);
    assert!(
        !exported.contains("_Unwind_"),
        "the static unwinder must not be exported:\n{exported}"
    );
}

// ---- The spec ----

/// `cdi` writes a 0.5.0 spec for tllm-affinity.dev/preload=default: read-only mounts of the
/// library `run` finds, of an ld.so.preload naming its container path, and of the Python hook;
/// no variable at all. A library that needs more than glibc is refused; one that needs a newer
/// glibc than 2.17 is named with the glibc it needs.
#[test]
fn cdi_writes_a_0_5_0_spec_that_mounts_the_library_and_sets_no_variable() {
    let state = tempfile::tempdir().unwrap();
    let out = clean(cli())
        .args(["cdi", "--state-dir"])
        .arg(state.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let spec: Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{}", serde_json::to_string_pretty(&spec).unwrap());
    assert_eq!(spec["cdiVersion"], "0.5.0");
    assert_eq!(spec["kind"], "tllm-affinity.dev/preload");
    assert_eq!(spec["devices"].as_array().unwrap().len(), 1);
    let device = &spec["devices"][0];
    assert_eq!(device["name"], "default");
    let text_spec = serde_json::to_string(&spec).unwrap();
    assert!(
        !text_spec.contains("\"env\""),
        "the spec must set no variable (CDI env wins over -e): {text_spec}"
    );
    let mounts: BTreeMap<String, &Value> = device["containerEdits"]["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["containerPath"].as_str().unwrap().to_string(), m))
        .collect();
    for m in mounts.values() {
        assert!(
            m["options"].as_array().unwrap().contains(&"ro".into()),
            "read-only: {m}"
        );
    }
    assert_eq!(
        mounts[IN_CONTAINER_LIBRARY]["hostPath"],
        library().to_string_lossy().as_ref()
    );
    let preload = PathBuf::from(mounts["/etc/ld.so.preload"]["hostPath"].as_str().unwrap());
    assert_eq!(preload, state.path().join("ld.so.preload"));
    assert_eq!(
        std::fs::read_to_string(&preload).unwrap(),
        format!("{IN_CONTAINER_LIBRARY}\n")
    );
    assert_eq!(
        mounts["/opt/tllm-affinity/python/tllm_affinity"]["hostPath"],
        repo()
            .join("python/tllm_affinity")
            .to_string_lossy()
            .as_ref()
    );
    assert!(mounts.contains_key("/opt/tllm-affinity/python/_tllm_affinity_hook.py"));
    // The release build links against this host's glibc: cdi says which glibc an image needs.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("needs glibc 2.") && stderr.contains("older glibc"),
        "{stderr}"
    );

    // --output writes the file (0644, through a rename) and names the device.
    let file = state.path().join("cdi/tllm-affinity.json");
    let out = clean(cli())
        .args(["cdi", "--name", "canary", "--state-dir"])
        .arg(state.path())
        .arg("--output")
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let written: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(written["devices"][0]["name"], "canary");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o644
    );
    assert_eq!(
        std::fs::read_dir(file.parent().unwrap()).unwrap().count(),
        1
    );

    // A library that needs libgcc_s.so.1 would stop every program of an image without it.
    let needs_libgcc = state.path().join("libtllm_affinity.so");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-x", "c", "/dev/null", "-o"])
        .arg(&needs_libgcc)
        .args(["-Wl,--no-as-needed", "-lgcc_s"])
        .output()
        .unwrap();
    assert!(built.status.success(), "{}", text(&built));
    let out = clean(cli())
        .args(["cdi", "--state-dir"])
        .arg(state.path())
        .env("TLLM_AFFINITY_LIB", &needs_libgcc)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    says(&stderr, &["needs libgcc_s.so.1 beyond glibc"]);
    assert!(out.stdout.is_empty());
}

// ---- A glibc image ----

const WORKERS: [&str; 9] = ["W", "C1", "G1", "C2", "C3", "C4", "C5", "C6", "P1"];

/// The C population in the glibc image with the device, the simulated host mounted at /sim.
fn population_in_container(
    device: &Device,
    sysfs: &Sysfs,
    name: &str,
    options: &[&str],
    prefix: &[&str],
) -> Command {
    let sim = format!("{}:/sim:ro", sysfs.path().display());
    let mut all = vec![
        "--name",
        name,
        "-v",
        &sim,
        "-e",
        "TLLM_AFFINITY_SYSFS_ROOT=/sim",
        "-e",
        "TLLM_AFFINITY_LOG=debug",
        "-e",
        "FAKE_NCCL=/opt/test/libnccl.so.2",
    ];
    all.extend_from_slice(options);
    let mut argv: Vec<&str> = prefix.to_vec();
    argv.extend(["/opt/test/population", "0"]);
    podman(glibc_image(), Some(device), &all, &argv)
}

/// Drives the population: returns every phase the host read, and the end.
fn population_phases<const N: usize>(cmd: Command, name: &str) -> ([Phase; N], Finished) {
    let mut pid = 0;
    Driver::spawn(cmd, LIMIT).phases_with(|run| {
        if pid == 0 {
            // The container exists once it printed something; ask podman for its host pid.
            let first = run.line("PHASE ");
            pid = host_pid(name);
            return phase_from_line(&first, pid);
        }
        container_phase(run, pid)
    })
}

/// [`population_phases`] of [`population_in_container`], in a container named after `case`; the
/// phases are printed as the host read them.
fn population_run<const N: usize>(
    device: &Device,
    sysfs: &Sysfs,
    case: &str,
    options: &[&str],
    prefix: &[&str],
) -> ([Phase; N], Finished) {
    let name = container_name(case);
    let (phases, end) = population_phases::<N>(
        population_in_container(device, sysfs, &name, options, prefix),
        &name,
    );
    for phase in &phases {
        println!("  {}", describe(phase));
    }
    (phases, end)
}

/// [`container_phase`] for a line already read.
fn phase_from_line(line: &str, pid: u32) -> Phase {
    let host = tids_by_namespace_tid(pid);
    parse_phase(&line["PHASE ".len()..], pid, |tid| host.get(&tid).copied())
}

/// What the glibc image's population cases share: a device of their own, the simulated host and
/// its masks (every allowed CPU, node 0's, node 1's: GPU 0's local set).
struct Glibc {
    device: Device,
    sysfs: Sysfs,
    all: String,
    node0: String,
    local: String,
}

impl Glibc {
    /// The error (for [`require!`]) names what is missing: the container tools, or two CPUs,
    /// which `why` needs.
    fn new(name: &str, why: &str) -> Result<Glibc, String> {
        container_tools()?;
        two_cpus(why)?;
        let device = Device::new(name, None);
        let sysfs = Sysfs::two_nodes();
        Ok(Glibc {
            device,
            all: allowed_cpus().to_list(),
            node0: sysfs.node0.to_list(),
            local: sysfs.node1.to_list(),
            sysfs,
        })
    }

    /// [`population_run`] with this device on this host.
    fn population<const N: usize>(
        &self,
        case: &str,
        options: &[&str],
        prefix: &[&str],
    ) -> ([Phase; N], Finished) {
        population_run(&self.device, &self.sysfs, case, options, prefix)
    }
}

/// With the device, a mixed population in a glibc container gets what it gets on the host:
/// host threads keep their masks, the worker's threads (and the worker library's) get the
/// GPU-local set, the last release restores; no false "constrained".
#[test]
fn a_glibc_container_runs_a_mixed_population_with_roles_and_masks() {
    let glibc = require!(Glibc::new("mixed", "a worker set narrower than the host"));
    let (all, local) = (&glibc.all, &glibc.local);
    let started = Instant::now();
    let (phases, end) = glibc.population::<5>("mixed", &[], &[]);
    println!(
        "$ podman run --device {} -v <simulated sysfs>:/sim:ro -e TLLM_AFFINITY_SYSFS_ROOT=/sim \
         --rootfs <glibc image> /opt/test/population 0   ({:.1} s)",
        glibc.device.request(),
        started.elapsed().as_secs_f64()
    );
    println!("{}", end.stderr);
    assert!(end.status.success(), "{}", end.stderr);
    let [before, configured, _twice, released, _after] = &phases;
    assert_eq!(
        before.role("W"),
        0,
        "the library is loaded in the container"
    );
    expect(configured, Named(&WORKERS), worker_on(local), "worker");
    expect(configured, Named(&["main", "H1"]), host_on(all), "host");
    expect(released, All, on(all), "after release");
    let pinned =
        format!("CPU affinity set to [{local}] for optimal NUMA-aware scheduling (9/9 threads)");
    says(&end.stderr, &["constrained: false", &pinned]);
}

/// A container limited by `--cpuset-cpus` is not constrained: the worker set is the GPU-local
/// set within the cpuset, no "constrained" warning.
#[test]
fn a_containers_own_cpuset_is_not_a_constraint() {
    let glibc = require!(Glibc::new("cpuset", "a cpuset narrower than the host"));
    let local = &glibc.local;
    let (phases, end) = glibc.population::<2>("cpuset", &["--cpuset-cpus", local], &[]);
    let configured = &phases[1];
    assert_eq!(
        &configured.mask("main"),
        local,
        "the cpuset is the main thread's mask"
    );
    expect(configured, Named(&WORKERS), worker_on(local), "worker");
    says(
        &end.stderr,
        &[&format!("cpuset [{local}], constrained: false")],
    );
    never_says(&end.stderr, &["Removing CPU affinity constraints"]);
}

/// `taskset` inside the container is a launcher's binding: constrained, so (policy unset) the
/// workers get every CPU the cpuset allows, the host threads keep the taskset mask.
#[test]
fn taskset_inside_a_container_is_a_constraint() {
    let glibc = require!(Glibc::new("taskset", "a binding narrower than the host"));
    let pinned = &glibc.node0;
    let (phases, end) = glibc.population::<2>("taskset", &[], &["taskset", "-c", pinned]);
    let configured = &phases[1];
    let keeps = "a host thread keeps the binding";
    expect(configured, Named(&["main", "H1"]), on(pinned), keeps);
    expect(configured, Named(&WORKERS), worker_on(&glibc.all), "worker");
    says(
        &end.stderr,
        &["constrained: true", "Removing CPU affinity constraints"],
    );
}

/// The user's own variables decide the policy inside (the spec sets none, so `-e` is not
/// overridden): keep leaves every mask, TLLM_AFFINITY_CPUS names the set.
#[test]
fn the_users_policy_variables_decide_inside_the_container() {
    let glibc = require!(Glibc::new("policy", "a worker set narrower than the host"));
    let all = &glibc.all;
    let cpus = format!("TLLM_AFFINITY_CPUS={}", glibc.node0);
    for (variable, workers) in [
        ("TLLM_NUMA_AWARE_WORKER_AFFINITY=0", all),
        ("TLLM_AFFINITY_POLICY=keep", all),
        (cpus.as_str(), &glibc.node0),
    ] {
        let case = format!("policy-{}", variable.len());
        let (phases, end) = glibc.population::<2>(&case, &["-e", variable], &[]);
        println!("-e {variable}: {}", describe(&phases[1]));
        let why = format!("-e {variable}\n{}", end.stderr);
        expect(&phases[1], Named(&WORKERS), worker_on(workers), &why);
        assert_eq!(&phases[1].mask("main"), all, "-e {variable}: main");
    }
}

/// The population (tests/programs/population.c) started in a container of its own, named after
/// `case`, and configured: the container's library and host, the run, the process's host pid and
/// the phase after its configure.
fn configured_in_container(case: &str) -> Result<(Glibc, Driver, u32, Phase), String> {
    let glibc = Glibc::new(case, "a worker set narrower than the host")?;
    let name = container_name(case);
    let in_container = population_in_container(&glibc.device, &glibc.sysfs, &name, &[], &[]);
    let mut run = Driver::spawn(in_container, LIMIT);
    run.line("PHASE ");
    let pid = host_pid(&name);
    run.proceed();
    let configured = container_phase(&mut run, pid);
    Ok((glibc, run, pid, configured))
}

/// `tllm-affinity ps <host pid>` on the host shows a containerised process's roles: its table
/// is in the container's own /dev/shm, under its pid in its own namespace, with its own tids;
/// `tllm-affinity ps` without a PID lists it under its host pid.
#[test]
fn ps_on_the_host_shows_the_roles_of_a_containerised_process() {
    let (glibc, run, pid, configured) = require!(configured_in_container("ps"));
    let out = clean(cli())
        .args(["ps", "--json", &pid.to_string()])
        .output()
        .unwrap();
    let text_out = clean(cli())
        .args(["ps", "--no-color", &pid.to_string()])
        .output()
        .unwrap();
    println!("{}", String::from_utf8_lossy(&text_out.stdout));
    // The host view finds it too, under its host pid, with its lease's GPU.
    let host_view = clean(cli())
        .args(["ps", "--json", "--sysfs-root"])
        .arg(glibc.sysfs.path())
        .output()
        .unwrap();
    let end = run.finish();
    assert!(host_view.status.success(), "{}", text(&host_view));
    let view: Value = serde_json::from_slice(&host_view.stdout).unwrap();
    let row = row(&view, "processes", "pid", pid);
    assert_eq!(row["namespace_pid"], 1, "{row:#}");
    assert_eq!(row["leases"][0]["device"], "0000:3b:00.0", "{row:#}");
    assert_eq!(row["worker_cpus"], glibc.local.as_str(), "{row:#}");
    assert!(out.status.success(), "{}", text(&out));
    let ps: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ps["table"], true, "{ps}\n{}", end.stderr);
    assert_eq!(ps["namespace_pid"], 1, "{ps}");
    let by_tid: BTreeMap<i64, &Value> = ps["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["tid"].as_i64().unwrap(), t))
        .collect();
    for (thread, seen) in &configured.threads {
        let row = by_tid
            .get(&(seen.tid as i64))
            .unwrap_or_else(|| panic!("{thread} (host tid {}) not in {ps}", seen.tid));
        let expected = if seen.role == 1 { "worker" } else { "host" };
        assert_eq!(row["role"], expected, "{thread}: {row}");
        assert_eq!(row["mask"], seen.mask.to_list(), "{thread}: {row}");
    }
    assert!(String::from_utf8_lossy(&text_out.stdout).contains("pid 1 in its PID namespace"));
}

// ---- Images where the library cannot load or act ----

/// In a musl image and for a static binary the device changes nothing: the same output, status
/// and (empty) stderr with and without it. The musl loader ignores /etc/ld.so.preload; through
/// `LD_PRELOAD` (which musl honours) the same library would abort every musl program.
#[test]
fn musl_and_static_programs_run_exactly_as_without_the_device() {
    require!(container_tools());
    let root = require!(musl_and_static_image());
    let device = Device::new("musl", None);
    for program in ["/opt/test/probe_musl", "/opt/test/probe_static"] {
        let out = same_with_and_without(&root, &device, &[program]);
        println!("{program}: {}", out.trim());
        assert!(out.contains("library=no"), "{program}: {out}");
    }
    let preload = format!("LD_PRELOAD={IN_CONTAINER_LIBRARY}");
    let aborted = podman(
        &root,
        Some(&device),
        &["-e", &preload],
        &["/opt/test/probe_musl"],
    )
    .output()
    .unwrap();
    println!("musl under LD_PRELOAD instead: {}", text(&aborted));
    assert_eq!(aborted.status.code(), Some(127), "{}", text(&aborted));
}

/// In an image without libgcc_s.so.1 every program starts and runs as without the device, and
/// the library is loaded and acts (the probe's thread is seen).
#[test]
fn an_image_without_libgcc_runs_as_without_the_device() {
    require!(container_tools());
    let root = no_libgcc_image();
    let device = Device::new("nolibgcc", None);
    for argv in [
        &["true"][..],
        &["ls", "/opt/test"],
        &["cat", "/etc/ld.so.preload"],
    ] {
        let with = podman(&root, Some(&device), &[], argv).output().unwrap();
        assert!(
            with.status.success() && with.stderr.is_empty(),
            "{argv:?}: {}",
            text(&with)
        );
    }
    let with = podman(&root, Some(&device), &[], &["/opt/test/probe"])
        .output()
        .unwrap();
    let without = podman(&root, None, &[], &["/opt/test/probe"])
        .output()
        .unwrap();
    println!("with: {}without: {}", text(&with), text(&without));
    assert!(
        with.status.success() && with.stderr.is_empty(),
        "{}",
        text(&with)
    );
    let [with, without] =
        [&with, &without].map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    says(&with, &["library=yes"]);
    assert_eq!(
        with.replace("library=yes", "library=no"),
        without,
        "the same masks with and without"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// Debian bullseye (glibc 2.31) with the wheel's library (glibc 2.17, no libgcc): programs start
/// as without the device, and the library works (roles of a threaded program). The release
/// build's library, which needs this host's newer glibc, is what `cdi` warns about: in that
/// image the loader refuses it and every program fails to start, which the test shows too.
#[test]
fn an_image_with_an_older_glibc_runs_with_the_wheels_library() {
    require!(container_tools());
    let wheel_library = require!(wheel_library());
    let bullseye = require!(bullseye_rootfs());
    let (_copy, root) = linked_copy(&bullseye);
    std::fs::create_dir_all(root.join("opt/test")).unwrap();
    std::fs::copy(old_glibc_program(), root.join("opt/test/old_glibc")).unwrap();
    let device = Device::new("bullseye", Some(&wheel_library));
    assert!(
        !device.stderr.contains("needs glibc"),
        "the wheel's library needs glibc 2.17: {}",
        device.stderr
    );
    let glibc = same_with_and_without(&root, &device, &["getconf", "GNU_LIBC_VERSION"]);
    assert_eq!(glibc.trim(), "glibc 2.31");
    same_with_and_without(&root, &device, &["ls", "/opt/test"]);
    let sysfs = Sysfs::two_nodes();
    let sim = format!("{}:/sim:ro", sysfs.path().display());
    let options = ["-v", &sim, "-e", "TLLM_AFFINITY_SYSFS_ROOT=/sim"];
    let out = podman(&root, Some(&device), &options, &["/opt/test/old_glibc"])
        .output()
        .unwrap();
    println!("bullseye, wheel's library: {}", text(&out));
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("lease=1 roles=host,host,worker,worker,worker"),
        "{}",
        text(&out)
    );
    let native = Device::new("bullseye-native", None);
    says(&native.stderr, &["needs glibc 2."]);
    let broken = podman(&root, Some(&native), &[], &["true"])
        .output()
        .unwrap();
    println!("bullseye, release library: {}", text(&broken));
    assert!(
        !broken.status.success()
            && String::from_utf8_lossy(&broken.stderr).contains("version `GLIBC_2.3"),
        "{}",
        text(&broken)
    );
}

/// The wheel's library (scripts/wheel, cargo-zigbuild), built once; None outside CI without zig.
fn wheel_library() -> Result<PathBuf, String> {
    if !on_path("cargo-zigbuild") {
        return Err("`cargo-zigbuild` on PATH".into());
    }
    let out = Command::new(repo().join("scripts/wheel"))
        .arg("x86_64")
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "scripts/wheel failed");
    let lib = repo().join("target/zig/x86_64-unknown-linux-gnu/wheel/libtllm_affinity.so");
    assert!(lib.is_file(), "{} missing", lib.display());
    Ok(lib)
}

// ---- The zero-code Python hook ----

/// The zero-code fixture (tests/programs/zero_code/two_llms.py: two LLMs of the upstream-shaped
/// stand-in, which pins every thread and never restores), unmodified, in a container with the
/// device and the image's own PYTHONPATH (the stand-in and the image's own sitecustomize): the
/// hook comes from the library, the image's path and sitecustomize are kept, and the worker
/// threads, and only they, get the GPU-local set while an LLM is open.
#[test]
fn the_zero_code_fixture_runs_unmodified_in_a_container() {
    let glibc = require!(Glibc::new(
        "zerocode",
        "a worker set narrower than the host"
    ));
    let (all, local) = (&glibc.all, &glibc.local);
    let image = glibc_image();
    // The image's own sitecustomize, on the image's own PYTHONPATH: it must still run.
    let site = image.join("opt/test/site");
    std::fs::create_dir_all(&site).unwrap();
    std::fs::write(
        site.join("sitecustomize.py"),
        "import sys\nsys.stderr.write('IMAGE-SITECUSTOMIZE ran\\n')\n",
    )
    .unwrap();
    let name = container_name("zerocode");
    let sim = format!("{}:/sim:ro", glibc.sysfs.path().display());
    let python_path =
        format!("PYTHONPATH={OPT}/programs/upstream_trtllm:{OPT}/programs:{OPT}/site");
    let interpreter = python();
    let script = format!("{OPT}/programs/zero_code/two_llms.py");
    let cmd = podman(
        image,
        Some(&glibc.device),
        &[
            "--name",
            &name,
            "-v",
            &sim,
            "-e",
            "TLLM_AFFINITY_SYSFS_ROOT=/sim",
            "-e",
            "TLLM_AFFINITY_LOG=info",
            "-e",
            &python_path,
            "-e",
            "TLLM_LOG_LEVEL=info",
            "-e",
            "TLLM_WORKER_USE_SINGLE_PROCESS=1",
            "-e",
            "RT_OMP=/opt/test/libopenmp_region.so",
            "-e",
            "OMP_NUM_THREADS=3",
            "-e",
            "OMP_WAIT_POLICY=passive",
        ],
        &[interpreter.to_str().unwrap(), &script],
    );
    let (phases, end) = population_phases::<6>(cmd, &name);
    for phase in &phases {
        println!("  {}", describe(phase));
    }
    println!("{}", end.stderr);
    assert!(end.status.success(), "{}", end.stderr);
    says(&end.stderr, &["IMAGE-SITECUSTOMIZE ran"]);
    let [before, first, second, _first_down, _third, last] = &phases;
    for (phase, workers) in [(before, all), (first, local), (second, local), (last, all)] {
        placed(phase, &TP1_WORKERS, workers, all, &end.stderr);
    }
    assert!(
        first.threads.keys().any(|n| n.starts_with("executor_loop")),
        "{}",
        describe(first)
    );
    never_says(&end.stderr, &["Removing CPU affinity constraints"]);
}

/// Inside a container's root, whatever lies at the table's name (in the container's own
/// `/dev/shm`, which its root user controls): the name swapped, as fast as it goes, between the
/// real table, a FIFO, a 1 TiB sparse file, absolute symbolic links to host paths (a device
/// node, a FIFO the host holds, a table forged with the process's header) and a hard link, while
/// root on the host runs `ps PID` and the host view. An absolute link is never resolved against
/// the host's root: nothing on the host is opened (inotify), the forged table is never
/// believed, every run ends in time, and afterwards the roles show.
#[test]
fn ps_on_the_host_follows_no_link_planted_in_a_containers_root() {
    let (_glibc, run, pid, configured) = require!(configured_in_container("psswap"));
    let namespace_tids: Vec<i32> = (1..=256).collect();
    let shm = PathBuf::from(format!("/proc/{pid}/root/dev/shm"));
    let namespace =
        tllm_affinity_core::table::threadtable::pid_namespace(Path::new(&format!("/proc/{pid}")))
            .unwrap();
    let table = shm.join(tllm_affinity_core::table::threadtable::file_name(
        1, namespace,
    ));
    assert!(table.exists(), "{}", table.display());
    let t = SwapTargets::plant(&table, None);
    let forged = t.held_dir.path().join("forged-table");
    forge_as(&forged, 1, pid, &namespace_tids);
    let [fifo, sparse, device, held] = t.never_opened();
    let watch = OpenWatch::new(&[fifo, sparse, device, held, &forged]);
    let swap = t.swapper(
        Command::new(Program::c("table_swapper").build()),
        &forged,
        "5",
    );
    let mut swapping = Driver::spawn(swap, LIMIT);
    let ps = |args: &[&str]| -> Value {
        let mut cmd = clean(cli());
        cmd.arg("ps").args(args).arg("--json");
        let out = run_bounded(cmd, Duration::from_secs(20));
        assert!(out.status.success(), "ps {args:?}: {}", out.stderr);
        serde_json::from_str(&out.stdout).unwrap()
    };
    let pid_arg = pid.to_string();
    let runs = ps_while_swapping(&mut swapping, pid, ps);
    let swapped = swapping.finish();
    let opens = watch.opens();
    let _ = std::fs::remove_file(&t.fifo);
    let _ = std::fs::remove_file(&t.sparse);
    assert!(swapped.status.success(), "{}", swapped.stderr);
    assert_eq!(
        opens,
        0,
        "{opens} opens of {:?} over {runs} runs of ps ({})",
        watch.what,
        swapped.stdout.trim()
    );
    let after = ps(&[&pid_arg]);
    let workers = after["threads"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["role"] == "worker")
        .count();
    assert_eq!(
        workers,
        configured.threads.values().filter(|t| t.role == 1).count(),
        "{after}"
    );
    run.finish();
}
