//! The GPU CUDA means, inside containers and with UUID and MIG names (SPEC §4): real programs
//! under the real preloaded library, their worker masks read from the kernel.
//!
//! No GPU is lent here, so NVML is `tests/programs/nvml_double.c`, a test double of the NVIDIA
//! driver's ABI (`libnvidia-ml.so.1`: nvml.h's prototypes, struct layouts and return codes)
//! that answers from a file each test writes, found through `LD_LIBRARY_PATH`. The simulated
//! sysfs tree (with the driver's list and `/dev` under the same root) names only CPUs this
//! process may use: node 0 is the lower half of them, node 1 the rest.

use crate::common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use tllm_affinity_core::host::simulated::{gb200_like, SimulatedHost, GB200_GPUS};
use tllm_affinity_core::mask::CpuMask;

/// sysfs's eight GPUs: four on node 0, four on node 1, in PCI order.
const SYSFS_GPUS: [(&str, usize); 8] = [
    ("0000:18:00.0", 0),
    ("0000:2a:00.0", 0),
    ("0000:3a:00.0", 0),
    ("0000:5d:00.0", 0),
    ("0000:9a:00.0", 1),
    ("0000:ab:00.0", 1),
    ("0000:ba:00.0", 1),
    ("0000:db:00.0", 1),
];
/// The container's two GPUs as NVML writes them: 3a (node 0) and ba (node 1).
const UUID_3A: &str = "GPU-3a3a3a3a-1111-2222-3333-444455556666";
const UUID_BA: &str = "GPU-baba0000-aaaa-bbbb-cccc-ddddeeeeffff";
const MIG_BA: &str = "MIG-7e1d0c55-0123-4567-89ab-cdef01234567";

/// NVML's answer for the container: two GPUs, NVML's CPU affinity left to sysfs.
fn container_nvml() -> String {
    format!("gpu 00000000:3A:00.0 {UUID_3A} -\ngpu 00000000:BA:00.0 {UUID_BA} -\nmig 1 {MIG_BA}\n")
}

struct Host {
    sysfs: tempfile::TempDir,
    node0: CpuMask,
    node1: CpuMask,
    nvml: tempfile::TempDir,
}

impl Host {
    /// [`Host::new`] where this machine has the two CPUs its two NUMA nodes need.
    fn on_two_cpus(driver: &[(&str, &str, bool)]) -> Result<Host, String> {
        two_cpus("two NUMA nodes")?;
        Ok(Host::new(driver))
    }

    /// The 8-GPU host; `driver` lists these GPUs in /proc/driver/nvidia with their /dev node
    /// written when the flag is true.
    fn new(driver: &[(&str, &str, bool)]) -> Host {
        let (node0, node1) = two_halves();
        let mut host = two_nodes(&node0, &node1);
        for (address, node) in SYSFS_GPUS {
            host = host.gpu(address, Some(node), None);
        }
        for (i, (address, uuid, opens)) in driver.iter().enumerate() {
            host = host.driver_gpu(address, uuid, i as u32, *opens);
        }
        Host::written(host, node0, node1)
    }

    /// `host` written as this host's sysfs tree, with `node0` and `node1` for the tests to read.
    fn written(host: SimulatedHost, node0: CpuMask, node1: CpuMask) -> Host {
        let sysfs = tempfile::tempdir().unwrap();
        host.write(sysfs.path()).unwrap();
        Host {
            sysfs,
            node0,
            node1,
            nvml: tempfile::tempdir().unwrap(),
        }
    }

    /// The host `sysfs` describes ([`Sysfs`]'s trees), NVML still to be given.
    fn from_sysfs(sysfs: Sysfs) -> Host {
        Host {
            sysfs: sysfs.dir,
            node0: sysfs.node0,
            node1: sysfs.node1,
            nvml: tempfile::tempdir().unwrap(),
        }
    }

    fn nvml_file(&self) -> PathBuf {
        self.nvml.path().join("nvml")
    }

    /// How many times the double's nvmlInit_v2 ran.
    fn inits(&self) -> usize {
        let calls = self.nvml.path().join("nvml.calls");
        std::fs::read_to_string(calls)
            .unwrap_or_default()
            .lines()
            .count()
    }

    /// `program` under the library, on this host, with NVML answering from `nvml` (through the
    /// double in `lib_dir`), or with no NVML at all when `nvml` is `None`.
    fn command(&self, program: &Path, nvml: Option<(&str, &Path)>) -> Command {
        let mut cmd = clean(program);
        cmd.env("LD_PRELOAD", library())
            .env("TLLM_AFFINITY_SYSFS_ROOT", self.sysfs.path())
            .env("TLLM_AFFINITY_LOG", "debug")
            .env_remove("LD_LIBRARY_PATH");
        if let Some((text, lib_dir)) = nvml {
            self.answer(&mut cmd, text, lib_dir);
        }
        cmd
    }

    /// [`Host::command`] with NVML showing the container's two GPUs ([`container_nvml`]).
    fn in_container(&self, program: &Path) -> Command {
        self.command(program, Some((&container_nvml(), &nvml_double(false))))
    }

    /// `tllm-affinity plan --gpu <gpu> --json` on this host, NVML as [`Host::command`] has it.
    fn plan(&self, gpu: usize, nvml: Option<(&str, &Path)>) -> serde_json::Value {
        let out = succeeded(self.command(&cli(), nvml).args([
            "plan",
            "--gpu",
            &gpu.to_string(),
            "--json",
        ]));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// NVML answering `cmd` from `text` through the double in `lib_dir`.
    fn answer<'a>(&self, cmd: &'a mut Command, text: &str, lib_dir: &Path) -> &'a mut Command {
        std::fs::write(self.nvml_file(), text).unwrap();
        cmd.env("LD_LIBRARY_PATH", lib_dir)
            .env("TLLM_NVML_DOUBLE", self.nvml_file())
    }
}

/// The lower half of the CPUs this process may use (node 0) and the rest (node 1).
fn two_halves() -> (CpuMask, CpuMask) {
    let allowed = allowed_cpus();
    let cpus: Vec<usize> = allowed.iter().collect();
    let half = (cpus.len() / 2).max(1);
    let node0 = CpuMask::from_cpus(cpus[..half].iter().copied());
    let node1 = CpuMask::from_cpus(cpus[half..].iter().copied());
    (node0, node1)
}

/// Nodes 0 and 1 on these CPUs, 21 apart.
fn two_nodes(node0: &CpuMask, node1: &CpuMask) -> SimulatedHost {
    SimulatedHost::new()
        .node(0, node0)
        .node(1, node1)
        .node_distances(vec![vec![10, 21], vec![21, 10]])
}

/// The double as `libnvidia-ml.so.1` in a directory of its own, to put on LD_LIBRARY_PATH;
/// `old` builds the variant without nvmlDeviceGetPciInfo_v3.
fn nvml_double(old: bool) -> PathBuf {
    let sub = if old { "nvml-old" } else { "nvml" };
    let flags: &[&str] = if old { &["-DOMIT_PCI_INFO_V3"] } else { &[] };
    let lib = Program::c("nvml_double")
        .shared()
        .named(&format!("{sub}/libnvidia-ml.so.1"))
        .flags(flags)
        .build();
    lib.parent().unwrap().to_path_buf()
}

/// One `DEVICE` line of gpu_population.
#[derive(Debug)]
struct Configured {
    lease: i64,
    worker: CpuMask,
    child: CpuMask,
    host: CpuMask,
}

/// Runs gpu_population for `devices`; its lines and stderr.
fn population(mut cmd: Command, devices: &[i32]) -> (Vec<Configured>, String) {
    // Devices `cmd` already names (before a "fork") print lines too.
    let given = cmd.get_args().filter(|a| *a != "fork").count();
    cmd.args(devices.iter().map(i32::to_string));
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let lines = stdout
        .lines()
        .filter(|l| l.starts_with("DEVICE "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let m = |s: &str| CpuMask::parse_list(s).unwrap();
            Configured {
                lease: w[3].parse().unwrap(),
                worker: m(w[5]),
                child: m(w[7]),
                host: m(w[9]),
            }
        })
        .collect::<Vec<_>>();
    assert_eq!(lines.len(), devices.len() + given, "{stdout}\n{stderr}");
    (lines, stderr)
}

fn gpu_population() -> PathBuf {
    Program::c("gpu_population").build()
}

/// Asserts the population put the workers of each device on `expected[i]`, the host thread
/// left alone.
fn assert_on(lines: &[Configured], expected: &[&CpuMask], stderr: &str) {
    let all = allowed_cpus();
    for (line, want) in lines.iter().zip(expected) {
        assert!(line.lease > 0, "{line:?}\n{stderr}");
        assert_eq!(&line.worker, *want, "{line:?}\n{stderr}");
        assert_eq!(&line.child, *want, "born worker: {line:?}\n{stderr}");
        assert_eq!(line.host, all, "host thread untouched: {line:?}\n{stderr}");
    }
}

fn no_nvml_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains("no NVML")).collect()
}

#[test]
fn container_cuda_numbers_follow_nvml_not_sysfs() {
    let host = require!(Host::on_two_cpus(&[]));
    let program = gpu_population();
    // sysfs alone (no NVML, no driver list): device 1 is sysfs's 2a, on node 0: the wrong
    // socket for the container's second GPU. This is what the library did before NVML.
    let (lines, stderr) = population(host.command(&program, None), &[0, 1]);
    assert_on(&lines, &[&host.node0, &host.node0], &stderr);
    // NVML shows the container's two GPUs: device 0 is 3a (node 0), device 1 is ba (node 1).
    let (lines, stderr) = population(host.in_container(&program), &[0, 1]);
    assert_on(&lines, &[&host.node0, &host.node1], &stderr);
    says(
        &stderr,
        &["CUDA device 1 = GPU 1 (0000:ba:00.0) in PCI order, from NVML"],
    );
    assert!(no_nvml_lines(&stderr).is_empty(), "{stderr}");
}

#[test]
fn uuids_and_uuid_prefixes_in_cuda_visible_devices() {
    let host = require!(Host::on_two_cpus(&[]));
    let mut cmd = host.in_container(&gpu_population());
    // Full UUID first, then a unique prefix ("GPU-3a" names one GPU).
    cmd.env("CUDA_VISIBLE_DEVICES", format!("{UUID_BA},GPU-3a"));
    let (lines, stderr) = population(cmd, &[0, 1]);
    assert_on(&lines, &[&host.node1, &host.node0], &stderr);
    says(
        &stderr,
        &["CUDA device 0 = CUDA_VISIBLE_DEVICES[0] = GPU 1 (0000:ba:00.0)"],
    );
}

#[test]
fn mig_names_resolve_to_the_parent_gpu() {
    let host = require!(Host::on_two_cpus(&[]));
    let program = gpu_population();
    for cvd in [MIG_BA.to_string(), format!("MIG-{UUID_BA}/1/0")] {
        let mut cmd = host.in_container(&program);
        cmd.env("CUDA_VISIBLE_DEVICES", &cvd);
        let (lines, stderr) = population(cmd, &[0]);
        assert_on(&lines, &[&host.node1], &stderr);
    }
}

/// NVML failing in each way the issue names: one debug line, then the driver's list.
#[test]
fn nvml_failures_fall_back_to_the_driver_list_with_one_line() {
    require!(two_cpus("two NUMA nodes"));
    // The driver lists the container's two GPUs; a third entry's node does not open (a device
    // cgroup), so it is not the container's.
    let host = Host::new(&[
        (
            "0000:18:00.0",
            "GPU-18181818-0000-0000-0000-000000000000",
            false,
        ),
        ("0000:3a:00.0", UUID_3A, true),
        ("0000:ba:00.0", UUID_BA, true),
    ]);
    let lib = nvml_double(false);
    let old = nvml_double(true);
    let program = gpu_population();
    let base = container_nvml();
    let cases: [(String, &Path, &str); 6] = [
        (
            format!("{base}init 9\n"),
            &lib,
            "nvmlInit_v2 returned 9 (Driver Not Loaded)",
        ),
        (
            base.clone(),
            &old,
            "libnvidia-ml.so.1 has no nvmlDeviceGetPciInfo_v3",
        ),
        (
            format!("{base}null_handle 1\n"),
            &lib,
            "nvmlDeviceGetHandleByIndex_v2(1) returned a NULL handle",
        ),
        (
            format!("{base}fail nvmlDeviceGetUUID 999\n"),
            &lib,
            "nvmlDeviceGetUUID returned 999 (Unknown Error)",
        ),
        (
            format!("{base}fail nvmlDeviceGetPciInfo_v3 999\n"),
            &lib,
            "nvmlDeviceGetPciInfo_v3 returned 999 (Unknown Error)",
        ),
        (
            format!("{base}fail nvmlDeviceGetCount_v2 15\n"),
            &lib,
            "nvmlDeviceGetCount_v2 returned 15",
        ),
    ];
    for (text, dir, why) in &cases {
        let mut cmd = host.command(&program, Some((text, dir)));
        // UUIDs still resolve, through the driver's list.
        cmd.env("CUDA_VISIBLE_DEVICES", format!("{UUID_BA},0"));
        // Two configures of one device, then another: NVML is asked once.
        let (lines, stderr) = population(cmd, &[0, 0, 1]);
        assert_on(&lines, &[&host.node1, &host.node1, &host.node0], &stderr);
        let said = no_nvml_lines(&stderr);
        assert_eq!(said.len(), 1, "{why}: {stderr}");
        assert!(said[0].contains(why), "{why}: {stderr}");
        says(
            &stderr,
            &["from the driver's list (/proc/driver/nvidia/gpus)"],
        );
    }
    // A MIG name needs NVML: a clear error, no mask changed.
    let mut cmd = host.command(&program, Some((&format!("{base}init 9\n"), &lib)));
    cmd.env("CUDA_VISIBLE_DEVICES", MIG_BA);
    let (lines, stderr) = population(cmd, &[0]);
    assert_eq!(lines[0].lease, -(libc::ENODEV as i64), "{stderr}");
    assert_eq!(lines[0].worker, allowed_cpus());
    says(
        &stderr,
        &["is a MIG name; mapping it to its GPU needs NVML"],
    );
}

/// An NVML that initialises and counts its GPUs but cannot give every one's PCI address counts as
/// no NVML, with one warning naming the call and its code, and sysfs answers (no driver's list
/// here), for `configure`, `plan` and `topo` alike: every PCI-info and UUID call failing with
/// NVML_ERROR_UNKNOWN; every handle NULL; one device's handle NULL and the other's fine.
#[test]
fn an_nvml_that_cannot_name_its_gpus_counts_as_no_nvml_with_one_warning() {
    let host = require!(Host::on_two_cpus(&[]));
    let lib = nvml_double(false);
    let program = gpu_population();
    let base = container_nvml();
    let cases = [
        (
            format!("{base}fail nvmlDeviceGetPciInfo_v3 999\nfail nvmlDeviceGetUUID 999\n"),
            "nvmlDeviceGetPciInfo_v3 returned 999 (Unknown Error)",
        ),
        (
            format!("{base}null_handle 0\nnull_handle 1\n"),
            "nvmlDeviceGetHandleByIndex_v2(0) returned a NULL handle",
        ),
        (
            format!("{base}null_handle 1\n"),
            "nvmlDeviceGetHandleByIndex_v2(1) returned a NULL handle",
        ),
    ];
    for (text, why) in &cases {
        let mut cmd = host.command(&program, Some((text, &lib)));
        cmd.env("TLLM_AFFINITY_LOG", "warn");
        // sysfs's device 0 is 18 (node 0), its device 4 is 9a (node 1).
        let (lines, stderr) = population(cmd, &[0, 4]);
        assert_on(&lines, &[&host.node0, &host.node1], &stderr);
        let said = lines_starting(&stderr, "[tllm-affinity]");
        assert_eq!(said.len(), 1, "{why}: {stderr}");
        assert!(
            said[0].contains("warning") && said[0].contains(why),
            "{why}: {stderr}"
        );
        assert!(said[0].contains("counted as no NVML"), "{stderr}");

        let out = host
            .command(&cli(), Some((text, &lib)))
            .args(["plan", "--gpu", "4", "--json"])
            .output()
            .unwrap();
        let (plan, errors) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{why}: plan: {plan}{errors}");
        let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
        assert_eq!(plan["gpu"]["address"], "0000:9a:00.0", "{why}: {plan}");
        assert_eq!(
            plan["worker"]["cpus"],
            host.node1.to_list(),
            "{why}: {plan}"
        );
        assert!(errors.contains(why), "{why}: plan said {errors}");

        let out = host
            .command(&cli(), Some((text, &lib)))
            .arg("topo")
            .output()
            .unwrap();
        let topo = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{why}: topo: {topo}");
        says(
            &topo,
            &[
                "GPUs this process sees (from sysfs",
                &format!("NVML: not used: {why}"),
            ],
        );
    }
}

#[test]
fn the_driver_list_alone_finds_the_container_gpus() {
    require!(two_cpus("two NUMA nodes"));
    // The container toolkit shows one entry; a device cgroup would show all and open one.
    for driver in [
        vec![("0000:ba:00.0", UUID_BA, true)],
        SYSFS_GPUS
            .iter()
            .map(|(a, _)| {
                (
                    *a,
                    "GPU-00000000-0000-0000-0000-000000000000",
                    *a == "0000:ba:00.0",
                )
            })
            .collect(),
    ] {
        let host = Host::new(&driver);
        let (lines, stderr) = population(host.command(&gpu_population(), None), &[0]);
        assert_on(&lines, &[&host.node1], &stderr);
        assert!(
            no_nvml_lines(&stderr)[0].contains("does not load"),
            "{stderr}"
        );
    }
}

#[test]
fn nvml_loads_at_the_first_configure_not_at_load() {
    let host = Host::new(&[]);
    let program = gpu_population();
    // Loaded, never configured: NVML never initialised.
    let (_, stderr) = population(host.in_container(&program), &[]);
    assert_eq!(host.inits(), 0, "{stderr}");
    // Three configures, and the device variables read at each: one nvmlInit_v2.
    let (lines, stderr) = population(host.in_container(&program), &[0, 1, 0]);
    assert!(lines.iter().all(|l| l.lease > 0), "{lines:?}\n{stderr}");
    assert_eq!(host.inits(), 1, "{stderr}");
}

/// A fork child uses what its parent resolved; one forked before any configure asks NVML itself.
#[test]
fn fork_children_reuse_or_ask_nvml() {
    let host = require!(Host::on_two_cpus(&[]));
    let program = gpu_population();
    let mut cmd = host.in_container(&program);
    cmd.args(["0", "fork"]);
    let (lines, stderr) = population(cmd, &[1]);
    assert_on(&lines, &[&host.node0, &host.node1], &stderr);
    assert_eq!(host.inits(), 1, "{stderr}");
    let host = Host::new(&[]);
    let mut cmd = host.in_container(&program);
    cmd.arg("fork");
    let (lines, stderr) = population(cmd, &[1]);
    assert_on(&lines, &[&host.node1], &stderr);
    assert_eq!(host.inits(), 1, "{stderr}");
}

#[test]
fn a_dedicated_worker_resolves_without_nvml_at_load() {
    let host = require!(Host::on_two_cpus(&[("0000:ba:00.0", UUID_BA, true)]));
    let mut cmd = host.in_container(&gpu_population());
    cmd.env("TLLM_AFFINITY_PROCESS_ROLE", "worker");
    let (_, stderr) = population(cmd, &[]);
    // Configured from the constructor through the driver's list; NVML untouched.
    assert_eq!(host.inits(), 0, "{stderr}");
    says(&stderr, &["0000:ba:00.0"]);
}

#[test]
fn topo_names_its_source_and_the_container() {
    let host = Host::new(&[
        ("0000:3a:00.0", UUID_3A, true),
        ("0000:ba:00.0", UUID_BA, true),
    ]);
    let lib = nvml_double(false);
    let out = host.in_container(&cli()).arg("topo").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    println!("{text}");
    says(
        &text,
        &[
            "GPUs this process sees (from NVML):",
            "sysfs lists 8 NVIDIA GPUs, NVML shows 2: this looks like a container",
            &format!("CUDA device 1: 0000:ba:00.0 ({UUID_BA})"),
        ],
    );
    // Without NVML: the driver's list, and the same words for it.
    let no_nvml = format!("{}init 9\n", container_nvml());
    let out = host
        .command(&cli(), Some((&no_nvml, &lib)))
        .arg("topo")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    says(
        &text,
        &[
            "GPUs this process sees (from the driver's list",
            "NVML: not used: nvmlInit_v2 returned 9",
            "sysfs lists 8 NVIDIA GPUs, the driver shows 2: this looks like a container",
        ],
    );
}

/// scripts/device-check, run here as on a GPU host: prebuilt artifacts in a directory, NVML
/// answered by the double, and `nvidia-smi` by a script printing `topo -m` as the real one does.
#[test]
fn device_check_script_against_the_double() {
    let host = require!(Host::on_two_cpus(&[]));
    let lib = nvml_double(false);
    let artifacts = tempfile::tempdir().unwrap();
    let a = artifacts.path();
    for (from, name) in [
        (library(), "libtllm_affinity.so"),
        (cli(), "tllm-affinity"),
        (gpu_population(), "gpu_population"),
        (Program::c("nvml_dump").build(), "nvml_dump"),
    ] {
        std::fs::copy(from, a.join(name)).unwrap();
    }
    let (n0, n1) = (host.node0.to_list(), host.node1.to_list());
    let bin = a.join("bin");
    std::fs::create_dir(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    std::fs::write(
        &smi,
        format!(
            "#!/bin/sh\nif [ \"$1\" = -L ]; then echo 'GPU 0: NVIDIA H100 (UUID: {UUID_3A})'; \
             echo 'GPU 1: NVIDIA H100 (UUID: {UUID_BA})'; exit 0; fi\n\
             printf '\\tGPU0\\tGPU1\\tCPU Affinity\\tNUMA Affinity\\tGPU NUMA ID\\n'\n\
             printf 'GPU0\\t X \\tSYS\\t{n0}\\t0\\t\\tN/A\\n'\n\
             printf 'GPU1\\tSYS\\t X \\t{n1}\\t1\\t\\tN/A\\n'\n"
        ),
    )
    .unwrap();
    let mut perms = std::fs::metadata(&smi).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&smi, perms).unwrap();
    let run = |nvml: &str| {
        let out_dir = tempfile::tempdir().unwrap();
        let mut cmd = host.command(&repo().join("scripts/device-check"), Some((nvml, &lib)));
        cmd.arg(a)
            .env("OUT", out_dir.path())
            .env("TLLM_AFFINITY_LOG", "info")
            .env(
                "PATH",
                format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            )
            .env_remove("LD_PRELOAD");
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let dump = std::fs::read_to_string(out_dir.path().join("nvml-double.txt")).unwrap();
        (out.status.code(), text, dump)
    };
    let agreeing = format!(
        "gpu 00000000:3A:00.0 {UUID_3A} {n0}\ngpu 00000000:BA:00.0 {UUID_BA} {n1}\nmig 1 {MIG_BA}\n"
    );
    let (code, text, dump) = run(&agreeing);
    println!("{text}");
    assert_eq!(code, Some(0), "{text}");
    // The dump of NVML's answers reads back as the file the double answered from.
    assert_eq!(dump, agreeing);
    let worker = format!("device 1: worker [{n1}]");
    let found = ["CPU Affinity", "\"source\": \"NVML\"", &worker];
    says(&text, &found);
    assert_eq!(text.matches(": agrees").count(), 4, "{text}");
    says(&text, &["device-check: no disagreement found"]);
    // NVML placing device 1 on node 0 is a disagreement the script reports.
    let (code, text, _) =
        run(&agreeing.replace(&format!("{UUID_BA} {n1}"), &format!("{UUID_BA} {n0}")));
    assert_eq!(code, Some(1), "{text}");
    says(&text, &[": DIFFERS"]);
    // No CPU affinity from NVML: "cannot verify", not a failure.
    let (code, text, _) = run(&container_nvml());
    assert_eq!(code, Some(0), "{text}");
    says(&text, &["NVML: no CPU affinity: cannot verify"]);
}

/// A GPU NVML names that sysfs shows as another vendor's function (QEMU's `pci-testdev` on node
/// 1, the guest tier's "GPU"; a GPU passed through as another class): `configure(0)`, `plan --gpu
/// 0` and `topo` find it in the same list and read the same PCI locality, its node's CPUs. plan
/// once read only sysfs's NVIDIA functions and said "no GPU found".
#[test]
fn plan_topo_and_configure_agree_on_a_gpu_nvml_names_outside_sysfs_nvidia_functions() {
    require!(two_cpus("node 1's CPUs narrower than the host"));
    let (node0, node1) = two_halves();
    let host = two_nodes(&node0, &node1).pci_device_on("0000:81:00.0", 0x1b36, 0x00ff00, Some(1));
    let host = Host::written(host, node0, node1);
    let node1 = &host.node1;
    let nvml = format!("gpu 00000000:81:00.0 {UUID_BA} -\n");
    let lib = nvml_double(false);
    let command = |program: &Path| host.command(program, Some((&nvml, &lib)));

    let mut population = command(&gpu_population());
    population.arg("0");
    let out = population.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("DEVICE 0 "))
        .unwrap_or_else(|| panic!("{stdout}\n{stderr}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words[5], node1.to_list(), "configure(0): {line}\n{stderr}");

    let out = command(&cli())
        .args(["plan", "--gpu", "0", "--json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let errors = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "plan --gpu 0: {text}{errors}");
    let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(plan["gpu"]["address"], "0000:81:00.0", "{plan}");
    assert_eq!(plan["gpu"]["numa_node"], 1, "{plan}");
    assert_eq!(plan["gpu"]["source"], "NVML", "{plan}");
    assert_eq!(plan["worker"]["cpus"], node1.to_list(), "{plan}");

    let out = command(&cli()).args(["topo", "--json"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "topo: {text}");
    let topo: serde_json::Value = serde_json::from_str(&text).unwrap();
    let devices = &topo["visible"]["devices"];
    println!("{devices}");
    assert_eq!(devices[0]["address"], "0000:81:00.0", "{topo}");
    assert_eq!(devices[0]["local_cpus"], node1.to_list(), "{topo}");
}

/// The fast tier of the guest's four-node machine (tests/guests/guest.rs): a device the kernel knows
/// no node for (`numa_node` -1, every online CPU in its `local_cpulist`, as a real kernel
/// writes it) gets every CPU with a line saying so; one on a node without CPUs gets the nearest
/// node with CPUs. Both are QEMU's pci-testdev, named GPUs by NVML.
#[test]
fn a_gpu_without_a_node_gets_every_cpu_with_a_line_and_one_on_a_cpu_less_node_the_nearest() {
    require!(two_cpus("node 1's CPUs narrower than the host"));
    let allowed = allowed_cpus();
    let (node0, node1) = two_halves();
    let host = SimulatedHost::new()
        .node(0, &node0)
        .node(1, &node1)
        .node(2, &CpuMask::new())
        .node_distances(vec![vec![10, 20, 20], vec![20, 10, 12], vec![20, 12, 10]])
        .pci_device_on("0000:00:10.0", 0x1b36, 0x00ff00, None)
        .pci_device_on("0000:81:00.0", 0x1b36, 0x00ff00, Some(2));
    let host = Host::written(host, node0, node1);
    let nvml = format!("gpu 00000000:00:10.0 {UUID_3A} -\ngpu 00000000:81:00.0 {UUID_BA} -\n");
    let mut cmd = host.command(&gpu_population(), Some((&nvml, &nvml_double(false))));
    cmd.env("TLLM_AFFINITY_LOG", "info");
    let (lines, stderr) = population(cmd, &[0, 1]);
    println!("{stderr}");
    assert_eq!(lines[0].worker, allowed, "{stderr}");
    says(
        &stderr,
        &["GPU 0000:00:10.0 has no NUMA node: using every online CPU"],
    );
    assert_eq!(lines[1].worker, host.node1, "{stderr}");
    says(
        &stderr,
        &["GPU 0000:81:00.0 sits on NUMA node 2, which has no CPUs: using node 1"],
    );
}

/// The fast tier of the guest's SMT machine (tests/guests/guest.rs): two sockets of two cores of two
/// SMT threads, nodes 0-3 and 4-7, CPU 7 offline, QEMU's pci-testdev on node 1 named GPU 0.
/// `plan` (a what-if over all eight CPUs, since this host may have fewer) keeps CPU 7 out of the
/// worker set and the placements, with the step CPU named and under `auto`.
#[test]
fn plan_keeps_an_offline_cpu_out_of_the_worker_set_and_the_step_placement() {
    let mut host = SimulatedHost::new()
        .node(0, &mask("0-3"))
        .node(1, &mask("4-7"))
        .online(&CpuMask::parse_list("0-6").unwrap())
        .pci_device_on("0000:81:00.0", 0x1b36, 0x00ff00, Some(1));
    for cpu in 0..8 {
        let core = cpu / 2;
        host = host.cpu(
            cpu,
            core % 2,
            cpu / 4,
            &CpuMask::from_cpus([2 * core, 2 * core + 1]),
        );
    }
    let host = Host::written(host, mask("0-3"), mask("4-7"));
    let nvml = format!("gpu 00000000:81:00.0 {UUID_BA} -\n");
    let lib = nvml_double(false);
    for (step_core, result) in [("4", 6), ("auto", 6)] {
        let mut plan = clean(cli());
        plan.args(["plan", "--gpu", "0", "--json", "--cpus", "0-6"])
            .env("TLLM_AFFINITY_SYSFS_ROOT", host.sysfs.path())
            .env("TLLM_AFFINITY_STEP_CORE", step_core);
        let out = host.answer(&mut plan, &nvml, &lib).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(plan["worker"]["cpus"], "4-6", "{step_core}: {plan}");
        assert_eq!(plan["placement"]["step_cpus"], "4-5", "{step_core}: {plan}");
        assert_eq!(
            plan["placement"]["result_cpu"], result,
            "{step_core}: {plan}"
        );
    }
}

/// A GPU whose `numa_node` is -1 with every online CPU in its `local_cpulist` (what the kernel
/// writes on a DGX Spark and some Grace setups) on a host of two nodes: that list says nothing,
/// so NVML's CPU affinity (node 1's CPUs here) decides, for `configure(0)` in a real preloaded
/// program, `plan --gpu 0` and `topo` alike, each naming NVML as the source. Without NVML every
/// CPU, as before.
#[test]
fn nvml_cpu_affinity_wins_over_the_all_cpu_local_cpulist_of_a_gpu_without_a_node() {
    require!(two_cpus("node 1's CPUs narrower than the host"));
    let allowed = allowed_cpus();
    let (node0, node1) = two_halves();
    // No local CPUs given: the tree gets what the kernel writes for `numa_node` -1, every CPU.
    let host = Host::written(
        two_nodes(&node0, &node1).gpu("000f:01:00.0", None, None),
        node0,
        node1,
    );
    let nvml = format!("gpu 0000000F:01:00.0 {UUID_BA} {}\n", host.node1);
    let lib = nvml_double(false);
    let nvml_said = "NVML's CPU affinity";

    let mut cmd = host.command(&gpu_population(), Some((&nvml, &lib)));
    cmd.env("TLLM_AFFINITY_LOG", "info");
    let (lines, stderr) = population(cmd, &[0]);
    println!("{stderr}");
    assert_on(&lines, &[&host.node1], &stderr);

    let plan = host.plan(0, Some((&nvml, &lib)));
    assert_eq!(plan["gpu"]["numa_node"], serde_json::Value::Null, "{plan}");
    assert_eq!(plan["worker"]["cpus"], host.node1.to_list(), "{plan}");
    let source = plan["worker"]["source"].as_str().unwrap_or_default();
    assert!(source.starts_with(nvml_said), "{plan}");

    let out = host
        .command(&cli(), Some((&nvml, &lib)))
        .args(["topo", "--json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "topo: {text}");
    let topo: serde_json::Value = serde_json::from_str(&text).unwrap();
    for gpu in [&topo["gpus"][0], &topo["visible"]["devices"][0]] {
        assert_eq!(gpu["address"], "000f:01:00.0", "{topo}");
        assert_eq!(gpu["local_cpus"], host.node1.to_list(), "{gpu}");
        let from = gpu["local_cpus_from"].as_str().unwrap_or_default();
        assert!(from.starts_with(nvml_said), "{gpu}");
    }

    // No NVML: nothing narrower is known, every CPU.
    let (lines, stderr) = population(host.command(&gpu_population(), None), &[0]);
    assert_on(&lines, &[&allowed], &stderr);
    let plan = host.plan(0, None);
    assert_eq!(plan["worker"]["cpus"], allowed.to_list(), "{plan}");
}

/// NVML's answer for [`gb200_like`]'s two GPUs: CPU affinity `cpus` (node 0's), and
/// `nvmlDeviceGetNumaNodeId` answering `nodes` (the double's fifth field).
fn gb200_nvml(cpus: &CpuMask, nodes: [&str; 2]) -> String {
    GB200_GPUS
        .iter()
        .zip(GB200_UUIDS)
        .zip(nodes)
        .map(|((address, uuid), node)| format!("gpu 0000{address} {uuid} {cpus} {node}\n"))
        .collect()
}

/// `topo --json` and `topo` on `host`; the JSON and the text.
fn topo_of(host: &Host, nvml: Option<(&str, &Path)>) -> (serde_json::Value, String) {
    let run = |args: &[&str]| {
        let out = host.command(&cli(), nvml).args(args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "topo: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let json = run(&["topo", "--json"]);
    (serde_json::from_str(&json).unwrap(), run(&["topo"]))
}

/// Which GPUs (index, address, source) `topo --json` says each NUMA node holds the memory of,
/// for the nodes that hold any.
fn gpu_memory_marks(topo: &serde_json::Value) -> Vec<(u64, u64, String, String)> {
    let mut marks = Vec::new();
    for node in topo["nodes"].as_array().unwrap() {
        for gpu in node["gpu_memory_of"].as_array().unwrap() {
            marks.push((
                node["id"].as_u64().unwrap(),
                gpu["index"].as_u64().unwrap(),
                gpu["address"].as_str().unwrap().to_string(),
                gpu["from"].as_str().unwrap().to_string(),
            ));
        }
    }
    marks
}

/// The marks a GB200 tray's two GPUs should get: node 2 holds GPU 0's memory, node 10 GPU 1's.
fn gb200_marks(from: &str) -> Vec<(u64, u64, String, String)> {
    vec![
        (2, 0, GB200_GPUS[0].to_string(), from.to_string()),
        (10, 1, GB200_GPUS[1].to_string(), from.to_string()),
    ]
}

/// Half a GB200 tray in NUMA mode (Grace nodes 0 and 1, each GPU's memory a CPU-less node with
/// the tray's sparse ids 2 and 10, placeholder nodes 3-9 with neither CPUs nor memory): `topo`
/// names node 2 as GPU 0's memory and node 10 as GPU 1's, in text and JSON, from NVML's
/// `nvmlDeviceGetNumaNodeId`, and from the driver's `numa_status` where NVML is absent. A node
/// with CPUs that NVML names is no GPU's memory; a double file without the node field (and a
/// driver without the call) gives no mark.
#[test]
fn topo_names_the_cpu_less_node_holding_each_gpus_memory() {
    let (node0, node1) = two_halves();
    let lib = nvml_double(false);
    let nvml = gb200_nvml(&node0, ["2", "10"]);

    // NVML alone (no driver list in the tree).
    let host = Host::written(gb200_like(&node0, &node1), node0.clone(), node1.clone());
    let (topo, text) = topo_of(&host, Some((&nvml, &lib)));
    println!("{text}");
    assert_eq!(gpu_memory_marks(&topo), gb200_marks("nvml"), "{topo}");
    for (i, node) in [(0, 2), (1, 10)] {
        let gpu = &topo["gpus"][i];
        assert_eq!(gpu["memory_node"], node, "{gpu}");
        assert_eq!(gpu["memory_node_from"], "nvml", "{gpu}");
        assert_eq!(gpu["numa_node"], 0, "{gpu}");
        assert_eq!(gpu["local_cpus"], node0.to_list(), "{gpu}");
    }
    let line = |id: usize| {
        text.lines()
            .find(|l| l.starts_with(&format!("  node {id}: ")))
            .unwrap_or_else(|| panic!("no node {id} in:\n{text}"))
            .to_string()
    };
    says(
        &line(2),
        &[&format!("GPU 0's memory ({}, from NVML)", GB200_GPUS[0])],
    );
    says(
        &line(10),
        &[&format!("GPU 1's memory ({}, from NVML)", GB200_GPUS[1])],
    );
    never_says(&line(3), &["memory ("]);
    says(&line(3), &["memory no"]);
    says(
        &text,
        &[&format!(
            "1: {} (device 2330), NUMA node 0, local CPUs [{node0}] from the GPU's PCI \
             local_cpulist, its memory on node 10 (from NVML)",
            GB200_GPUS[1]
        )],
    );

    // The old line format (no node field), and a driver without nvmlDeviceGetNumaNodeId: no
    // GPU memory named, nothing else changed.
    let old_lines = gb200_nvml(&node0, ["", ""]);
    let without_call = nvml_double_without_numa_node_id();
    for (answer, lib) in [(&old_lines, &lib), (&nvml, &without_call)] {
        let (topo, _) = topo_of(&host, Some((answer, lib)));
        assert_eq!(gpu_memory_marks(&topo), [], "{topo}");
        assert_eq!(topo["visible"]["source"], "nvml", "{topo}");
        assert_eq!(topo["gpus"][0]["memory_node"], serde_json::Value::Null);
    }
    // NVML naming the Grace node (it has CPUs): ignored.
    let (topo, _) = topo_of(&host, Some((&gb200_nvml(&node0, ["0", "10"]), &lib)));
    assert_eq!(gpu_memory_marks(&topo), gb200_marks("nvml")[1..], "{topo}");

    // The driver's numa_status, NVML absent.
    let host = Host::from_sysfs(Sysfs::gb200());
    let (topo, text) = topo_of(&host, None);
    assert_eq!(topo["visible"]["source"], "driver", "{topo}");
    assert_eq!(
        gpu_memory_marks(&topo),
        gb200_marks("numa_status"),
        "{topo}"
    );
    says(
        &text,
        &[&format!(
            "GPU 0's memory ({}, from the driver's numa_status)",
            GB200_GPUS[0]
        )],
    );
    // NVML naming the Grace node for GPU 0: ignored, and the driver's numa_status answers.
    let (topo, _) = topo_of(&host, Some((&gb200_nvml(&node0, ["0", "10"]), &lib)));
    let marks = gpu_memory_marks(&topo);
    assert_eq!(marks[0], gb200_marks("numa_status")[0], "{topo}");
    assert_eq!(marks[1], gb200_marks("nvml")[1], "{topo}");
}

/// The double without `nvmlDeviceGetNumaNodeId`, as drivers before NVML 12.
fn nvml_double_without_numa_node_id() -> PathBuf {
    let lib = Program::c("nvml_double")
        .shared()
        .named("nvml-no-numa-node/libnvidia-ml.so.1")
        .flags(&["-DOMIT_NUMA_NODE_ID"])
        .build();
    lib.parent().unwrap().to_path_buf()
}

/// On half a GB200 tray whose NVML names the GPUs' memory nodes 2 and 10, `configure(0)` and
/// `configure(1)` in a real preloaded program put the workers on Grace node 0's CPUs (the GPUs'
/// PCI node), never on a GPU memory node, and `plan --gpu 0` shows the same set.
#[test]
fn gb200_workers_go_to_the_grace_node_not_the_gpus_memory_node() {
    require!(two_cpus("node 0's CPUs narrower than the host"));
    let host = Host::from_sysfs(Sysfs::gb200());
    let nvml = gb200_nvml(&host.node0, ["2", "10"]);
    let lib = nvml_double(false);
    let (lines, stderr) = population(
        host.command(&gpu_population(), Some((&nvml, &lib))),
        &[0, 1],
    );
    assert_on(&lines, &[&host.node0, &host.node0], &stderr);
    // No NVML: the driver's list, the same set.
    let (lines, stderr) = population(host.command(&gpu_population(), None), &[0]);
    assert_on(&lines, &[&host.node0], &stderr);

    let plan = host.plan(0, Some((&nvml, &lib)));
    assert_eq!(plan["gpu"]["address"], GB200_GPUS[0], "{plan}");
    assert_eq!(plan["worker"]["cpus"], host.node0.to_list(), "{plan}");
    assert_eq!(
        plan["worker"]["source"], "the GPU's PCI local_cpulist",
        "{plan}"
    );
}
