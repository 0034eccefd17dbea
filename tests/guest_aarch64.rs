//! The aarch64 guest tier: the aarch64 build of the library, the command and the test programs
//! (zig cross-builds, as tests/aarch64.rs) on a real arm64 kernel (Debian's), in a guest shaped
//! like a GB200 compute tray at small scale: two Grace nodes with CPUs and memory and no SMT,
//! the GPU's memory as a CPU-less node with memory at a sparse id, a real tray's kind of
//! distances, and the "GPU" (QEMU's `pci-testdev`) on a Grace node.
//!
//! The guest boots under QEMU's `virt` machine with software emulation (TCG) through virtme-ng
//! (tests/common/guest.rs, the x86_64 guest tier's harness), over an arm64 Debian root file
//! system of its own (debootstrap, with the kernel's modules, udev and kmod), made once and kept
//! in /var/cache/tllm-affinity. This checkout and its target directory are bound read-only at
//! their own paths inside, so the script and the programs are where they are here.
//!
//! Under device-tree boot QEMU's `virt` gives its PCI devices no NUMA node. For the GPU on a
//! Grace node the test dumps the machine's device tree, gives the PCI host bridge a
//! `numa-node-id` with `dtc`, and boots with that tree; a second boot keeps QEMU's own tree,
//! where the device's `numa_node` is -1 (as on a DGX Spark) and NVML's CPU affinity must decide.
//!
//! What is real: the arm64 kernel, its masks, NUMA nodes, memory and page placement, PCI
//! locality. What is a test double: NVML alone (`tests/programs/nvml_double.c`).
//!
//! Needs root (the root filesystem is made with debootstrap and chroot), `qemu-system-aarch64`,
//! `dtc`, virtme-ng and the arm64 kernel `scripts/setup` unpacks; without them the tests skip,
//! and fail in CI.
//!
//! Run alone: `cargo test --release --test guest_aarch64 -- --nocapture`.

mod common;

use common::guest::*;
use common::*;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// One boot attempt's limit. The arm64 guest boots in 15–30 s under TCG on an idle machine;
/// its scenarios run emulated too, and the machine is shared.
const BOOT_LIMIT: Duration = Duration::from_secs(480);

/// Where `scripts/setup` unpacks Debian's arm64 kernel package (boot/, lib/modules/).
const ARM64_KERNEL: &str = "/var/cache/tllm-affinity/arm64-kernel";

/// The GPU's PCI address in the guest: `pci-testdev` at slot 2 of the root bus.
const GUEST_GPU: &str = "0000:00:02.0";
/// The Grace node the GPU is attached to, and its CPUs.
const GRACE_NODE: usize = 1;
const GRACE_CPUS: &str = "2-3";
/// The GPU's memory: a CPU-less node with memory, at a sparse id. QEMU 7.2 wants every node id
/// below the highest to exist ("numa: Node ID missing: 9"), so nodes 2-9 are given with neither
/// CPUs nor memory: the kernel shows them online and empty, as a tray shows its per-GPU
/// placeholder nodes.
const GPU_MEMORY_NODE: usize = 10;
const ALL4: &str = "0-3";

/// The guest machine: node 0 = CPUs 0-1, node 1 = CPUs 2-3 (1 GiB each), node 10 = 512 MiB and
/// no CPU; distances of a tray: 40 between the Grace nodes, 80 from a Grace node to the memory
/// of its own GPU, 120 to another's (and to the placeholders).
fn gb200_machine(name: &'static str, qemu_opts: String, script: &'static str) -> Machine {
    let nodes = 0..=GPU_MEMORY_NODE;
    let mut distances = Vec::new();
    for a in nodes.clone() {
        for b in a + 1..=GPU_MEMORY_NODE {
            let d = match (a, b) {
                (0, 1) => 40,
                (GRACE_NODE, GPU_MEMORY_NODE) => 80,
                _ => 120,
            };
            distances.push(format!("{a},{b}={d}"));
        }
    }
    Machine {
        name,
        cpus: 4,
        memory: "2560M",
        numa: &[
            "1G,cpus=0-1",
            "1G,cpus=2-3",
            "0,nodeid=2",
            "0,nodeid=3",
            "0,nodeid=4",
            "0,nodeid=5",
            "0,nodeid=6",
            "0,nodeid=7",
            "0,nodeid=8",
            "0,nodeid=9",
            "512M,nodeid=10",
        ],
        qemu_opts: format!("-device pci-testdev,bus=pcie.0,addr=0x2 {qemu_opts}"),
        distances,
        nodes: "0-10",
        script,
        program: "numa_placement",
        deployments: false,
    }
}

/// What the guest needs from this machine: vng, the arm64 kernel, its root filesystem, dtc.
struct Tools {
    vng: Vng,
    kernel: Kernel,
    rootfs: PathBuf,
}

fn tools() -> Result<Tools, String> {
    if !root() {
        return Err(
            "root (the guest's root filesystem is made with debootstrap and chroot)".into(),
        );
    }
    for (tool, package) in [
        ("qemu-system-aarch64", "qemu-system-arm"),
        ("dtc", "device-tree-compiler"),
        ("depmod", "kmod"),
        ("cargo-zigbuild", "cargo-zigbuild, from pip"),
    ] {
        if !on_path(tool) {
            return Err(format!("`{tool}` ({package}; scripts/setup installs it)"));
        }
    }
    let vng = vng()?;
    let kernel = newest_kernel(&Path::new(ARM64_KERNEL).join("boot")).ok_or(format!(
        "the arm64 kernel: no {ARM64_KERNEL}/boot/vmlinuz-* (scripts/setup unpacks Debian's \
         linux-image-arm64 there)"
    ))?;
    let rootfs = guest_rootfs(&kernel)?;
    Ok(Tools {
        vng,
        kernel,
        rootfs,
    })
}

/// Debian bookworm for arm64 with what the guest's init needs (udev, kmod, busybox-static for
/// its initramfs and `poweroff`) and the kernel's modules, made once per kernel release: debootstrap's second
/// stage runs under qemu-user (binfmt_misc, as for tests/aarch64.rs).
fn guest_rootfs(kernel: &Kernel) -> Result<PathBuf, String> {
    let release = &kernel.release;
    let rootfs = debootstrapped(
        &format!("bookworm-arm64-guest-{release}"),
        &format!("lib/modules/{release}/modules.dep"),
        &format!(
            "an arm64 guest root filesystem: `debootstrap --arch=arm64 bookworm {MIRROR}` with \
             the modules of {release}"
        ),
        |partial| {
            Command::new("sh")
                .arg("-c")
                .arg(
                    r#"set -e; partial=$1 mirror=$2 modules=$3 release=$4
                    debootstrap --arch=arm64 --foreign --variant=minbase \
                        --include=udev,kmod,numactl,busybox-static bookworm "$partial" "$mirror"
                    chroot "$partial" /debootstrap/debootstrap --second-stage
                    mkdir -p "$partial/lib/modules"
                    cp -a "$modules/$release" "$partial/lib/modules/"
                    depmod -b "$partial" "$release"
                    [ -e "$partial/usr/sbin/poweroff" ] || [ -e "$partial/sbin/poweroff" ] ||
                        ln -s /bin/busybox "$partial/usr/local/sbin/poweroff""#,
                )
                .arg("sh")
                .arg(partial)
                .arg(MIRROR)
                .arg(Path::new(ARM64_KERNEL).join("lib/modules"))
                .arg(release)
                .output()
                .unwrap()
        },
    )?;
    Ok(rootfs)
}

/// The aarch64 files the guest runs: the library, the command, the NVML double's directory,
/// numa_placement and memory_follows, in the order tests/guest/gb200*.sh take them; built once
/// for both boots.
fn aarch64_files() -> &'static [PathBuf] {
    static FILES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    FILES.get_or_init(build_aarch64_files)
}

fn build_aarch64_files() -> Vec<PathBuf> {
    aarch64_wheel();
    let natives = aarch64_natives();
    let nvml_dir = for_aarch64(Program::c("nvml_double").shared())
        .named("aarch64/nvml/libnvidia-ml.so.1")
        .build()
        .parent()
        .unwrap()
        .to_path_buf();
    vec![
        natives.join("libtllm_affinity.so"),
        natives.join("tllm-affinity"),
        nvml_dir,
        arm64_program("numa_placement"),
        arm64_program("memory_follows"),
    ]
}

/// How the GPU's PCI device gets its node.
#[derive(Clone, Copy)]
enum DeviceNode {
    /// The host bridge's `numa-node-id` in an edited device tree: the Grace node.
    Grace,
    /// QEMU's own device tree: none (`numa_node` -1).
    None,
}

fn boot_gb200(device_node: DeviceNode, script: &'static str) -> Result<Booted, NoBoot> {
    let tools = tools().map_err(NoBoot::Missing)?;
    let files = aarch64_files();
    // The checkout (the scripts, target/zig) and cargo's target directory (the programs), bound
    // read-only at their paths; their mount points exist in the root filesystem.
    let target = target_dir().parent().unwrap().to_path_buf();
    let mut binds = vec![repo().to_path_buf()];
    if !target.starts_with(repo()) {
        binds.push(target);
    }
    let mut guest_args: Vec<OsString> = vec!["--arch".into(), "arm64".into(), "--root".into()];
    guest_args.push(tools.rootfs.clone().into());
    for dir in &binds {
        std::fs::create_dir_all(tools.rootfs.join(dir.strip_prefix("/").unwrap())).unwrap();
        // GUEST=HOST: a bare path must lie inside the guest's root.
        guest_args.push(format!("--rodir={0}={0}", dir.display()).into());
    }
    let exec = std::iter::once(repo().join("tests/guest").join(script))
        .chain(files.iter().cloned())
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" ");
    let exec = format!("sh {exec}");
    let name = match device_node {
        DeviceNode::Grace => "GB200-like aarch64, the GPU on Grace node 1",
        DeviceNode::None => "GB200-like aarch64, the GPU without a NUMA node",
    };
    let plain = gb200_machine(name, String::new(), script);
    let machine = match device_node {
        DeviceNode::None => plain,
        DeviceNode::Grace => {
            let dtb = device_tree_with_the_bridge_on(&plain, &tools, &guest_args, GRACE_NODE)
                .map_err(NoBoot::Failed)?;
            gb200_machine(name, format!("-dtb {}", dtb.display()), script)
        }
    };
    let mut args: Vec<OsString> = machine.vng_args().into_iter().map(Into::into).collect();
    args.extend(guest_args);
    boot(
        &Boot {
            machine: &machine,
            vng: &tools.vng,
            kernel: &tools.kernel,
            args,
            exec,
        },
        BOOT_LIMIT,
    )
}

/// The device tree QEMU makes for `machine` (dumped by the same vng command line, so the same
/// devices and memory), with `numa-node-id = <node>` on the PCI host bridge: every PCI device
/// then has that `numa_node`.
fn device_tree_with_the_bridge_on(
    machine: &Machine,
    tools: &Tools,
    guest_args: &[OsString],
    node: usize,
) -> Result<PathBuf, String> {
    let dir = target_dir().join("guest-aarch64");
    std::fs::create_dir_all(&dir).unwrap();
    let dumped = dir.join("virt.dtb");
    let _ = std::fs::remove_file(&dumped);
    let mut args = machine.vng_args();
    let opts = args.pop().unwrap();
    args.push(format!("{opts} -machine dumpdtb={}", dumped.display()));
    let out = Command::new(&tools.vng.vng)
        .arg("--run")
        .arg(&tools.kernel.image)
        .args(args)
        .args(guest_args)
        .args(["--exec", "true"])
        .env("PATH", &tools.vng.path)
        .current_dir(repo())
        .output()
        .unwrap();
    if !dumped.is_file() {
        return Err(format!(
            "QEMU dumped no device tree for {}: {}",
            machine.name,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rfind(|l| !l.trim().is_empty())
                .unwrap_or("no output")
        ));
    }
    let source = succeeded(
        Command::new("dtc")
            .args(["-q", "-I", "dtb", "-O", "dts"])
            .arg(&dumped),
    );
    let source = String::from_utf8(source.stdout).unwrap();
    let bridge = "\tpcie@10000000 {\n";
    if !source.contains(bridge) {
        return Err(format!(
            "no PCI host bridge `pcie@10000000` in {}",
            dumped.display()
        ));
    }
    let edited = source.replacen(
        bridge,
        &format!("{bridge}\t\tnuma-node-id = <{node:#x}>;\n"),
        1,
    );
    let dts = dir.join(format!("virt-pci-node{node}.dts"));
    let dtb = dts.with_extension("dtb");
    std::fs::write(&dts, edited).unwrap();
    succeeded(
        Command::new("dtc")
            .args(["-q", "-I", "dts", "-O", "dtb", "-o"])
            .arg(&dtb)
            .arg(&dts),
    );
    Ok(dtb)
}

/// The GB200-like guest, the GPU on Grace node 1: scenarios 1-4 (tests/guest/gb200.sh).
fn gb200() -> Result<&'static Booted, String> {
    static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
    booted(&BOOT, || boot_gb200(DeviceNode::Grace, "gb200.sh"))
}

/// The same machine with the GPU's `numa_node` -1 (tests/guest/gb200_no_node.sh).
fn no_node() -> Result<&'static Booted, String> {
    static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
    booted(&BOOT, || boot_gb200(DeviceNode::None, "gb200_no_node.sh"))
}

/// `key=value` lines of a scenario, as a map.
fn values(run: &Scenario) -> BTreeMap<String, String> {
    run.out
        .iter()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// At least 95 % of `pages` on `node`.
fn mostly_on(nodes: &BTreeMap<usize, usize>, node: usize, pages: usize) -> bool {
    nodes.get(&node).copied().unwrap_or(0) * 100 >= pages * 95
}

/// The 64 MiB buffer's and the 16 MiB bound buffer's 4 KiB pages.
const BUFFER_PAGES: usize = 16384;
const GPU_BUFFER_PAGES: usize = 4096;

#[test]
fn the_guest_is_aarch64_with_two_grace_nodes_a_gpu_memory_node_and_the_gpu_on_node_1() {
    let guest = require!(gb200());
    let nodes = values(guest.ok("nodes"));
    println!(
        "tier: {} booted in {:.0} s\n{nodes:#?}",
        guest.machine,
        guest.wall.as_secs_f64()
    );
    assert_eq!(nodes["arch"], "aarch64");
    assert_eq!(nodes["online"], "0-10", "placeholders 2-9 included");
    assert_eq!(nodes["has_cpu"], "0-1", "node 10 has no CPUs");
    assert_eq!(nodes["has_memory"], "0-1,10", "node 10 has memory");
    assert_eq!(nodes["node0_cpus"], "0-1");
    assert_eq!(nodes["node1_cpus"], GRACE_CPUS);
    assert_eq!(nodes["node10_cpus"], "");
    let node10_kib: u64 = nodes["node10_memory_kib"].parse().unwrap();
    assert!(node10_kib > 400 << 10, "node 10's memory: {node10_kib} KiB");
    assert_eq!(
        nodes["node1_distance"], "40 10 120 120 120 120 120 120 120 120 80",
        "{nodes:?}"
    );
    // No SMT: each CPU is its own only sibling.
    assert_eq!(nodes["siblings"].trim_end(), "0 1 2 3", "{nodes:?}");
    assert_eq!(
        guest.ok("pci").out,
        [format!("{GRACE_NODE}"), GRACE_CPUS.to_string()],
        "{GUEST_GPU}'s numa_node and local_cpulist"
    );
}

#[test]
fn workers_go_to_the_gpus_grace_node_host_threads_stay_and_release_restores() {
    let guest = require!(gb200());
    let run = guest.ok("placement");
    check_placement_and_release(run, GRACE_CPUS, ALL4, GUEST_GPU);
    // Pages the workers first touched: on their Grace node, none on the GPU's memory node.
    for buffer in ["worker", "child", "scoped"] {
        let (nodes, failed) = run.pages(buffer);
        println!("pages {buffer}: {nodes:?}");
        assert_eq!(failed, 0, "{buffer}");
        assert_eq!(
            nodes.keys().copied().collect::<Vec<_>>(),
            [GRACE_NODE],
            "{buffer}: {nodes:?}"
        );
    }
}

/// The scope's caller prefers the workers' node while its scope is open: a Grace node (node
/// mask 2: node 1), never the GPU's memory node; host threads keep MPOL_DEFAULT.
#[test]
fn the_worker_scopes_memory_preference_is_the_grace_node_never_the_gpu_memory_node() {
    let guest = require!(gb200());
    let run = guest.ok("placement");
    let words = |thread: &str, phase: &str| -> String {
        run.lines(&format!("POLICY {thread} "))
            .into_iter()
            .find(|w| w[0] == phase)
            .map(|w| w[1..].join(" "))
            .unwrap_or_else(|| panic!("no POLICY {thread} {phase}:\n{}", run.text()))
    };
    println!("scope: {}", words("main", "scope"));
    assert_eq!(
        words("main", "scope"),
        format!("1 {:x}", 1u64 << GRACE_NODE)
    );
    assert_eq!(words("main", "after_scope"), "0 0");
    for (thread, phase) in [
        ("main", "before"),
        ("main", "configured"),
        ("H", "before"),
        ("H", "configured"),
    ] {
        assert_eq!(run.policy(thread, phase), 0, "{thread} {phase}");
    }
}

/// A dedicated worker that touched 64 MiB on Grace node 0 and bound 16 MiB to the GPU's memory
/// node: after its configure for the GPU on node 1, ≥ 95 % of the 64 MiB is on node 1 and none
/// on node 10; the bound buffer stays on node 10, every page. In a shared process (configure on
/// another thread) nothing moves.
#[test]
fn a_dedicated_workers_memory_goes_to_the_grace_node_and_gpu_memory_stays_where_it_was_put() {
    let guest = require!(gb200());
    let run = guest.ok("dedicated");
    let pages = |phase: &str| {
        let (nodes, failed) = run.pages(phase);
        assert_eq!(failed, 0, "{phase}:\n{}", run.text());
        nodes
    };
    let (before, after) = (pages("before"), pages("after"));
    let (gpu_before, gpu_after) = (pages("gpu_before"), pages("gpu_after"));
    println!("dedicated: 64 MiB before {before:?}, after {after:?}");
    println!("dedicated: 16 MiB bound to node 10 before {gpu_before:?}, after {gpu_after:?}");
    assert!(mostly_on(&before, 0, BUFFER_PAGES), "before {before:?}");
    assert!(
        mostly_on(&after, GRACE_NODE, BUFFER_PAGES),
        "after {after:?}\n{}",
        run.stderr()
    );
    assert_eq!(after.get(&GPU_MEMORY_NODE), None, "after {after:?}");
    assert_eq!(
        gpu_before,
        BTreeMap::from([(GPU_MEMORY_NODE, GPU_BUFFER_PAGES)]),
        "the program's own placement"
    );
    assert_eq!(gpu_after, gpu_before, "{}", run.stderr());
    let moved = &run.report()["memory_moved"];
    assert_eq!(moved["node"], GRACE_NODE, "{moved}");

    let shared = guest.ok("shared");
    let (before, after) = (shared.pages("before").0, shared.pages("after").0);
    println!("shared process: before {before:?}, after {after:?}");
    assert!(mostly_on(&before, 0, BUFFER_PAGES), "before {before:?}");
    assert_eq!(after, before, "{}", shared.stderr());
    assert_eq!(shared.report()["worker_mask"], GRACE_CPUS);
}

#[test]
fn topo_plan_and_configure_agree_on_the_grace_node() {
    let guest = require!(gb200());
    let configured = guest.ok("placement").mask("configured", "W").0;
    let topo = guest.ok("topo").json();
    let plan = guest.ok("plan").json();
    println!("topo nodes: {}\nplan: {plan}", topo["nodes"]);
    assert_eq!(topo["online"], ALL4, "{topo}");
    let device = &topo["visible"]["devices"][0];
    assert_eq!(device["address"], GUEST_GPU, "{topo}");
    assert_eq!(plan["gpu"]["address"], GUEST_GPU, "{plan}");
    assert_eq!(plan["gpu"]["numa_node"], GRACE_NODE, "{plan}");
    // NVML names node 10 as the GPU's memory: topo says so, and nothing runs there.
    let gpu = &topo["gpus"][0];
    assert_eq!(gpu["memory_node"], GPU_MEMORY_NODE, "{gpu}");
    assert_eq!(gpu["memory_node_from"], "nvml", "{gpu}");
    let node10 = row(&topo, "nodes", "id", GPU_MEMORY_NODE);
    assert_eq!(node10["cpus"], "", "{node10}");
    assert_eq!(node10["has_memory"], true, "{node10}");
    assert_eq!(node10["gpu_memory_of"][0]["address"], GUEST_GPU, "{node10}");
    for (who, cpus) in [
        ("topo", device["local_cpus"].clone()),
        ("plan", plan["worker"]["cpus"].clone()),
        ("configure", serde_json::json!(configured)),
    ] {
        assert_eq!(cpus, GRACE_CPUS, "{who}: GPU 0's CPUs");
    }
}

/// The GPU's `numa_node` is -1 (QEMU's own device tree; a DGX Spark's GPU is so): NVML's CPU
/// affinity (node 1's CPUs) decides, for `configure(0)` and `plan --gpu 0` alike.
#[test]
fn a_gpu_without_a_numa_node_gets_nvmls_cpu_affinity() {
    let guest = require!(no_node());
    let pci = guest.ok("pci");
    println!(
        "tier: {} booted in {:.0} s",
        guest.machine,
        guest.wall.as_secs_f64()
    );
    assert_eq!(
        pci.out,
        ["-1", ALL4],
        "{GUEST_GPU}'s numa_node and local_cpulist"
    );
    let run = guest.ok("placement");
    println!("{}\n{}", run.text(), run.stderr());
    assert_eq!(
        run.mask("configured", "W"),
        (GRACE_CPUS.to_string(), Some(1)),
        "{}",
        run.stderr()
    );
    assert_eq!(run.mask("configured", "H").0, ALL4);
    assert_eq!(run.mask("released", "W").0, ALL4);
    let plan = guest.ok("plan").json();
    assert_eq!(plan["worker"]["cpus"], GRACE_CPUS, "{plan}");
}
