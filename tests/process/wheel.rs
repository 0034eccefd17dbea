//! The wheel as a user gets it: built by `scripts/wheel`, accepted by `auditwheel` as
//! manylinux2014, installed with pip into a fresh virtual environment and run there with cargo and
//! the build tree out of reach, uninstalled without a trace; its library preloaded into Debian
//! bullseye (glibc 2.31) and trixie (glibc 2.41), with and without libgcc; and installed with
//! pip into a fresh venv of trixie's Python 3.13.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use common::*;
use serde_json::Value;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const WHEEL_LIBRARY: &str = "tllm_affinity/_lib/libtllm_affinity.so";

/// `target/wheels/<the wheel for arch>` (`x86_64`, `aarch64`), built by `scripts/wheel <arch>`
/// once per test binary (cargo rebuilds only what changed); the error (for `require!`) when the
/// toolchain is missing.
fn wheel_for(arch: &'static str) -> Result<PathBuf, String> {
    static WHEELS: OnceLock<std::sync::Mutex<BTreeMap<&str, PathBuf>>> = OnceLock::new();
    if !on_path("cargo-zigbuild") {
        return Err("`cargo-zigbuild` on PATH".into());
    }
    let wheels = WHEELS.get_or_init(Default::default);
    let mut wheels = wheels.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = wheels.get(arch) {
        return Ok(path.clone());
    }
    let out = Command::new(repo().join("scripts/wheel"))
        .arg(arch)
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/wheel");
    assert!(out.status.success(), "scripts/wheel {arch} failed");
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    assert!(path.is_file(), "scripts/wheel printed {}", path.display());
    wheels.insert(arch, path.clone());
    Ok(path)
}

/// The wheel for this machine (x86_64), which the venv and bullseye tests install and run.
fn wheel() -> Result<PathBuf, String> {
    wheel_for("x86_64")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// One member of the wheel, written to `to` (zipfile: no unzip needed).
fn extract(wheel: &Path, member: &str, to: &Path) {
    let out = Command::new(python())
        .args([
            "-c",
            "import sys, zipfile; open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))",
        ])
        .arg(wheel)
        .arg(member)
        .arg(to)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn the_python_package_states_the_workspace_version() {
    let init = std::fs::read_to_string(repo().join("python/tllm_affinity/__init__.py")).unwrap();
    assert!(
        init.lines()
            .any(|l| l == format!("__version__ = \"{VERSION}\"")),
        "python/tllm_affinity/__init__.py must say __version__ = \"{VERSION}\", the workspace \
         version of Cargo.toml"
    );
}

/// What `readelf <flag> <file>` prints.
fn readelf(flag: &str, file: &Path) -> String {
    let out = Command::new("readelf")
        .arg(flag)
        .arg(file)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Each architecture's wheel: named and accepted by `auditwheel` as manylinux2014 for its
/// architecture, its library of that architecture, needing glibc alone at `GLIBC_2.17` at most,
/// holding no path of the machine that built it. A row: the architecture, its `Machine:` in
/// `readelf -h`, its glibc loader.
fn check_manylinux2014(&(arch, machine, loader): &(&'static str, &str, &str)) {
    require!(on_path("auditwheel"), "`auditwheel` on PATH");
    require!(on_path("readelf"), "`readelf` on PATH");
    let wheel = require!(wheel_for(arch));
    let name = wheel.file_name().unwrap().to_str().unwrap();
    assert_eq!(
        name,
        format!("tllm_affinity-{VERSION}-py3-none-manylinux_2_17_{arch}.manylinux2014_{arch}.whl")
    );
    let out = Command::new("auditwheel")
        .arg("show")
        .arg(&wheel)
        .output()
        .unwrap();
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    assert!(
        shown.contains("consistent with the following platform tag:")
            && shown.contains(&format!("\"manylinux_2_17_{arch}\"")),
        "{shown}"
    );
    let dir = tempfile::tempdir().unwrap();
    let library = dir.path().join("libtllm_affinity.so");
    extract(&wheel, WHEEL_LIBRARY, &library);
    let header = readelf("-hW", &library);
    let machine_line = header
        .lines()
        .find(|l| l.trim_start().starts_with("Machine:"))
        .unwrap_or_default()
        .to_string();
    assert!(machine_line.contains(machine), "{arch}: {machine_line}");
    let dynamic = readelf("-dW", &library);
    let needed: BTreeSet<String> = dynamic
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l.split('[').nth(1)?.trim_end_matches(']').to_string()))
        .collect();
    let glibc: BTreeSet<String> = ["libc.so.6", loader, "libpthread.so.0", "libdl.so.2"]
        .map(String::from)
        .into();
    assert!(
        !needed.is_empty() && needed.is_subset(&glibc),
        "{arch}: NEEDED {needed:?}"
    );
    // The highest glibc symbol version imported: 2.17 at most (manylinux2014).
    let versions = readelf("-VW", &library);
    let highest = versions
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
            Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
        })
        .max()
        .expect("GLIBC_ versions");
    assert!(
        highest <= (2, 17),
        "{arch}: imports GLIBC_{}.{}",
        highest.0,
        highest.1
    );
    // No path of the machine that built it: not the checkout, not the cargo home.
    let bytes = std::fs::read(&library).unwrap();
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    for path in [repo().to_str().unwrap(), &format!("{home}/.cargo")] {
        assert!(
            !bytes.windows(path.len()).any(|w| w == path.as_bytes()),
            "the library holds the build path {path}"
        );
    }
}

table_tests! {
    check_manylinux2014;
    /// The x86_64 wheel.
    the_x86_64_wheel_is_manylinux2014_and_its_library_needs_glibc_alone:
        ("x86_64", "X86-64", "ld-linux-x86-64.so.2");
    /// The aarch64 wheel, cross-built here.
    the_aarch64_wheel_is_manylinux2014_and_its_library_needs_glibc_alone:
        ("aarch64", "AArch64", "ld-linux-aarch64.so.1");
}

/// Every path under `dir`, relative.
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    let mut paths = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            paths.insert(path.strip_prefix(dir).unwrap().to_path_buf());
            if path.is_dir() && !path.is_symlink() {
                stack.push(path);
            }
        }
    }
    paths
}

#[test]
fn a_fresh_venv_installs_runs_and_uninstalls_the_wheel_without_the_build_tree() {
    let wheel = require!(wheel());
    let work = tempfile::tempdir().unwrap();
    let venv = new_venv(work.path(), &[]);
    let bin = venv.join("bin");
    // A user's shell: the venv's bin/ and the system's, no cargo, no build tree, no variables
    // of the build, run from a directory of its own.
    let user = |program: &str| {
        let mut cmd = Command::new(bin.join(program));
        cmd.env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .env("HOME", work.path())
            .current_dir(work.path());
        cmd
    };
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{cmd:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let before = tree(&venv);
    run(user("pip")
        .args(["install", "-q", "--no-index", "--disable-pip-version-check"])
        .arg(&wheel));

    // One version everywhere.
    let command_version = format!("tllm-affinity {VERSION}");
    assert_eq!(run(user("tllm-affinity").arg("--version")), command_version);
    assert_eq!(
        run(user("python").args(["-m", "tllm_affinity", "--version"])),
        command_version
    );
    let site = run(user("python").args([
        "-c",
        "import importlib.metadata as m, tllm_affinity as t; \
         print(t.__version__, m.version('tllm-affinity'), t.library_path(), t.include_dir())",
    ]));
    let words: Vec<&str> = site.split(' ').collect();
    assert_eq!(&words[..2], [VERSION, VERSION], "{site}");
    let library = PathBuf::from(words[2]);
    assert!(
        library.starts_with(&venv) && library.ends_with(WHEEL_LIBRARY),
        "{site}"
    );
    assert!(Path::new(words[3]).join("tllm_affinity.h").is_file());

    // The installed `run`, with no variable naming the library, on the simulated host.
    let seen = installed_population(|| user("tllm-affinity"));
    assert_eq!(seen["version"], VERSION);
    assert_eq!(seen["library"], library.to_str().unwrap());
    assert_eq!(seen["preload"], library.to_str().unwrap());
    let sim = Sysfs::two_nodes();

    // The Python module's own test program against the installed package and library.
    let api = run(user("tllm-affinity")
        .args(["run", "--simulate", "--policy", "numa", "--", "python"])
        .arg(program("py_api.py"))
        .arg("api"));
    let api: Value = serde_json::from_str(api.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {api}"));
    assert_eq!(api["available"], true, "{api}");
    assert_eq!(api["version"], VERSION);
    assert_eq!(api["worker"]["role"], "worker", "{api}");
    assert_eq!(mask_of(&api["worker"]["mask"]), sim.gpu0_local(), "{api}");
    assert_eq!(api["worker"]["child"]["role"], "worker", "{api}");
    assert_eq!(mask_of(&api["host_mask_after"]), allowed_cpus(), "{api}");
    assert_eq!(api["worker"]["released"], true, "{api}");

    // Uninstalled, the venv is file for file what it was before.
    run(user("pip").args(["uninstall", "-y", "-q", "tllm-affinity"]));
    let after = tree(&venv);
    assert_eq!(
        after.difference(&before).collect::<Vec<_>>(),
        Vec::<&PathBuf>::new(),
        "left behind"
    );
    assert_eq!(before, after);
}

// ---- An old glibc, and no libgcc ----

/// `program` run by chroot in `root` with a bare environment plus `env`.
fn in_root(root: &Path, env: &[(&str, &str)], program: &[&str]) -> Output {
    let mut cmd = Command::new("chroot");
    cmd.arg(root)
        .arg("/usr/bin/env")
        .arg("-i")
        .arg("PATH=/usr/bin:/bin");
    for (name, value) in env {
        cmd.arg(format!("{name}={value}"));
    }
    cmd.args(program).output().unwrap()
}

#[test]
fn the_library_works_on_debian_bullseye_with_and_without_libgcc() {
    let wheel = require!(wheel());
    let rootfs = require!(bullseye_rootfs());
    require!(on_path("chroot"), "`chroot` on PATH");
    let (_copy, root) = linked_copy(&rootfs);
    check_library_with_and_without_libgcc(&wheel, &root, "glibc 2.31");
}

/// The wheel's library and command, unpacked into the Debian tree `root` (whose C library
/// `getconf` names `glibc`): programs start with the library preloaded, and the command's `run`
/// places the threads of a program linked against glibc 2.17 on the simulated host, with the
/// tree's libgcc and without it.
fn check_library_with_and_without_libgcc(wheel: &Path, root: &Path, glibc: &str) {
    let opt = root.join("opt/tllm");
    std::fs::create_dir_all(&opt).unwrap();
    extract(wheel, WHEEL_LIBRARY, &opt.join("libtllm_affinity.so"));
    extract(
        wheel,
        &format!("tllm_affinity-{VERSION}.data/scripts/tllm-affinity"),
        &opt.join("tllm-affinity"),
    );
    let chmod = Command::new("chmod")
        .arg("+x")
        .arg(opt.join("tllm-affinity"))
        .status()
        .unwrap();
    assert!(chmod.success());
    std::fs::copy(old_glibc_program(), opt.join("old_glibc")).unwrap();

    let version = in_root(root, &[], &["getconf", "GNU_LIBC_VERSION"]);
    assert_eq!(text(&version).trim(), glibc);
    let preload = [("LD_PRELOAD", "/opt/tllm/libtllm_affinity.so")];
    let expected = format!("version={VERSION} lease=1 roles=host,host,worker,worker,worker");
    let libgcc = root.join("usr/lib/x86_64-linux-gnu/libgcc_s.so.1");
    assert!(libgcc.exists(), "Debian ships libgcc_s.so.1");
    for with_libgcc in [true, false] {
        if !with_libgcc {
            std::fs::remove_file(&libgcc).unwrap();
        }
        let case = if with_libgcc { "" } else { " (no libgcc)" };
        // Programs start with the library preloaded: the smallest, and one with several libraries.
        for program in [&["true"][..], &["ls", "/opt/tllm"]] {
            let out = in_root(root, &preload, program);
            assert!(
                out.status.success() && out.stderr.is_empty(),
                "{program:?}{case}: {}",
                text(&out)
            );
        }
        // The library works: the installed command (there is no /proc in the root, so the
        // library is named) runs a threaded program on the simulated host.
        let out = in_root(
            root,
            &[("TLLM_AFFINITY_LIB", "/opt/tllm/libtllm_affinity.so")],
            &[
                "/opt/tllm/tllm-affinity",
                "run",
                "--simulate",
                "--no-python-hooks",
                "--",
                "/opt/tllm/old_glibc",
            ],
        );
        assert!(out.status.success(), "{case}: {}", text(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            expected,
            "{case}: {}",
            text(&out)
        );
    }
}

/// The newest Debian (glibc 2.41, Python 3.13): the library and command as on bullseye, and the
/// wheel pip-installed into a fresh venv of the tree's Python, whose `tllm-affinity run` (no
/// variable naming the library) places a mixed Python population as everywhere: main and host
/// threads on every CPU, the worker and its children on device 0's local CPUs; its `ps` reads
/// the table the installed library published.
#[test]
fn the_wheel_installs_and_places_a_population_on_debian_trixie() {
    let wheel = require!(wheel());
    let rootfs = require!(trixie_rootfs());
    for tool in ["chroot", "unshare", "mount"] {
        require!(on_path(tool), &format!("`{tool}` on PATH"));
    }
    let (_copy, root) = linked_copy(&rootfs);
    // The venv first: the library check takes libgcc away.
    let venv = Path::new("/opt/venv");
    let bin = venv.join("bin");
    let user = |program: &str| chrooted(&root, &bin, &bin.join(program));
    succeeded(
        chrooted(&root, &bin, Path::new("/usr/bin/python3"))
            .args(["-m", "venv"])
            .arg(venv),
    );
    // The wheel and the population's program where the chroot sees them at their own paths.
    let inside = |path: &Path| root.join(path.strip_prefix("/").unwrap());
    for file in [&wheel, &program("wheel_population.py")] {
        std::fs::create_dir_all(inside(file.parent().unwrap())).unwrap();
        std::fs::copy(file, inside(file)).unwrap();
    }
    succeeded(
        user("pip")
            .args(["install", "-q", "--no-index", "--disable-pip-version-check"])
            .arg(&wheel),
    );
    let python = String::from_utf8_lossy(&succeeded(user("python").arg("--version")).stdout)
        .trim()
        .to_string();
    assert!(python.starts_with("Python 3.13"), "{python}");
    let version = succeeded(user("tllm-affinity").arg("--version"));
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("tllm-affinity {VERSION}")
    );
    let seen = installed_population(|| user("tllm-affinity"));
    let library = venv
        .join("lib/python3.13/site-packages")
        .join(WHEEL_LIBRARY);
    assert_eq!(seen["library"], library.to_str().unwrap(), "{seen}");
    assert_eq!(seen["preload"], library.to_str().unwrap(), "{seen}");
    assert_eq!(seen["version"], VERSION);

    check_library_with_and_without_libgcc(&wheel, &root, "glibc 2.41");
}

/// `program` (a path in `root`) run chrooted in `root` with the host's `/proc` mounted there, in
/// a mount namespace of its own (nothing stays mounted); the environment is empty but HOME and
/// a PATH with `bin` first.
fn chrooted(root: &Path, bin: &Path, program: &Path) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(r#"set -e; root=$1; shift; mount -t proc proc "$root/proc"; exec chroot "$root" "$@""#)
        .arg("sh")
        .arg(root)
        .arg(program)
        .env_clear()
        .env(
            "PATH",
            format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display()),
        )
        .env("HOME", "/root");
    cmd
}

// ---- The source distribution ----

#[test]
fn the_sdist_builds_with_cargo_and_installs_the_same_layout() {
    require!(on_path("cargo"), "`cargo` on PATH");
    let out = succeeded(Command::new(repo().join("scripts/wheel")).arg("--sdist"));
    let sdist = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    assert!(
        sdist.ends_with(format!("tllm_affinity-{VERSION}.tar.gz")),
        "{}",
        sdist.display()
    );
    let work = tempfile::tempdir().unwrap();
    // The system's setuptools and wheel build the Python part with no index.
    let venv = new_venv(work.path(), &["--system-site-packages"]);
    let bin = venv.join("bin");
    // pip unpacks the sdist in a fresh directory; one target directory for every run keeps
    // cargo's dependencies built.
    let target = target_dir().parent().unwrap().join("sdist");
    succeeded(
        Command::new(bin.join("pip"))
            .args(["install", "-q", "--disable-pip-version-check", "--no-index"])
            .arg("--no-build-isolation")
            .arg(&sdist)
            .env("CARGO_TARGET_DIR", &target)
            .env_remove("PYTHONPATH")
            .current_dir(work.path()),
    );
    let out = Command::new(bin.join("tllm-affinity"))
        .args(["run", "--simulate", "--", "python", "-c"])
        .arg("import tllm_affinity as t; print(t.version(), t.library_path())")
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env_remove("TLLM_AFFINITY_LIB")
        .env_remove("PYTHONPATH")
        .env_remove("LD_PRELOAD")
        .current_dir(work.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (version, library) = stdout.trim().split_once(' ').unwrap();
    assert_eq!(version, VERSION);
    assert!(
        Path::new(library).starts_with(&venv) && library.ends_with(WHEEL_LIBRARY),
        "{stdout}"
    );
}

/// The x86_64 tier with the wheel's own library preloaded (linked by zig, LLVM's unwinder inside)
/// instead of the checkout's release build (gcc's): how a `pip install`ed library runs.
struct WheelLibrary(PathBuf);

impl common::tier::Tier for WheelLibrary {
    fn preloaded(&self, program: &Path, sysfs: &Sysfs) -> Command {
        let mut cmd = preloaded(program, sysfs);
        cmd.env("LD_PRELOAD", &self.0);
        cmd
    }
}

/// Threads ending every way (return, `pthread_exit`, cancellation, detached) under the wheel's
/// library: the registry equals the live threads and the process ends well, as under the
/// release build (tests/process/lifecycle.rs). The wheel's library once crashed the process at the first
/// `pthread_exit`: libgcc_s's forced unwind called the personality routine of the library's
/// thread-start frame, whose `_Unwind_*` calls went to LLVM's unwinder linked inside.
#[test]
fn under_the_wheels_library_every_way_out_of_a_thread_ends_well() {
    let wheel = require!(wheel());
    let dir = tempfile::tempdir().unwrap();
    let library = dir.path().join("libtllm_affinity.so");
    extract(&wheel, WHEEL_LIBRARY, &library);
    common::fork_exec::check_every_way_out(&WheelLibrary(library));
}
