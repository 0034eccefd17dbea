//! The guest tier: the library on a real Linux kernel with several NUMA nodes, SMT siblings, an
//! offline CPU, cgroup v2 and a PCI device on a chosen node, not on sysfs trees the tests write.
//!
//! Each topology is one boot of Debian's kernel under QEMU (TCG: software emulation, since KVM
//! is not usable on every CI machine) over this machine's own root filesystem, with virtme-ng
//! (`vng`), so the library, the CLI and the test programs built here are at the same paths
//! inside. The boot runs one script of `tests/guest/` that runs every scenario of the topology
//! and prints each one's lines prefixed by its name; the tests below assert on those lines.
//! Every test first checks that the lines come from the guest: its kernel release, the nodes
//! the topology asked for, and no simulated sysfs root.
//!
//! What is real: the kernel, its CPU masks, NUMA nodes, memory and page placement, PCI
//! locality, CPU hotplug and cgroup v2. What is a test double: NVML alone
//! (`tests/programs/nvml_double.c`), which names QEMU's `pci-testdev` as GPU 0.
//!
//! A guest that cannot boot fails the test with one line saying why (missing kernel, QEMU
//! error, timeout). A boot that times out is tried once more; nothing else is retried. Without
//! QEMU, virtme-ng or a kernel (`scripts/setup` installs them) the tests skip, and fail in CI.
//!
//! Run alone: `cargo test --release --test guests -- guest:: --nocapture`.

use crate::common;

use common::guest::*;
use common::slices;
use common::tray;
use common::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tllm_affinity_core::mask::CpuMask;

/// One boot attempt's limit. A 4-vCPU guest boots in 40–85 s under TCG on a loaded machine.
const BOOT_LIMIT: Duration = Duration::from_secs(200);
/// The seed deployments' boot: four Python apps under `tllm-affinity run`, each 30–60 s under
/// TCG on a quiet machine (and up to three times that on a loaded one).
const DEPLOYMENTS_LIMIT: Duration = Duration::from_secs(540);
/// The memory machine's boot: the seed deployments' apps, then its scenarios, among them ten
/// runs of a move beside a forking thread and four moves of 256 MiB (about 460 s with two other
/// builds on this machine's two cores, before the last ten).
const MEMORY_LIMIT: Duration = Duration::from_secs(900);
/// The SMT machine's boot: eight vCPUs, and four Python servers on a tray, then four engines side
/// by side twice, before its scenarios (about 190 s in all with two other builds on this
/// machine's two cores before the engines).
const SMT_LIMIT: Duration = Duration::from_secs(540);
/// The move's cost: 1 GiB first-touched and moved three times under TCG, about 3 minutes with
/// the boot on a quiet machine (and past `BOOT_LIMIT` on a loaded one).
const MEMORY_BENCH_LIMIT: Duration = Duration::from_secs(540);
const MEMORY_BENCH_SCRIPT: &str = "memory_bench.sh";

/// QEMU's `pci-testdev` behind a PCIe root bridge on NUMA node `node`: `0000:81:00.0` in the
/// guest, with that `numa_node` and the node's CPUs as its `local_cpulist`.
fn test_device_on(node: usize) -> String {
    format!(
        "-device pxb-pcie,id=n1,bus_nr=0x80,numa_node={node},bus=pcie.0 \
         -device pcie-root-port,id=n1p,bus=n1,chassis=9 -device pci-testdev,bus=n1p"
    )
}

/// The guest's "GPU" as the NVML test double's file names it (tests/guest/*.sh write it).
const GUEST_GPU: &str = "0000:81:00.0";

/// `vng` and the guest kernel (this machine's, with its modules), or what is missing.
fn tools() -> Result<(Vng, Kernel), String> {
    if !on_path("qemu-system-x86_64") {
        return Err("QEMU (`qemu-system-x86_64`; scripts/setup installs qemu-system-x86)".into());
    }
    let vng = vng()?;
    let kernel = newest_kernel(Path::new("/boot"))
        .ok_or("a guest kernel: no /boot/vmlinuz-* (scripts/setup installs linux-image-amd64)")?;
    if !Path::new("/lib/modules").join(&kernel.release).is_dir() {
        return Err(format!(
            "the modules of the guest kernel {} in /lib/modules (linux-image-amd64)",
            kernel.release
        ));
    }
    Ok((vng, kernel))
}

fn boot_machine(machine: &Machine, limit: Duration) -> Result<Booted, NoBoot> {
    let (vng, kernel) = tools().map_err(NoBoot::Missing)?;
    // Built here, run there: the guest sees this file system.
    let nvml_dir = Program::c("nvml_double")
        .shared()
        .named("nvml/libnvidia-ml.so.1")
        .build()
        .parent()
        .unwrap()
        .to_path_buf();
    let program = Program::c(machine.program).build();
    let script = repo().join("tests/guest").join(machine.script);
    let mut exec = format!(
        "sh {} {} {} {} {}",
        script.display(),
        library().display(),
        cli().display(),
        nvml_dir.display(),
        program.display()
    );
    for path in script_extra_args(machine) {
        exec.push_str(&format!(" {}", path.display()));
    }
    let args = machine.vng_args().into_iter().map(Into::into).collect();
    boot(
        &Boot {
            machine,
            vng: &vng,
            kernel: &kernel,
            args,
            exec,
        },
        limit,
    )
}

/// What a machine's script takes after the library, the CLI, the double and the program: the
/// seed deployments' Python, programs and native libraries; the SMT machine's Python, programs
/// and the GB200 tray written over its sockets.
fn script_extra_args(machine: &Machine) -> Vec<std::path::PathBuf> {
    if machine.deployments {
        return vec![
            python(),
            programs_dir(),
            openmp_library(),
            Program::c("nccl").shared().build(),
            Program::c("progress_threads").shared().build(),
        ];
    }
    if machine.script == SMT_SCRIPT {
        return vec![
            python(),
            programs_dir(),
            tray_over_the_smt_sockets(),
            slice_tree_over_the_smt_sockets(),
        ];
    }
    if machine.script == SLICES_BENCH_SCRIPT {
        let engine = Program::c("../../benches/programs/engine_step")
            .shared()
            .named("libengine_step.so")
            .build();
        let (rounds, _) = bench_rounds_and_against();
        return vec![
            python(),
            repo().join("scripts/bench_slices.py"),
            engine,
            rounds.to_string().into(),
        ];
    }
    if machine.script == MEMORY_BENCH_SCRIPT {
        let (rounds, against) = bench_rounds_and_against();
        return std::iter::once(rounds.to_string())
            .chain(against)
            .map(Into::into)
            .collect();
    }
    Vec::new()
}

/// `fn NAME()`: the boot of `MACHINE`, once per test binary, shared by its tests.
macro_rules! booted_once {
    ($name:ident, $machine:ident) => {
        fn $name() -> Result<&'static Booted, String> {
            static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
            booted_once(&BOOT, $machine)
        }
    };
}

/// The boot of `machine`, once per test binary, shared by its tests.
fn booted_once(
    cell: &'static OnceLock<Result<Booted, NoBoot>>,
    machine: fn() -> Machine,
) -> Result<&'static Booted, String> {
    booted(cell, || {
        let machine = machine();
        let limit = if machine.script == "memory.sh" {
            MEMORY_LIMIT
        } else if machine.deployments {
            DEPLOYMENTS_LIMIT
        } else if machine.script == SMT_SCRIPT || machine.script == SLICES_BENCH_SCRIPT {
            SMT_LIMIT
        } else {
            BOOT_LIMIT
        };
        boot_machine(&machine, limit)
    })
}

// ---- Topology A: two nodes of two CPUs, the GPU on node 1; cgroup v2 inside it ----

fn two_nodes_machine() -> Machine {
    Machine {
        name: "two nodes x two CPUs",
        cpus: 4,
        // 1 GiB a node: room for the buffers of three runs beside what the guest reads.
        memory: "2G",
        numa: &["1G,cpus=0-1", "1G,cpus=2-3"],
        qemu_opts: test_device_on(1),
        distances: Vec::new(),
        nodes: "0-1",
        script: "two_nodes.sh",
        program: "numa_placement",
        deployments: false,
    }
}

booted_once!(two_nodes, two_nodes_machine);

/// The same machine, booted apart for the seed deployments.
fn deployments_machine() -> Machine {
    Machine {
        name: "two nodes x two CPUs, the seed deployments",
        script: "deployments.sh",
        deployments: true,
        ..two_nodes_machine()
    }
}

booted_once!(deployments, deployments_machine);

const NODE1: &str = "2-3";
const ALL4: &str = "0-3";

#[test]
fn the_guest_has_two_real_nodes_and_the_device_on_node_1() {
    let guest = require!(two_nodes());
    let pci = guest.ok("pci");
    assert_eq!(
        pci.out,
        ["1", NODE1],
        "the device's numa_node and local_cpulist"
    );
    println!(
        "tier: {} booted in {:.0} s",
        guest.machine,
        guest.wall.as_secs_f64()
    );
}

#[test]
fn configure_puts_the_worker_and_its_threads_on_the_gpus_node_and_release_restores() {
    let guest = require!(two_nodes());
    let report = check_placement_and_release(guest.ok("placement"), NODE1, ALL4, GUEST_GPU);
    assert_eq!(report["constrained"], false, "{report}");
}

#[test]
fn memory_first_touched_by_workers_is_on_the_gpus_node_and_host_policy_is_untouched() {
    let guest = require!(two_nodes());
    let run = guest.ok("placement");
    workers_pages_all_on(run, 1);
    // The host threads' memory policy is what it was (MPOL_DEFAULT, 0), before and after
    // configure; their masks are checked above. The scope's caller is the one exception (the
    // next test).
    host_threads_keep_the_default_policy(run);
    // H ran on all four CPUs: its pages lie where it ran, none failed.
    let (host, failed) = run.pages("host");
    assert_eq!(failed, 0);
    assert_eq!(host.values().sum::<usize>(), 1024, "{host:?}");
}

/// The scope's caller keeps its host mask; while its scope is open it prefers the workers' node
/// (MPOL_PREFERRED, mode 1, node mask 2: node 1), and has the default again once it ended. A
/// caller under `numactl --membind=0` (MPOL_BIND, 2) keeps its own policy throughout.
#[test]
fn a_scopes_caller_prefers_the_gpus_node_while_the_scope_is_open_unless_it_has_a_policy() {
    let guest = require!(two_nodes());
    let words = |run: &Scenario, phase: &str| -> String {
        run.lines("POLICY main ")
            .into_iter()
            .find(|w| w[0] == phase)
            .map(|w| w[1..].join(" "))
            .unwrap_or_else(|| panic!("no POLICY main {phase}:\n{}", run.text()))
    };
    for name in ["placement", "placement_2", "placement_3"] {
        let run = guest.ok(name);
        assert_eq!(words(run, "scope"), "1 2", "{name}");
        assert_eq!(words(run, "after_scope"), "0 0", "{name}");
    }
    let bound = guest.ok("placement_membind");
    assert_eq!(words(bound, "scope"), "2 1");
    assert_eq!(words(bound, "after_scope"), "2 1");
    assert!(
        guest
            .ok("placement")
            .stderr()
            .contains("prefers NUMA node 1, the workers' node, until the scope ends"),
        "{}",
        guest.ok("placement").stderr()
    );
}

/// `tllm-affinity ps` of a live configured process shows its memory per node: the worker's and
/// its child's buffers (4 MiB each, first touched on node 1's CPUs) on node 1; from numa_maps
/// for a process among others, from its cgroup's memory.numa_stat when it is alone there.
#[test]
fn ps_shows_the_workers_memory_on_the_gpus_node() {
    let guest = require!(two_nodes());
    for (name, source) in [
        ("ps_numa_maps", "numa_maps"),
        ("ps_numa_stat", "memory.numa_stat"),
    ] {
        guest.ok(name);
        let ps = guest.ok(&format!("{name}_ps")).json();
        let memory = &ps["memory"];
        println!("{name}: {memory}");
        assert!(
            memory["source"]
                .as_str()
                .is_some_and(|s| s.contains(source)),
            "{name}: {memory}"
        );
        let node1 = memory["bytes_per_node"]["1"].as_u64().unwrap_or(0);
        assert!(node1 >= 8 << 20, "{name}: {memory}");
        ps_shows_a_worker_on(&ps, NODE1);
    }
}

/// The host view on the real two-node kernel: a process's memory per node in its row, and the
/// flag for memory mostly off its workers' node when `numactl --membind=0` bound its memory to
/// node 0 while its workers are on node 1 (where the library never moves it: a policy of its own).
#[test]
fn the_host_view_flags_memory_bound_off_the_workers_node() {
    let guest = require!(two_nodes());
    guest.ok("host_view");
    let pid: u64 = guest.ok("host_view_pid").out[0].trim().parse().unwrap();
    let view = guest.ok("host_view_ps").json();
    let text = guest.ok("host_view_text").text();
    println!("{text}");
    let row = row(&view, "processes", "pid", pid);
    assert_eq!(row["worker_cpus"], NODE1, "{row:#}");
    let bytes = |node: &str| row["memory"]["bytes_per_node"][node].as_u64().unwrap_or(0);
    // The four 4 MiB buffers it touched before HOLD, all bound to node 0.
    assert!(bytes("0") >= 16 << 20, "{row:#}");
    assert!(bytes("1") * 2 < bytes("0"), "{row:#}");
    let flagged = view["flags"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f["kind"] == "memory-off-node" && f["pids"] == serde_json::json!([pid]));
    assert!(flagged, "{view:#}");
    let line =
        format!("flag: memory of {pid} lies mostly off its workers' node 1 (CPUs {NODE1}): ");
    assert!(text.lines().any(|l| l.starts_with(&line)), "{line}\n{text}");
}

/// The two cases where pinning threads (not the process) can lose to a process-wide pin on
/// memory, measured and printed, not asserted: memory the main thread touched before
/// `configure`, and memory the scope's caller (which keeps its full mask) touches while its
/// worker scope is open.
#[test]
fn memory_touched_before_configure_and_by_a_scopes_caller_is_measured() {
    let guest = require!(two_nodes());
    println!("free memory per node before: {:?}", guest.ok("meminfo").out);
    for name in ["placement", "placement_2", "placement_3"] {
        println!("MEASURED run {name}:");
        measured(guest.ok(name));
    }
}

/// One run's pages per node for each buffer, with the CPU its toucher was on.
fn measured(run: &Scenario) {
    for (buffer, what) in [
        ("early", "touched by main before configure"),
        ("host", "touched by host thread H after configure"),
        ("worker", "touched by worker W"),
        ("child", "touched by C, born a worker"),
        (
            "scope",
            "touched by the scope's caller while the scope is open",
        ),
        ("scoped", "touched by S, born a worker inside the scope"),
    ] {
        let (nodes, failed) = run.pages(buffer);
        assert_eq!(failed, 0, "{buffer}");
        let per_node: Vec<String> = (0..2)
            .map(|n| format!("node {n}: {}", nodes.get(&n).unwrap_or(&0)))
            .collect();
        let cpus = run
            .lines("PAGES ")
            .into_iter()
            .find(|w| w[0] == buffer)
            .and_then(|w| {
                w.iter()
                    .find_map(|x| x.strip_prefix("cpu=").map(str::to_string))
            })
            .unwrap_or_default();
        println!(
            "MEASURED {buffer:>7} ({what}, on CPU {cpus}): {} pages of 4 KiB",
            per_node.join(", ")
        );
    }
}

#[test]
fn topo_plan_and_configure_agree_on_the_guests_gpu() {
    let guest = require!(two_nodes());
    let configured = guest.ok("placement").mask("configured", "W").0;
    let topo = guest.ok("topo").json();
    let plan = guest.ok("plan").json();
    println!("topo nodes: {}", topo["nodes"]);
    assert_eq!(topo["online"], ALL4, "{topo}");
    let nodes = topo["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2, "{topo}");
    assert_eq!(nodes[1]["cpus"], NODE1, "{topo}");
    let device = &topo["visible"]["devices"][0];
    assert_eq!(device["address"], GUEST_GPU, "{topo}");
    assert_eq!(plan["gpu"]["address"], GUEST_GPU, "{plan}");
    assert_eq!(plan["gpu"]["numa_node"], 1, "{plan}");
    assert_eq!(plan["gpu"]["source"], "NVML", "{plan}");
    topo_plan_and_configure_agree(device, &plan, &configured, NODE1);
}

#[test]
fn a_cgroup_v2_cpuset_narrower_than_the_machine_is_not_a_constraint() {
    let guest = require!(two_nodes());
    let run = guest.ok("cpuset");
    println!("{}", run.text());
    assert_eq!(run.mask("configured", "main").0, "1-3");
    assert_eq!(run.mask("configured", "H").0, "1-3");
    assert_eq!(run.mask("configured", "W").0, NODE1, "{}", run.stderr());
    assert_eq!(run.mask("released", "W").0, "1-3");
    let report = run.report();
    assert_eq!(report["cpuset"], "1-3", "{report}");
    assert_eq!(report["constrained"], false, "{report}");
    assert!(
        !run.stderr().contains("constrained CPU affinity"),
        "{}",
        run.stderr()
    );
    let plan = guest.ok("cpuset_plan").json();
    assert_eq!(plan["cpuset"], "1-3", "{plan}");
    assert_eq!(plan["worker"]["constrained"], false, "{plan}");
    assert_eq!(plan["worker"]["cpus"], NODE1, "{plan}");
}

#[test]
fn taskset_inside_the_cgroup_cpuset_is_a_constraint() {
    let guest = require!(two_nodes());
    let run = guest.ok("cpuset_taskset");
    println!("{}\n{}", run.text(), run.stderr());
    assert_eq!(run.mask("configured", "main").0, "1-2");
    assert_eq!(run.mask("configured", "H").0, "1-2");
    let report = run.report();
    assert_eq!(report["mask_at_load"], "1-2", "{report}");
    assert_eq!(report["cpuset"], "1-3", "{report}");
    assert_eq!(report["constrained"], true, "{report}");
    assert!(
        run.stderr().contains("has constrained CPU affinity"),
        "{}",
        run.stderr()
    );
    // Constrained, and TLLM_NUMA_AWARE_WORKER_AFFINITY unset: the policy removes the
    // constraint for workers (the cpuset's CPUs), as upstream does, and says so.
    assert!(
        run.stderr().contains("Removing CPU affinity constraints"),
        "{}",
        run.stderr()
    );
    assert_eq!(run.mask("configured", "W").0, "1-3");
    assert_eq!(report["worker_mask"], "1-3", "{report}");
    assert_eq!(
        run.mask("released", "W").0,
        "1-2",
        "restored to the taskset"
    );
}

// ---- The seed deployments, unmodified, through `tllm-affinity run` on the real kernel ----

/// A deployment scenario's phases (tests/guest/drive.py's `PHASE <name> <thread>=<tid>:<role>:
/// <mask>` lines), as [`Phase`]s, so the fast tier's checks apply.
fn guest_phases(run: &Scenario) -> Vec<Phase> {
    run.lines("PHASE ")
        .into_iter()
        .map(|words| {
            let threads = words[1..]
                .iter()
                .filter_map(|w| {
                    let (thread, rest) = w.split_once('=')?;
                    let mut parts = rest.splitn(3, ':');
                    let tid = parts.next()?.parse().ok()?;
                    let role = parts.next()?.parse().ok()?;
                    let mask = CpuMask::parse_list(parts.next()?).ok()?;
                    Some((thread.to_string(), ThreadSeen { tid, role, mask }))
                })
                .collect();
            Phase {
                name: words[0].clone(),
                threads,
            }
        })
        .collect()
}

/// Checks a deployment: `want[i]` is phase i's worker threads' mask (the GPU's node, or the
/// launch mask once restored); every other thread is a host on the launch mask throughout.
fn deployment(guest: &Booted, name: &str, workers: &[&str], want: &[&str]) -> Vec<Phase> {
    let run = guest.ok(name);
    let phases = guest_phases(run);
    assert_eq!(
        phases.len(),
        want.len(),
        "{name}: phases\n{}\n{}",
        run.text(),
        run.stderr()
    );
    for (phase, worker_mask) in phases.iter().zip(want) {
        let mut row: Vec<String> = phase
            .threads
            .iter()
            .map(|(n, t)| format!("{n}={}:{}", t.mask.to_list(), t.role))
            .collect();
        row.sort();
        println!("{name} {}: {}", phase.name, row.join(" "));
        placed(phase, workers, worker_mask, ALL4, name);
    }
    phases
}

/// Where each seed deployment's worker threads are in its five phases (before, during,
/// serving, shutdown, after): the GPU's node while the worker lives, the launch mask otherwise.
const WORKER_PHASES: [&str; 5] = [ALL4, NODE1, NODE1, ALL4, ALL4];

#[test]
fn tp1_under_an_http_server_pins_only_the_worker_on_the_real_gpu_node() {
    let guest = require!(deployments());
    deployment(guest, "seed_tp1", &TP1_WORKERS, &WORKER_PHASES);
    let run = guest.ok("seed_tp1");
    assert_eq!(run.lines("GET ").len(), 2, "{}", run.text());
}

#[test]
fn mpi_session_rank0_pins_only_the_worker_pool_thread_on_the_real_gpu_node() {
    let guest = require!(deployments());
    deployment(guest, "seed_mpi_session", &SESSION_WORKERS, &WORKER_PHASES);
}

#[test]
fn visualgen_rank0_spares_the_coordinator_and_restores_at_the_clients_shutdown() {
    let guest = require!(deployments());
    let phases = deployment(guest, "seed_visualgen", &VISUALGEN_WORKERS, &WORKER_PHASES);
    assert_eq!(phases[1].mask("visual_gen_coordinator"), ALL4);
}

#[test]
fn the_leaders_rank0_and_progress_threads_are_on_the_real_gpu_node() {
    let guest = require!(deployments());
    deployment(guest, "seed_leader", &LEADER_WORKERS, &WORKER_PHASES);
}

// ---- Topology B: two sockets x two cores x two SMT threads, CPU 7 offline ----

fn smt_machine() -> Machine {
    Machine {
        name: "two sockets x two cores x two SMT threads",
        cpus: 8,
        memory: "1G",
        numa: &["512M,cpus=0-3", "512M,cpus=4-7"],
        qemu_opts: format!(
            "-smp 8,sockets=2,cores=2,threads=2 -cpu Skylake-Server {}",
            test_device_on(1)
        ),
        script: SMT_SCRIPT,
        program: "step_result_hotplug",
        ..two_nodes_machine()
    }
}

const SMT_SCRIPT: &str = "smt_offline.sh";

/// The SMT machine's sockets as the Grace nodes of a GB200 tray (tests/programs/tray_servers.py).
const TRAY_NODES: [&str; 2] = ["0-3", "4-7"];

/// The tray written under the build directory, which the guest sees (its /tmp is its own).
fn tray_over_the_smt_sockets() -> std::path::PathBuf {
    let dir = target_dir().join("guest-tray");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    tray::write_tray(&dir, &mask(TRAY_NODES[0]), &mask(TRAY_NODES[1]));
    dir
}

/// The tree of four GPUs, two per socket, each socket two last-level-cache domains (halves of
/// its CPUs), written under the build directory (tests/common/slices.rs).
fn slice_tree_over_the_smt_sockets() -> std::path::PathBuf {
    let dir = target_dir().join("guest-slices");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    slices::write_slice_tree(&dir, &SLICE_CPUS);
    dir
}

/// The guest's eight CPUs, as the slice tree describes them.
const SLICE_CPUS: [usize; 8] = [0, 1, 2, 3, 4, 5, 6, 7];

booted_once!(smt, smt_machine);

/// The kernel's sibling list of each CPU, read in the guest before CPU 7 went offline.
fn siblings(guest: &Booted) -> BTreeMap<usize, CpuMask> {
    guest
        .ok("siblings")
        .out
        .iter()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[0]["cpu".len()..].parse().unwrap(), mask(w[1]))
        })
        .collect()
}

#[test]
fn step_and_result_threads_are_on_distinct_physical_cores_from_the_kernels_siblings() {
    let guest = require!(smt());
    let kernel = siblings(guest);
    println!("siblings: {kernel:?}");
    assert_eq!(kernel[&4], mask("4-5"), "SMT siblings from the kernel");
    let run = guest.ok("hotplug");
    println!("{}", run.text());
    let pins = run.lines("PIN ");
    let (step_rc, result_rc): (i32, i32) =
        (pins[0][1].parse().unwrap(), pins[0][3].parse().unwrap());
    assert!(
        step_rc > 0 && result_rc == 1,
        "{:?}\n{}",
        pins,
        run.stderr()
    );
    let step = mask(&run.mask("configured", "ST").0);
    let result = mask(&run.mask("configured", "RT").0);
    assert_eq!(
        step, kernel[&4],
        "the step thread on CPU 4's core, both siblings"
    );
    assert_eq!(result.count(), 1, "the result thread on one CPU");
    let result_cpu = result.first().unwrap();
    assert_ne!(
        kernel[&result_cpu], kernel[&4],
        "the result thread on another physical core"
    );
    assert!(!result.contains(7), "never the offline CPU");
    let plan = guest.ok("plan").json();
    assert_eq!(plan["placement"]["step_cpus"], "4-5", "{plan}");
    assert_eq!(plan["placement"]["result_cpu"], result_cpu, "{plan}");
}

/// Four servers on a GB200 tray over the guest's eight CPUs, one per GPU, each under
/// `tllm-affinity run --step-core auto` (tests/common/tray.rs): each on its GPU's Grace node,
/// every step and result thread pinned where `plan` says and no CPU pinned for two servers, the
/// host view with no flag among them; then every thread of each server pinned to its whole node
/// as upstream does: the step threads of each node's two servers flagged.
#[test]
fn four_servers_on_a_tray_get_distinct_step_cores_and_upstreams_pin_is_flagged() {
    let guest = require!(smt());
    let run = guest.ok("tray");
    let pinned = tray::check_tray_servers(&run.text(), &mask(TRAY_NODES[0]), &mask(TRAY_NODES[1]));
    assert!(pinned, "`auto` pinned no step thread:\n{}", run.text());
}

/// Four engines on two nodes of four CPUs, one process per GPU started at once, each the upstream
/// stand-in under `tllm-affinity run` with upstream's `TLLM_EXECUTOR_LOOP_PIN=1` (offset 0, one
/// CPU). With `--slice gpu` every GPU's workers are on its own cache domain, which no other GPU's
/// workers share, host threads keep every CPU, `plan` agrees, the host view flags no shared CPU and
/// `metrics` gives each lease's slice; the executor loop stays inside its slice (upstream's CPU
/// where it lies there, the slice's step core where it would leave it, each said in the log).
/// Without it every worker has its whole node, and upstream's loop pin stands.
#[test]
fn engines_side_by_side_get_disjoint_slices_and_keep_the_loop_pin_inside() {
    let guest = require!(smt());
    let run = guest.ok("slices");
    slices::check_slice_servers(&run.text(), &SLICE_CPUS);
}

/// Eight CPUs for `scripts/bench --slices` (its host is written: one node over them all, four
/// GPUs): the real kernel's scheduler places the four engines' busy workers.
fn slices_bench_machine() -> Machine {
    Machine {
        name: "eight CPUs, four engines side by side",
        cpus: 8,
        memory: "1G",
        numa: &["512M,cpus=0-3", "512M,cpus=4-7"],
        script: SLICES_BENCH_SCRIPT,
        ..two_nodes_machine()
    }
}

const SLICES_BENCH_SCRIPT: &str = "slices_bench.sh";

booted_once!(slices_bench, slices_bench_machine);

/// `scripts/bench --slices` in the guest of eight CPUs (`GUEST_BENCH_ROUNDS` interleaved rounds,
/// default 3): four engines of three busy workers each, side by side, every worker on the whole
/// node (each engine's mask 0-7) against each GPU's workers on its own slice (0-1, 2-3, 4-5,
/// 6-7), the masks read from the real kernel. The figures are printed, not judged: QEMU's TCG
/// runs the eight CPUs on this machine's two, and emulates no cache.
#[test]
fn engines_on_their_slices_and_on_the_whole_node_are_measured_side_by_side() {
    let guest = require!(slices_bench());
    let run = guest.ok("bench");
    let text = run.text();
    println!("{text}");
    let row = |mode: &str| {
        run.out
            .iter()
            .find(|l| l.starts_with(&format!("| {mode}")))
            .unwrap_or_else(|| panic!("no row for {mode}:\n{text}"))
    };
    assert!(
        row("node masks").contains("| 0:[0-7] 1:[0-7] 2:[0-7] 3:[0-7] |"),
        "{text}"
    );
    assert!(
        row("slices").contains("| 0:[0-1] 1:[2-3] 2:[4-5] 3:[6-7] |"),
        "{text}"
    );
}

#[test]
fn the_offline_cpu_is_outside_every_set_the_library_computes() {
    let guest = require!(smt());
    assert_eq!(guest.ok("offline").out, ["0-6"]);
    let run = guest.ok("hotplug");
    let report = run.report();
    println!("report while CPU 7 is offline: {report}");
    let worker = mask(report["worker_mask"].as_str().unwrap());
    assert_eq!(worker, mask("4-6"), "node 1's online CPUs: {report}");
    for scenario in ["plan", "auto"] {
        let plan = guest.ok(scenario).json();
        println!(
            "plan ({scenario}): worker {} placement {}",
            plan["worker"], plan["placement"]
        );
        assert_eq!(plan["worker"]["cpus"], "4-6", "{scenario}: {plan}");
        assert!(
            !mask(plan["allowed"].as_str().unwrap()).contains(7),
            "{plan}"
        );
        if let Some(step) = plan["placement"]["step_cpus"].as_str() {
            assert!(!mask(step).contains(7), "{scenario}: {plan}");
        }
        assert_ne!(plan["placement"]["result_cpu"], 7, "{scenario}: {plan}");
    }
}

/// CPU 7 was offline from before the process started until after the release. Untouched
/// threads get it back when it comes online. On this kernel a thread whose mask was written with
/// `sched_setaffinity` while CPU 7 was offline does not, whatever the mask named (measured:
/// `taskset -c 0-3` while CPU 3 is offline ends on 0-2 for good; the kernel keeps the mask it
/// applied as the user's request), and a restore is such a write. So restored threads must end
/// exactly where T does, a host thread that wrote its own mask at the same time without the
/// library, and on the same online CPUs as untouched threads before CPU 7 returns. Printed:
/// whether the restored threads got CPU 7 back as untouched threads did.
#[test]
fn restored_threads_get_the_cpu_back_as_the_kernel_gives_it_to_any_written_mask() {
    let guest = require!(smt());
    assert_eq!(guest.ok("back_online").out, ["0-7"]);
    let run = guest.ok("hotplug");
    println!("{}", run.text());
    let untouched = run.mask("released", "H").0;
    assert_eq!(untouched, "0-6", "CPU 7 offline while released");
    for thread in ["main", "T", "W", "ST", "RT"] {
        assert_eq!(
            run.mask("released", thread).0,
            untouched,
            "{thread} released, as the untouched thread H"
        );
    }
    let untouched = run.mask("online", "H").0;
    let written = run.mask("online", "T").0;
    assert_eq!(untouched, "0-7", "an untouched thread gets CPU 7 back");
    assert_eq!(run.mask("online", "main").0, untouched);
    assert_eq!(run.mask("online", "N").0, untouched, "a thread born after");
    for thread in ["W", "ST", "RT"] {
        assert_eq!(
            run.mask("online", thread).0,
            written,
            "{thread} once CPU 7 is online, as T, whose own write the kernel keeps"
        );
    }
    println!(
        "MEASURED CPU 7 back online: untouched threads [{untouched}], restored threads and a \
         thread that wrote its own mask while CPU 7 was offline [{written}]"
    );
}

// ---- Topology D: four one-CPU nodes, a memory-only node, a device with no node ----

fn four_nodes_machine() -> Machine {
    // Every pair at 20 but node 4 (memory only), which is nearest to node 3.
    let mut distances = Vec::new();
    for a in 0..5 {
        for b in a + 1..5 {
            let d = if (a, b) == (3, 4) { 12 } else { 20 };
            distances.push(format!("{a},{b}={d}"));
        }
    }
    Machine {
        name: "four one-CPU nodes and a memory-only node",
        cpus: 4,
        memory: "2304M",
        numa: &[
            "512M,cpus=0",
            "512M,cpus=1",
            "512M,cpus=2",
            "512M,cpus=3",
            "256M",
        ],
        qemu_opts: format!(
            "{} -device pci-testdev,bus=pcie.0,addr=0x10",
            test_device_on(4)
        ),
        distances,
        nodes: "0-4",
        script: "four_nodes.sh",
        program: "numa_placement",
        deployments: false,
    }
}

booted_once!(four_nodes, four_nodes_machine);

#[test]
fn four_nodes_a_memory_only_node_and_a_device_without_a_node_are_the_kernels() {
    let guest = require!(four_nodes());
    let nodes = guest.ok("nodes");
    println!("{}", nodes.text());
    assert_eq!(nodes.out[0], "has_cpu=0-3");
    assert_eq!(nodes.out[1], "has_memory=0-4");
    assert_eq!(nodes.out[2], "node4_distance=20 20 20 12 10");
    assert_eq!(guest.ok("pci").out, ["0000:81:00.0 4", "0000:00:10.0 -1"]);
    let topo = guest.ok("topo").json();
    let nodes = topo["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 5, "{topo}");
    assert_eq!(nodes[4]["cpus"], "", "{topo}");
    assert_eq!(nodes[4]["has_memory"], true, "{topo}");
}

/// GPU 1 sits on node 4, which has memory and no CPU: its workers go to node 3, the nearest
/// node with CPUs by the kernel's distances, and their first-touched memory too.
#[test]
fn a_gpu_on_a_memory_only_node_gets_the_nearest_node_with_cpus() {
    let guest = require!(four_nodes());
    let run = guest.ok("placement_gpu1");
    println!("{}\n{}", run.text(), run.stderr());
    assert_eq!(run.mask("configured", "W"), ("3".to_string(), Some(1)));
    assert_eq!(run.mask("configured", "C"), ("3".to_string(), Some(1)));
    assert_eq!(run.mask("configured", "H").0, ALL4);
    assert_eq!(run.mask("released", "W").0, ALL4);
    for buffer in ["worker", "child"] {
        let (nodes, failed) = run.pages(buffer);
        assert_eq!(failed, 0);
        assert_eq!(
            nodes.keys().copied().collect::<Vec<_>>(),
            [3],
            "{buffer}: {nodes:?}"
        );
    }
    assert!(
        run.stderr().contains("which has no CPUs: using node 3"),
        "{}",
        run.stderr()
    );
    let plan = guest.ok("plan_gpu1").json();
    assert_eq!(plan["gpu"]["address"], GUEST_GPU, "{plan}");
    assert_eq!(plan["gpu"]["numa_node"], 4, "{plan}");
    assert_eq!(plan["worker"]["cpus"], "3", "{plan}");
    let topo = guest.ok("topo").json();
    assert_eq!(topo["visible"]["devices"][1]["local_cpus"], "3", "{topo}");
}

/// GPU 0 is on the root bus, where the kernel knows no node (`numa_node` -1): every online CPU,
/// with a line saying why; plan and topo say the same.
#[test]
fn a_gpu_the_kernel_knows_no_node_for_gets_every_cpu_with_a_line() {
    let guest = require!(four_nodes());
    let run = guest.ok("placement_gpu0");
    println!("{}\n{}", run.text(), run.stderr());
    assert_eq!(run.mask("configured", "W"), (ALL4.to_string(), Some(1)));
    assert!(
        run.stderr()
            .contains("GPU 0000:00:10.0 has no NUMA node: using every online CPU"),
        "{}",
        run.stderr()
    );
    let plan = guest.ok("plan_gpu0").json();
    assert_eq!(plan["gpu"]["address"], "0000:00:10.0", "{plan}");
    assert_eq!(plan["gpu"]["numa_node"], serde_json::Value::Null, "{plan}");
    assert_eq!(plan["worker"]["cpus"], ALL4, "{plan}");
    let topo = guest.ok("topo").json();
    assert_eq!(topo["visible"]["devices"][0]["local_cpus"], ALL4, "{topo}");
}

// ---- Topology E: two nodes of two CPUs, a device on each; memory follows a dedicated worker ----

/// Topology A with a second device, on node 0: GPU 0 (`0000:41:00.0`) on node 0, GPU 1
/// (`0000:81:00.0`) on node 1, so a dedicated worker can be moved from one to the other.
fn memory_machine() -> Machine {
    Machine {
        name: "two nodes x two CPUs, a device on each",
        qemu_opts: format!(
            "-device pxb-pcie,id=n0,bus_nr=0x40,numa_node=0,bus=pcie.0 \
             -device pcie-root-port,id=n0p,bus=n0,chassis=8 -device pci-testdev,bus=n0p {}",
            test_device_on(1)
        ),
        script: "memory.sh",
        program: "memory_follows",
        deployments: true,
        ..two_nodes_machine()
    }
}

booted_once!(memory, memory_machine);

/// The same machine with 2 GiB a node, booted apart for the move's cost: room for a 1 GiB buffer
/// on node 0 beside what the guest holds there.
fn memory_bench_machine() -> Machine {
    Machine {
        name: "two nodes x two CPUs, a device on each, 2 GiB a node",
        memory: "4G",
        numa: &["2G,cpus=0-1", "2G,cpus=2-3"],
        script: MEMORY_BENCH_SCRIPT,
        deployments: false,
        ..memory_machine()
    }
}

fn memory_bench() -> Result<&'static Booted, String> {
    static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
    booted(&BOOT, || {
        // scripts/bench's extra rounds, and its previous revision's run in each, take longer.
        let (rounds, against) = bench_rounds_and_against();
        let per_round = if against.is_some() { 240 } else { 120 };
        let extra =
            rounds.saturating_sub(3) as u64 * per_round + against.map_or(0, |_| 3 * per_round / 2);
        boot_machine(
            &memory_bench_machine(),
            MEMORY_BENCH_LIMIT + Duration::from_secs(extra),
        )
    })
}

/// The 64 MiB buffer's 4 KiB pages.
const BUFFER_PAGES: usize = 16384;

/// `PAGES <phase> ...` of tests/programs/memory_follows.c: pages per node; no page may fail.
fn buffer_pages(run: &Scenario, phase: &str) -> BTreeMap<usize, usize> {
    let (nodes, failed) = run.pages(phase);
    assert_eq!(
        failed,
        0,
        "{phase}: pages move_pages could not find:\n{}",
        run.text()
    );
    nodes
}

/// At least 95 % of the buffer on `node`.
fn mostly_on(nodes: &BTreeMap<usize, usize>, node: usize, pages: usize) -> bool {
    nodes.get(&node).copied().unwrap_or(0) * 100 >= pages * 95
}

#[test]
fn the_guest_has_a_device_on_each_node() {
    let guest = require!(memory());
    let devices = guest.ok("devices");
    assert_eq!(devices.out[..2], ["0", "1"], "{}", devices.text());
}

/// A dedicated worker that touched 64 MiB on node 0 before its configure for the GPU on node 1:
/// `TLLM_AFFINITY_PROCESS_ROLE=worker` following `CUDA_VISIBLE_DEVICES` from GPU 0 to GPU 1, a
/// configure on the main thread, and under `tllm-affinity run` alone upstream's VisualGen entry
/// function on the main thread of its own process and an MPI worker rank's `worker_main` (a rank
/// of the real `mpirun`). Afterwards at least 95 % lies on node 1, one info line and the report
/// say so.
#[test]
fn a_dedicated_workers_memory_follows_it_to_the_gpus_node() {
    let guest = require!(memory());
    // Upstream's routes, Python programs that print no report.
    let upstream = ["visualgen_main", "worker_main_rank"];
    for name in ["role_retarget", "main_configure"].iter().chain(&upstream) {
        let name = *name;
        let run = guest.ok(name);
        let (before, after) = (buffer_pages(run, "before"), buffer_pages(run, "after"));
        println!("{name}: pages per node before {before:?}, after {after:?}");
        assert!(
            mostly_on(&before, 0, BUFFER_PAGES),
            "{name}: before {before:?}"
        );
        assert!(
            mostly_on(&after, 1, BUFFER_PAGES),
            "{name}: after {after:?}\n{}",
            run.stderr()
        );
        // The worker configured at load on GPU 0 moved what it had to node 0 first.
        let line = run
            .err
            .iter()
            .find(|l| l.contains("dedicated worker: moved") && l.contains("to node 1 in"))
            .unwrap_or_else(|| panic!("{name}: no line of the move:\n{}", run.stderr()));
        assert!(line.contains("from NUMA node 0 to node 1"), "{line}");
        if !upstream.contains(&name) {
            let moved = &run.report()["memory_moved"];
            assert_eq!(moved["node"], 1, "{name}: {moved}");
            assert!(
                moved["bytes_moved"].as_u64().unwrap() >= (BUFFER_PAGES as u64 * 4096) * 95 / 100,
                "{name}: {moved}"
            );
        }
    }
}

/// What stays where it lies: a worker thread of a shared process (a configure on another thread
/// than main; upstream's entry function on a thread of a process that goes on serving),
/// `TLLM_AFFINITY_MOVE_MEMORY=0`, and a process under `numactl --membind` or `--preferred`.
#[test]
fn a_shared_process_a_policy_of_its_own_and_move_memory_0_leave_memory_where_it_lies() {
    let guest = require!(memory());
    for name in [
        "thread_configure",
        "visualgen_thread",
        "move_off",
        "membind",
        "preferred",
    ] {
        let run = guest.ok(name);
        let (before, after) = (buffer_pages(run, "before"), buffer_pages(run, "after"));
        println!("{name}: pages per node before {before:?}, after {after:?}");
        assert!(
            mostly_on(&before, 0, BUFFER_PAGES),
            "{name}: before {before:?}"
        );
        assert_eq!(after, before, "{name}: the pages moved\n{}", run.stderr());
        assert!(
            !run.stderr().contains("dedicated worker: moved"),
            "{name}:\n{}",
            run.stderr()
        );
        if name == "membind" || name == "preferred" {
            assert!(
                run.stderr().contains("a memory policy of its own"),
                "{name}:\n{}",
                run.stderr()
            );
        }
    }
    // The worker thread and the dedicated worker with MOVE_MEMORY=0 were still placed.
    for name in ["thread_configure", "move_off"] {
        let report = guest.ok(name).report();
        assert_eq!(report["worker_mask"], NODE1, "{name}: {report}");
        assert!(report.get("memory_moved").is_none(), "{name}: {report}");
    }
}

/// Half of the buffer mlock'd: those pages stay on node 0 and are counted as not moved; the other
/// half moves.
#[test]
fn locked_pages_stay_and_are_counted_the_rest_moves() {
    let guest = require!(memory());
    let run = guest.ok("mlock");
    let (before, after) = (buffer_pages(run, "before"), buffer_pages(run, "after"));
    println!("mlock: pages per node before {before:?}, after {after:?}");
    let half = BUFFER_PAGES / 2;
    assert!(mostly_on(&before, 0, BUFFER_PAGES), "before {before:?}");
    assert!(
        after.get(&0).copied().unwrap_or(0) >= half,
        "after {after:?}"
    );
    assert!(
        mostly_on(&after, 1, half),
        "after {after:?}\n{}",
        run.stderr()
    );
    let moved = &run.report()["memory_moved"];
    assert!(
        moved["bytes_not_moved"].as_u64().unwrap() >= half as u64 * 4096,
        "{moved}"
    );
    assert!(
        moved["bytes_moved"].as_u64().unwrap() >= (half as u64 * 4096) * 95 / 100,
        "{moved}"
    );
}

/// The first number after `prefix` (`WINDOW 0 12` → 0).
fn number(run: &Scenario, prefix: &str, at: usize) -> i64 {
    run.lines(prefix)
        .first()
        .and_then(|w| w.get(at))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {prefix}:\n{}\n{}", run.text(), run.stderr()))
}

/// The info line of the move.
fn move_line(run: &Scenario) -> &str {
    run.err
        .iter()
        .find(|l| l.contains("dedicated worker: moved"))
        .unwrap_or_else(|| panic!("no line of the move:\n{}", run.stderr()))
}

/// Children a worker scope's caller starts during the scope start with the default memory
/// policy, not the caller's preference for the workers' node: `numactl --show` under
/// `subprocess`, `os.posix_spawn`, libc's `system` and `popen`, `get_mempolicy` in a bare `fork`
/// child, the same from a thread the caller created in the scope (which itself prefers the
/// node, as the kernel gave it its creator's policy), and a dedicated
/// worker (on node 0's CPUs) whose first-touched memory lies on node 0, then follows it to GPU 1's
/// node 1 with no "policy of its own". The caller prefers node 1 during the scope, and has the
/// default policy after it.
#[test]
fn children_of_a_scopes_caller_start_with_the_default_policy() {
    let guest = require!(memory());
    let run = guest.ok("children");
    let text = format!("{}\n{}", run.text(), run.stderr());
    println!("{text}");
    let words = |prefix: &str| run.lines(prefix).concat().join(" ");
    // MPOL_PREFERRED (1) on node 1 in the scope; MPOL_DEFAULT (0) after it.
    assert_eq!(words("CALLER during "), "1 0x2", "{text}");
    assert_eq!(words("CALLER after "), "0 0x0", "{text}");
    // numactl --show: `policy: default`, `preferred node: current` and no node after
    // `preferred:` (a child that inherited the preference says `preferred`, `1` and `1`).
    for child in [
        "SUBPROCESS ",
        "SPAWN ",
        "SYSTEM ",
        "POPEN ",
        "THREAD_SUBPROCESS ",
    ] {
        let shown: Vec<String> = run.lines(child).into_iter().map(|l| l.join(" ")).collect();
        for line in ["policy: default", "preferred node: current", "preferred:"] {
            assert!(shown.contains(&line.to_string()), "{child}{line}: {text}");
        }
    }
    assert_eq!(words("FORK "), "0 0x0", "{text}");
    // A thread created in the scope prefers the workers' node (the kernel copied the policy),
    // and what it starts does not.
    assert_eq!(words("THREAD self "), "1 0x2", "{text}");
    assert_eq!(words("THREAD_FORK "), "0 0x0", "{text}");
    let worker: Vec<String> = run
        .lines("WORKER ")
        .into_iter()
        .map(|l| l.join(" "))
        .collect();
    assert!(worker.contains(&"exit 0".to_string()), "{text}");
    assert!(
        !worker.iter().any(|l| l.contains("policy of its own")),
        "{text}"
    );
    let pages = |phase: &str| -> BTreeMap<usize, usize> {
        let line = worker
            .iter()
            .find(|l| l.starts_with(&format!("PAGES {phase} ")))
            .unwrap_or_else(|| panic!("no PAGES {phase}: {text}"));
        line.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .filter_map(|(n, p)| Some((n.parse().ok()?, p.parse().ok()?)))
            .collect()
    };
    assert!(mostly_on(&pages("before"), 0, BUFFER_PAGES), "{text}");
    assert!(mostly_on(&pages("after"), 1, BUFFER_PAGES), "{text}");
}

/// A count of the move's line of refused pages, `move_pages refused <n> pages hidden by a
/// hinting fault (...), <n> shared, <n> busy; ...`: the number before `what` (` busy`,
/// ` pages hidden`); `None` without the line.
fn refused_count(run: &Scenario, what: &str) -> Option<u64> {
    let line = run.err.iter().find(|l| l.contains("move_pages refused"))?;
    let before = line.split(what).next()?;
    before.rsplit(' ').next()?.parse().ok()
}

/// Long-term pinned pages (io_uring fixed buffers) spread through a 256 MiB buffer on node 0, one
/// in every MiB and one in every 8 MiB: with a 64 MiB budget, 64 MiB moves (what `numa_maps` shows
/// of the buffer, and the report's count); with the default budget every page but the pinned ones
/// moves. The report's count is what moved, and the refused pages are counted busy: the pinned
/// ones the walk reached.
#[test]
fn pinned_pages_neither_spend_the_budget_nor_hide_the_pages_beside_them() {
    let guest = require!(memory());
    const PAGE: u64 = 4096;
    let pages_256 = 256 * 256;
    let mut failures = Vec::new();
    for every_kib in [1024u64, 8192] {
        let pinned_total = 256 * 1024 / every_kib;
        for budget in [true, false] {
            let name = format!("pinned_{every_kib}k{}", if budget { "_budget" } else { "" });
            let run = guest.ok(&name);
            assert_eq!(
                run.lines("PINNED ").concat(),
                [pinned_total.to_string()],
                "{name}"
            );
            let after = buffer_pages(run, "after");
            let moved_pages = after.get(&1).copied().unwrap_or(0) as u64;
            let report = &run.report()["memory_moved"];
            let reported = report["bytes_moved"].as_u64().unwrap_or(0);
            let busy = refused_count(run, " busy");
            println!(
                "{name}: after {after:?}; reported {reported}; busy {busy:?}; {}",
                move_line(run)
            );
            let Some(busy) = busy else {
                failures.push(format!(
                    "{name}: no line of refused pages:\n{}",
                    run.stderr()
                ));
                continue;
            };
            // The buffer's share of what moved; the process's other private pages (its stack,
            // heap, libc's data) are a few hundred KiB at most, and a few of them are busy too.
            let buffer_moved = moved_pages * PAGE;
            if reported < buffer_moved || reported > buffer_moved + (1 << 20) {
                failures.push(format!(
                    "{name}: reported {reported}, the buffer's pages moved {buffer_moved}"
                ));
            }
            let other_busy = 8;
            if budget {
                let cap = 64u64 << 20;
                // Within two pages of numa_maps' count: a page of another mapping may land
                // or leave meanwhile (a fault, the stack).
                if reported.abs_diff(cap) > 2 * PAGE {
                    failures.push(format!("{name}: {reported} moved for a budget of {cap}"));
                }
                // The walk went through about as much of the buffer as moved, and each pinned
                // page in it refused.
                let reached = buffer_moved / (every_kib << 10);
                if !(reached.saturating_sub(1)..=reached + other_busy).contains(&busy) {
                    failures.push(format!(
                        "{name}: {busy} busy where the walk reached about {reached} pinned pages"
                    ));
                }
            } else {
                if moved_pages != pages_256 - pinned_total {
                    failures.push(format!("{name}: {moved_pages} pages moved: {after:?}"));
                }
                if !(pinned_total..=pinned_total + other_busy).contains(&busy) {
                    failures.push(format!(
                        "{name}: {busy} busy for {pinned_total} pinned pages"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// As root (`CAP_SYS_NICE`, with which `migrate_pages(2)` moves pages other processes map), a
/// file's page cache on node 0 that another process maps `MAP_PRIVATE` and the worker maps too
/// stays on node 0 while the worker's own memory moves to node 1, beside a `PROT_NONE` region of
/// the worker's (present pages no read reaches, which stay too).
#[test]
fn as_root_a_file_another_process_maps_stays_while_the_workers_memory_moves() {
    let guest = require!(memory());
    let mapper = guest.ok("mapper");
    assert_eq!(mapper.lines("MAPPED "), [["2048"]], "{}", mapper.text());
    let run = guest.ok("file_shared");
    let text = format!("{}\n{}", run.text(), run.stderr());
    println!("{text}");
    let file_before = buffer_pages(run, "file_before");
    assert!(mostly_on(&file_before, 0, 2048), "{text}");
    assert_eq!(
        buffer_pages(run, "file_after"),
        file_before,
        "the shared file's pages stayed: {text}"
    );
    assert!(
        mostly_on(&buffer_pages(run, "after"), 1, BUFFER_PAGES),
        "{text}"
    );
}

/// A thread forking short-lived children in a loop while the move runs: every fork maps the
/// worker's private pages twice for an instant, and the move tries them again, so at least half
/// of the buffer moves in each of 10 runs.
#[test]
fn a_forking_thread_beside_the_move_does_not_keep_the_memory_where_it_was() {
    let guest = require!(memory());
    let names: Vec<String> = std::iter::once("window".to_string())
        .chain((2..=10).map(|i| format!("window_{i}")))
        .collect();
    for name in &names {
        let run = guest.ok(name);
        let after = buffer_pages(run, "after");
        println!("{name}: after {after:?}; {}", move_line(run));
        let on_target = after.get(&1).copied().unwrap_or(0);
        assert!(
            on_target * 2 >= BUFFER_PAGES,
            "{name}: {on_target} of {BUFFER_PAGES} pages moved: {after:?}\n{}",
            run.stderr()
        );
    }
}

/// No policy window: while the move runs, a thread allocating and touching memory in a loop and
/// asking the policy of its chunks and of the buffer never sees one, a thread forking in a loop
/// leaves no child with a mapping under a policy, and afterwards `numa_maps` shows none and the
/// configuring thread's own policy is the default again; nothing is killed (the scenario exits
/// 0).
#[test]
fn the_move_writes_no_policy_a_concurrent_allocator_or_a_fork_child_could_see() {
    let guest = require!(memory());
    let run = guest.ok("window");
    println!("window: {:?}", run.out);
    move_line(run);
    assert!(
        number(run, "WINDOW ", 1) > 0,
        "the allocator ran:\n{}",
        run.text()
    );
    assert!(number(run, "FORKS ", 1) > 0, "forks ran:\n{}", run.text());
    assert_eq!(
        number(run, "WINDOW ", 0),
        0,
        "policies seen during the move:\n{}",
        run.text()
    );
    assert_eq!(
        number(run, "FORKS ", 0),
        0,
        "fork children with a policy:\n{}",
        run.text()
    );
    assert_eq!(number(run, "POLICIES ", 0), 0, "{}", run.text());
    assert_eq!(
        number(run, "OWN_POLICY ", 0),
        0,
        "the configuring thread's own policy is the default again:\n{}",
        run.text()
    );
}

/// A shmem object mapped shared with a child that bound its second half to node 0: after the
/// move the child's policy is exactly as it set it (first half default, second half bind to
/// node 0), and none of the object's pages moved; the process's private buffer did.
#[test]
fn a_shared_shmem_mapping_keeps_its_policy_and_its_pages() {
    let guest = require!(memory());
    let run = guest.ok("shared_shm");
    let (before, after) = (
        buffer_pages(run, "shm_before"),
        buffer_pages(run, "shm_after"),
    );
    println!("shared_shm: shm pages before {before:?}, after {after:?}");
    assert_eq!(after, before, "the shared pages moved:\n{}", run.stderr());
    assert_eq!(
        run.lines("SHM_POLICY "),
        [["0", "2", "1"]],
        "the child's policy (first half, second half, its nodes):\n{}\n{}",
        run.text(),
        run.stderr()
    );
    assert!(!run.text().contains("SHM_CHILD"), "{}", run.text());
    let moved = buffer_pages(run, "after");
    assert!(mostly_on(&moved, 1, BUFFER_PAGES), "{moved:?}");
}

/// Transparent huge pages (`always`, a 68 MiB buffer 1 MiB past a huge page boundary, run 3 s
/// before configure so that NUMA balancing has marked some for a hinting fault, as it has a
/// loaded worker's): none is split (the kernel counts no split and the host maps as many huge
/// pages after), they lie on the target node, and the line counts them. The walk's reads take
/// the marked pages' hinting faults without the fault path moving them one by one: the kernel
/// counts fewer than one huge page's worth moved by hinting faults during configure (before,
/// the reads' faults moved the marked huge pages, each alone).
#[test]
fn transparent_huge_pages_move_whole() {
    let guest = require!(memory());
    let run = guest.ok("thp");
    let before = huge_pages_stay_whole(run);
    let marked: u64 = run
        .lines("MARKED ")
        .first()
        .and_then(|w| w.first()?.parse().ok())
        .unwrap_or_else(|| panic!("no MARKED:\n{}", run.text()));
    println!("thp: {marked} kB of huge pages left in smaps once NUMA balancing marked the rest");
    assert!(marked < before, "nothing marked: {marked} of {before} kB");
    let pages = buffer_pages(run, "after");
    println!("thp: AnonHugePages {before} kB before; pages {pages:?}");
    println!("thp: {}", move_line(run));
    let fault_moves = number(run, "FAULT_MOVES ", 0);
    println!("thp: {fault_moves} pages moved by hinting faults during configure");
    assert!(
        fault_moves < 512,
        "{fault_moves} pages moved by hinting faults:\n{}",
        run.stderr()
    );
    assert!(before >= 32 << 10, "huge pages before: {before} kB");
    assert!(mostly_on(&pages, 1, 68 << 8), "{pages:?}\n{}", run.stderr());
    let moved = run.report()["memory_moved"]["huge_pages_moved"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        moved * 2048 >= before,
        "{moved} huge pages moved of {before} kB"
    );
    assert!(
        move_line(run).contains(&format!("({moved} huge pages)")),
        "{}",
        move_line(run)
    );
}

/// A budget smaller than a buffer of huge pages (`always`, `TLLM_AFFINITY_MOVE_MEMORY=16M` for
/// 64 MiB): huge pages move whole while they fit, so what moves is at most the budget and less
/// than one huge page short of it; none is split, and the line says where it stopped and why.
/// (The guest kernel's default is `always`: CI's first run on a fresh machine gave the base-page
/// budget below 7 huge pages, 14.3 MiB, and failed its 16 MiB of 4 KiB pages.)
#[test]
fn a_budget_moves_huge_pages_whole_up_to_it() {
    let guest = require!(memory());
    let run = guest.ok("budget_huge");
    let before = huge_pages_stay_whole(run);
    let report = &run.report()["memory_moved"];
    println!("budget_huge: {report}; {}", move_line(run));
    assert!(before >= 32 << 10, "huge pages before: {before} kB");
    let budget = 16u64 << 20;
    let huge_page = 2u64 << 20;
    let moved = report["bytes_moved"].as_u64().unwrap_or(0);
    assert!(
        (budget - huge_page..=budget).contains(&moved),
        "{moved} bytes moved for a budget of {budget}: {report}"
    );
    assert!(
        report["huge_pages_moved"].as_u64().unwrap_or(0) >= 6,
        "{report}"
    );
    let line = move_line(run);
    assert!(
        line.contains("stopped short") && line.contains("budget of 16.0 MiB"),
        "{line}"
    );
}

/// A budget smaller than the memory (`TLLM_AFFINITY_MOVE_MEMORY=16M` for 64 MiB of base pages,
/// `never`): about 16 MiB moves and the line says where it stopped and why. A target node another process holds down to
/// 32 MiB above the headroom: the move stops there, nothing is killed, the line says why.
#[test]
fn a_move_stops_at_its_budget_and_at_the_target_nodes_headroom_and_says_so() {
    let guest = require!(memory());
    let run = guest.ok("budget");
    let after = buffer_pages(run, "after");
    let on_1 = after.get(&1).copied().unwrap_or(0);
    println!("budget: after {after:?}; {}", move_line(run));
    // 16 MiB of 4 KiB pages, within a batch.
    assert!((3800..=4400).contains(&on_1), "{after:?}");
    let line = move_line(run);
    assert!(
        line.contains("stopped short") && line.contains("budget of 16.0 MiB"),
        "{line}"
    );

    let holder = guest.ok("holder");
    println!("holder: {:?}", holder.out);
    assert!(holder.text().contains("HELD "), "{}", holder.text());
    assert!(
        holder.out.contains(&"alive=1".to_string()),
        "{}",
        holder.text()
    );
    assert!(
        holder.out.contains(&"oom_kills=0".to_string()),
        "{}",
        holder.text()
    );
    let run = guest.ok("node_full");
    let after = buffer_pages(run, "after");
    println!("node_full: after {after:?}; {}", move_line(run));
    let on_1 = after.get(&1).copied().unwrap_or(0);
    assert!(on_1 < BUFFER_PAGES * 3 / 4, "{after:?}");
    let line = move_line(run);
    assert!(
        line.contains("stopped short") && line.contains("headroom"),
        "{line}"
    );
}

/// `scripts/bench --memory-move`'s rounds (default 3) and the previous revision's library it
/// runs in the same rounds, if any.
fn bench_rounds_and_against() -> (usize, Option<String>) {
    let rounds = std::env::var("GUEST_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|&r| r > 0)
        .unwrap_or(3);
    (rounds, std::env::var("GUEST_BENCH_AGAINST").ok())
}

/// The move's cost at configure, printed (`MEASURED`, medians of the rounds): a dedicated
/// worker's configure with the move and without it (`TLLM_AFFINITY_MOVE_MEMORY=0`), for 64 MiB
/// and 1 GiB touched on node 0, beside `migratepages` and any previous revision's library.
#[test]
fn the_moves_rate_and_its_cost_at_configure_are_measured() {
    let guest = require!(memory_bench());
    let (rounds, against) = bench_rounds_and_against();
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let rates = |values: &[f64]| {
        let shown: Vec<String> = values.iter().map(|r| format!("{r:.0}")).collect();
        shown.join(", ")
    };
    for mib in [64u64, 1024] {
        let runs =
            move |kind: &'static str| (1..=rounds).map(move |i| format!("bench_{mib}_{kind}_{i}"));
        let configure_micros = |name: String| -> f64 {
            let run = guest.ok(&name);
            run.lines("CONFIGURE ")
                .into_iter()
                .find_map(|w| w.get(1).and_then(|us| us.parse().ok()))
                .unwrap_or_else(|| panic!("no CONFIGURE:\n{}", run.text()))
        };
        // A library's runs: the median MiB moved, huge pages, and rate, with each run's rate.
        let library = |kind: &'static str| {
            let (mut bytes, mut huge, mut each) = (Vec::new(), Vec::new(), Vec::new());
            for name in runs(kind) {
                let report = &guest.ok(&name).report()["memory_moved"];
                let moved = report["bytes_moved"].as_u64().unwrap();
                assert!(moved >= (mib << 20) * 95 / 100, "{name}: {report}");
                let millis = report["millis"].as_f64().unwrap();
                bytes.push(moved as f64 / f64::from(1u32 << 20));
                huge.push(report["huge_pages_moved"].as_f64().unwrap());
                each.push(moved as f64 / f64::from(1u32 << 20) / (millis / 1000.0));
            }
            (median(bytes), median(huge), median(each.clone()), each)
        };
        for name in runs("moved") {
            if let Some(steps) = guest
                .ok(&name)
                .err
                .iter()
                .find(|l| l.contains("the move took"))
            {
                println!("STEPS {name}: {steps}");
            }
        }
        let (mib_moved, huge, rate, each) = library("moved");
        let with = median(runs("moved").map(configure_micros).collect());
        let without = median(runs("stays").map(configure_micros).collect());
        println!(
            "MEASURED {mib} MiB: moved {mib_moved:.1} MiB ({huge} huge pages) at {rate:.0} MiB/s (runs {}); configure {:.1} ms with the move, {:.1} ms without (medians of {rounds})",
            rates(&each),
            with / 1000.0,
            without / 1000.0
        );
        let against_rate = against.as_ref().map(|_| {
            let (mib_moved, huge, rate, each) = library("against");
            println!(
                "MEASURED {mib} MiB: the previous revision moved {mib_moved:.1} MiB ({huge} huge pages) at {rate:.0} MiB/s (runs {}), same rounds",
                rates(&each)
            );
            rate
        });
        if mib != 1024 {
            continue;
        }
        // numactl's migratepages on the same memory, in the same boot, alternating with the
        // library's runs: pages it moved to node 1 over the time it ran.
        let mut kernel = Vec::new();
        for name in runs("migratepages") {
            let run = guest.ok(&name);
            let on_1 = buffer_pages(run, "after").get(&1).copied().unwrap_or(0);
            assert!(
                on_1 as u64 * 4096 >= (mib << 20) * 95 / 100,
                "{name}: {on_1} pages moved"
            );
            let millis = number(run, "MIGRATE_US ", 0) as f64 / 1000.0;
            kernel.push(on_1 as f64 * 4096.0 / f64::from(1u32 << 20) / (millis / 1000.0));
        }
        let kernel_rate = median(kernel.clone());
        let previous = against_rate
            .map(|r| format!(", the previous revision's {:.2}x", r / kernel_rate))
            .unwrap_or_default();
        println!(
            "MEASURED {mib} MiB: migratepages at {kernel_rate:.0} MiB/s (runs {}); the library's rate is {:.2}x{previous} (medians of {rounds})",
            rates(&kernel),
            rate / kernel_rate
        );
    }
}

// ---- The harness itself ----

/// The reason a guest that does not boot fails with: one line.
fn no_boot(machine: Machine, limit: Duration) -> Result<String, String> {
    match boot_machine(&machine, limit) {
        Ok(b) => panic!("{} booted: {:?}", machine.name, b.scenarios.keys()),
        Err(NoBoot::Missing(what)) => Err(what),
        Err(NoBoot::Failed(why)) => Ok(why),
    }
}

#[test]
fn a_qemu_error_fails_the_boot_with_one_line_naming_it() {
    let mut machine = two_nodes_machine();
    machine.name = "with a device QEMU does not have";
    machine.qemu_opts = "-device no-such-device".to_string();
    let why = require!(no_boot(machine, BOOT_LIMIT));
    println!("{why}");
    assert!(
        why.starts_with("guest with a device QEMU does not have did not boot: QEMU error"),
        "{why}"
    );
    assert!(why.contains("no-such-device"), "QEMU's own words: {why}");
    assert!(!why.contains('\n'), "one line: {why}");
}

#[test]
fn a_boot_past_its_limit_is_tried_once_more_then_fails_with_one_line() {
    let started = Instant::now();
    let why = require!(no_boot(two_nodes_machine(), Duration::from_secs(3)));
    println!("{why}");
    assert_eq!(
        why,
        format!(
            "guest two nodes x two CPUs did not boot: timeout, 3 s twice (QEMU TCG under {})",
            require!(tools()).1.image.display()
        )
    );
    // Two attempts of 3 s, nothing else retried.
    assert!(
        started.elapsed() >= Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn the_guest_scripts_lines_are_parsed_by_scenario() {
    let s = parse(
        "noise from the console\nguest| uname=6.1\nplan| {\nplan| }\nplan! warn\nplan= 0\nx= nope\nrun_2= 1\nthp| HUGE before 67584 69632 3\nthp| HUGE after 65536 69632 4\nthp= 0\n",
    );
    let huge = |phase| s["thp"].huge(phase);
    assert_eq!(huge("before").buffer_kib, 67584);
    assert_eq!(huge("after").host_kib, 69632);
    assert_eq!(huge("after").splits, 4);
    assert_eq!(s["run_2"].status, Some(1));
    assert_eq!(s["guest"].out, ["uname=6.1"]);
    assert_eq!(s["plan"].text(), "{\n}");
    assert_eq!(s["plan"].err, ["warn"]);
    assert_eq!(s["plan"].status, Some(0));
    assert_eq!(s["x"].status, None);
    assert!(!s.contains_key("noise from the console"));
}
