//! Issue #7, fuzzing with proptest: the cpulist and hex-mask parsers, the sysfs topology reader
//! over random (and randomly damaged) trees written to temporary directories, the cgroup parser
//! over random texts and random cgroup trees, and the settings and device parsers over random
//! values. No input may panic (or abort); the round-trip properties must hold. Each property
//! prints how many cases it executed.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tllm_affinity_core::host::cgroup;
use tllm_affinity_core::host::simulated::SimulatedHost;
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::mask::{CpuMask, MAX_CPU};
use tllm_affinity_core::placement::device::{resolve_device_in, DeviceEnv};
use tllm_affinity_core::placement::settings::Settings;

/// Runs `test` over `cases` values of `strategy`, failing with proptest's shrunk input, and
/// prints the number of cases executed.
fn fuzz<S: Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> u64 {
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let executed = AtomicU64::new(0);
    let result = runner.run(&strategy, |value| {
        executed.fetch_add(1, Ordering::Relaxed);
        test(value)
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    let n = executed.load(Ordering::Relaxed);
    println!("fuzz {name}: {n} cases executed");
    n
}

/// The kernel's hex format (`Cpus_allowed`): 32-bit groups, most significant first.
fn to_hex(mask: &CpuMask) -> String {
    let groups = mask.last().map_or(1, |c| c / 32 + 1);
    (0..groups)
        .rev()
        .map(|g| {
            let word = (0..32)
                .filter(|b| mask.contains(g * 32 + b))
                .fold(0u32, |w, b| w | 1 << b);
            format!("{word:08x}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn cpulist_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[0-9,:\\- \\n\\t]{0,40}",
        "(\\d{1,7}(-\\d{1,7}(:\\d{1,3})?)?,){0,6}\\d{0,7}",
        "[0-9a-fA-Fx,]{0,40}",
    ]
}

#[test]
fn cpulist_parser_never_panics_and_round_trips() {
    fuzz("parse_list(text)", 4000, cpulist_text(), |text| {
        if let Ok(mask) = CpuMask::parse_list(&text) {
            prop_assert!(mask.last().is_none_or(|c| c <= MAX_CPU));
            prop_assert_eq!(CpuMask::parse_list(&mask.to_list()), Ok(mask.clone()));
        }
        Ok(())
    });
    let sets = prop::collection::btree_set(0usize..5000, 0..300);
    fuzz(
        "parse_list(to_list(m)) == m",
        4000,
        sets,
        |cpus: BTreeSet<usize>| {
            let mask = CpuMask::from_cpus(cpus.iter().copied());
            let list = mask.to_list();
            prop_assert_eq!(CpuMask::parse_list(&list), Ok(mask.clone()));
            prop_assert_eq!(mask.count(), cpus.len());
            prop_assert_eq!(mask.iter().collect::<BTreeSet<_>>(), cpus);
            // The same set written with a stride of 1 and stray whitespace parses the same.
            let spaced = list.replace(',', " , ");
            prop_assert_eq!(
                CpuMask::parse_list(&format!(" {spaced}\n")),
                Ok(mask.clone())
            );
            let bytes = mask.last().map_or(8, |c| (c / 64 + 1) * 8);
            prop_assert_eq!(
                CpuMask::from_kernel_bytes(&mask.to_kernel_bytes(bytes)),
                mask
            );
            Ok(())
        },
    );
}

#[test]
fn hex_mask_parser_never_panics_and_round_trips() {
    fuzz("parse_hex(text)", 4000, cpulist_text(), |text| {
        if let Some(mask) = CpuMask::parse_hex(&text) {
            prop_assert_eq!(CpuMask::parse_hex(&to_hex(&mask)), Some(mask));
        }
        Ok(())
    });
    let sets = prop::collection::btree_set(0usize..2048, 0..200);
    fuzz("parse_hex(to_hex(m)) == m", 4000, sets, |cpus| {
        let mask = CpuMask::from_cpus(cpus);
        prop_assert_eq!(CpuMask::parse_hex(&to_hex(&mask)), Some(mask));
        Ok(())
    });
}

/// A valid simulated host: `cpus` CPUs in `nodes` NUMA nodes (the last ones may be memory-only),
/// GPUs on given nodes (or none known).
#[derive(Debug, Clone)]
struct HostShape {
    cpus: usize,
    nodes: usize,
    smt: bool,
    gpus: Vec<Option<usize>>,
}

fn host_shape() -> impl Strategy<Value = HostShape> {
    (1usize..=16, 1usize..=4, any::<bool>())
        .prop_flat_map(|(cpus, nodes, smt)| {
            let gpus = prop::collection::vec(prop::option::of(0..nodes), 0..=4);
            (Just(cpus), Just(nodes), Just(smt), gpus)
        })
        .prop_map(|(cpus, nodes, smt, gpus)| HostShape {
            cpus,
            nodes,
            smt,
            gpus,
        })
}

fn gpu_address(i: usize) -> String {
    format!("0000:{:02x}:00.0", 0x10 + i * 0x11)
}

fn build(shape: &HostShape) -> SimulatedHost {
    let mut host = SimulatedHost::new();
    for c in 0..shape.cpus {
        let core = if shape.smt { c / 2 } else { c };
        let siblings = if shape.smt {
            CpuMask::from_cpus((core * 2..core * 2 + 2).filter(|&s| s < shape.cpus))
        } else {
            CpuMask::from_cpus([c])
        };
        host = host.cpu(c, core, 0, &siblings);
    }
    let per_node = shape.cpus.div_ceil(shape.nodes);
    for n in 0..shape.nodes {
        let cpus =
            CpuMask::from_cpus((n * per_node..(n + 1) * per_node).filter(|&c| c < shape.cpus));
        host = host.node(n, &cpus);
    }
    for (i, node) in shape.gpus.iter().enumerate() {
        host = host.gpu(&gpu_address(i), *node, None);
    }
    host.idle_state("POLL", 0).idle_state("C1", 2)
}

/// Every path under `dir` (files, directories, links), sorted.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    paths.sort();
    for p in paths {
        out.push(p.clone());
        if p.is_dir() && !p.is_symlink() {
            walk(&p, out);
        }
    }
}

#[derive(Debug, Clone)]
struct Damage {
    selector: usize,
    kind: u8,
    payload: Vec<u8>,
    number: u64,
}

fn damage() -> impl Strategy<Value = Damage> {
    (
        any::<usize>(),
        0u8..9,
        prop::collection::vec(any::<u8>(), 0..64),
        any::<u64>(),
    )
        .prop_map(|(selector, kind, payload, number)| Damage {
            selector,
            kind,
            payload,
            number,
        })
}

fn remove(path: &Path) {
    if path.is_dir() && !path.is_symlink() {
        let _ = fs::remove_dir_all(path);
    } else {
        let _ = fs::remove_file(path);
    }
}

/// Damages one path of the tree the way a hand-made or hostile tree could be wrong.
fn apply(root: &Path, d: &Damage) {
    let mut paths = Vec::new();
    walk(root, &mut paths);
    if paths.is_empty() {
        return;
    }
    let path = &paths[d.selector % paths.len()];
    let text: String = d
        .payload
        .iter()
        .map(|b| b"0123456789,-: \nx"[(*b % 16) as usize] as char)
        .collect();
    match d.kind {
        0 => {
            remove(path);
            let _ = fs::write(path, &d.payload);
        }
        1 => {
            remove(path);
            let _ = fs::write(path, &text);
        }
        2 => {
            remove(path);
            let _ = fs::write(path, "");
        }
        3 => remove(path),
        4 => {
            remove(path);
            let _ = fs::create_dir(path);
        }
        5 => {
            remove(path);
            let _ = std::os::unix::fs::symlink("/nonexistent/target", path);
        }
        6 => {
            remove(path);
            let _ = std::os::unix::fs::symlink(path, path);
        }
        7 => {
            // A numbered entry with any number (up to u64::MAX) beside the damaged path, the
            // damaged path's directory losing its `online` file.
            let dir = if path.is_dir() {
                path.clone()
            } else {
                path.parent().unwrap().to_path_buf()
            };
            let prefix = ["cpu", "node", "state"][d.selector % 3];
            let _ = fs::create_dir_all(dir.join(format!("{prefix}{}", d.number)));
            let _ = fs::remove_file(dir.join("online"));
        }
        _ => {
            remove(path);
            let _ = fs::write(path, format!("{}\n", d.number as u128 * 1_000_000_007));
        }
    }
}

fn device_env() -> impl Strategy<Value = DeviceEnv> {
    let value = prop::option::of(prop_oneof![
        any::<String>(),
        "[0-9,]{0,8}",
        "GPU-[0-9a-f\\-]{0,12}",
        "[0-9a-fA-F:.]{0,14}",
        Just("PCI_BUS_ID".to_string()),
    ]);
    (value.clone(), value.clone(), value.clone(), value).prop_map(|(visible, order, gpu, rank)| {
        DeviceEnv::from_lookup(|name| match name {
            "CUDA_VISIBLE_DEVICES" => visible.clone(),
            "CUDA_DEVICE_ORDER" => order.clone(),
            "TLLM_AFFINITY_GPU" => gpu.clone(),
            "LOCAL_RANK" => rank.clone(),
            _ => None,
        })
    })
}

#[test]
fn topology_reader_survives_random_and_damaged_trees() {
    let strategy = (
        host_shape(),
        prop::collection::vec(damage(), 0..6),
        device_env(),
        -3i32..6,
    );
    fuzz(
        "Topology::read(random tree, damaged)",
        300,
        strategy,
        |(shape, damages, env, device)| {
            let dir = tempfile::tempdir().unwrap();
            let host = build(&shape);
            host.write(dir.path()).unwrap();
            let root = SysfsRoot::new(dir.path());

            // Undamaged: read back exactly what was written.
            let topo = Topology::read(&root).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&topo.online, &host.online_cpus());
            prop_assert_eq!(topo.cpus.len(), shape.cpus);
            prop_assert_eq!(topo.gpus.len(), shape.gpus.len());
            for gpu in &topo.gpus {
                let local = topo.gpu_local_cpus(gpu);
                prop_assert!(!local.cpus.is_empty(), "{:?}", local);
                prop_assert!(local.cpus.is_subset(&topo.online));
            }
            let cores = topo.cores();
            prop_assert_eq!(
                cores.iter().map(CpuMask::count).sum::<usize>(),
                shape.cpus,
                "every CPU in one core"
            );
            if let Ok(resolved) = resolve_device_in(device, &env, &topo.gpus, &root) {
                prop_assert!(resolved.gpu_index < topo.gpus.len());
            }

            // Damaged: any answer but a panic (or an abort).
            for d in &damages {
                apply(dir.path(), d);
            }
            if let Ok(topo) = Topology::read(&root) {
                for gpu in &topo.gpus {
                    let local = topo.gpu_local_cpus(gpu);
                    prop_assert!(local.cpus.is_subset(&topo.online));
                }
                let _ = topo.cores();
                if let Ok(resolved) = resolve_device_in(device, &env, &topo.gpus, &root) {
                    prop_assert!(resolved.gpu_index < topo.gpus.len());
                }
            }
            Ok(())
        },
    );
}

#[test]
fn cgroup_parser_survives_random_texts_and_trees() {
    let line = prop_oneof![
        any::<String>(),
        "[0-9]{1,3} [0-9]{1,3} [0-9]:[0-9]{1,2} (/|/[a-z./]{0,12}) /[a-z/]{0,16} rw( [a-z:0-9]{0,8})? - (cgroup|cgroup2|tmpfs) [a-z]{0,8} [a-z,_]{0,30}",
        "[0-9]{1,2}:[a-z,_=]{0,20}:(/|/[a-z./\\\\0-9]{0,20})",
    ];
    let text = prop::collection::vec(line, 0..8).prop_map(|l| l.join("\n"));
    fuzz(
        "cgroup::parse_limits(random texts)",
        3000,
        (text.clone(), text),
        |(cgroup_text, mountinfo)| {
            let dir = tempfile::tempdir().unwrap();
            let limits = cgroup::parse_limits(&cgroup_text, &mountinfo, dir.path());
            prop_assert!(limits.cpuset.is_none(), "nothing to read in an empty tree");
            Ok(())
        },
    );

    // A v2 tree with a random cgroup path and random cpuset files up the hierarchy: the
    // innermost non-empty valid cpulist wins; garbage is skipped, never a panic.
    let strategy = (
        prop::collection::vec("[a-z0-9_-][a-z0-9._-]{0,7}", 0..4),
        prop::collection::vec(prop::option::of(cpulist_text()), 0..5),
    );
    fuzz(
        "cgroup::parse_limits(random v2 trees)",
        500,
        strategy,
        |(components, files)| {
            let dir = tempfile::tempdir().unwrap();
            let mount = dir.path().join("sys/fs/cgroup");
            let mut dirs = vec![mount.clone()];
            for c in &components {
                let next = dirs.last().unwrap().join(c);
                dirs.push(next);
            }
            fs::create_dir_all(dirs.last().unwrap()).unwrap();
            let mut expected = None;
            for (d, f) in dirs.iter().rev().zip(&files) {
                if let Some(text) = f {
                    fs::write(d.join("cpuset.cpus.effective"), text).unwrap();
                    if expected.is_none() {
                        expected = CpuMask::parse_list(text).ok().filter(|m| !m.is_empty());
                    }
                }
            }
            let cgroup_text = format!("0::/{}\n", components.join("/"));
            let mountinfo = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n";
            let limits = cgroup::parse_limits(&cgroup_text, mountinfo, dir.path());
            prop_assert_eq!(limits.cpuset, expected);
            Ok(())
        },
    );
}

const VARIABLES: [&str; 15] = [
    "TLLM_AFFINITY_POLICY",
    "TLLM_NUMA_AWARE_WORKER_AFFINITY",
    "TLLM_AFFINITY_CPUS",
    "TLLM_AFFINITY_SYSFS_ROOT",
    "TLLM_AFFINITY_WORKER_LIBS",
    "TLLM_AFFINITY_LOG",
    "TLLM_AFFINITY_REPORT",
    "TLLM_AFFINITY_STRICT",
    "TLLM_AFFINITY_PROCESS_ROLE",
    "TLLM_AFFINITY_STEP_CORE",
    "TLLM_AFFINITY_LOCK_DIR",
    "TLLM_AFFINITY_GPU",
    "TLLM_AFFINITY_MOVE_MEMORY",
    "TLLM_AFFINITY_DISABLE",
    "CUDA_VISIBLE_DEVICES",
];

#[test]
fn settings_parser_names_every_bad_variable_in_one_line() {
    let value = prop::option::of(prop_oneof![
        any::<String>(),
        "[a-z0-9,\\-*.\\[\\]/ ]{0,16}",
        Just(String::new()),
    ]);
    let strategy = prop::collection::vec(value, VARIABLES.len());
    fuzz(
        "Settings::from_lookup(random values)",
        3000,
        strategy,
        |values| {
            let (_, errors) = Settings::from_lookup(|name| {
                VARIABLES
                    .iter()
                    .position(|v| *v == name)
                    .and_then(|i| values[i].clone())
            });
            let set = values.iter().filter(|v| v.is_some()).count();
            prop_assert!(errors.len() <= set);
            for e in &errors {
                let line = e.to_string();
                prop_assert!(!line.contains('\n'), "{}", line);
                prop_assert!(line.starts_with(e.variable), "{}", line);
                prop_assert!(line.contains("expected"), "{}", line);
                let i = VARIABLES.iter().position(|v| *v == e.variable).unwrap();
                prop_assert!(
                    values[i].is_some(),
                    "an unset variable was reported: {}",
                    line
                );
            }
            Ok(())
        },
    );
}

/// One parser decides what a malformed TLLM_AFFINITY_GPU is: a value the load-time check refuses
/// is the one configure(-1) would call malformed, and nothing it accepts is called so later.
#[test]
fn load_and_configure_agree_on_a_malformed_gpu() {
    let dir = tempfile::tempdir().unwrap();
    tllm_affinity_core::host::simulated::two_node_one_gpu(&CpuMask::parse_list("0-3").unwrap())
        .write(dir.path())
        .unwrap();
    let root = SysfsRoot::new(dir.path());
    let topo = Topology::read(&root).unwrap();
    let value = prop_oneof![
        any::<String>(),
        "[0-9a-fA-Fz:. +\\-]{0,14}",
        "(0000:)?[0-9a-f]{2}:[0-9a-f]{2}\\.[0-7]",
    ];
    fuzz(
        "TLLM_AFFINITY_GPU at load and at configure",
        3000,
        value,
        |v| {
            let lookup = |name: &str| (name == "TLLM_AFFINITY_GPU").then(|| v.clone());
            let (_, errors) = Settings::from_lookup(lookup);
            let env = DeviceEnv::from_lookup(lookup);
            let malformed_at_configure = resolve_device_in(-1, &env, &topo.gpus, &root)
                .err()
                .is_some_and(|e| {
                    e.to_string()
                        .contains("expected a CUDA device number (0, 1, ...) or a PCI address")
                });
            prop_assert_eq!(!errors.is_empty(), malformed_at_configure, "{:?}", v);
            Ok(())
        },
    );
}
