//! Four servers on one GB200 tray (tests/programs/tray_servers.py), checked the same on this
//! machine (tests/process/grace_shapes.rs) and in a guest with eight CPUs (tests/guests/guest.rs), where `auto`
//! has cores enough to pin every server's step and result threads.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use tllm_affinity_core::host::simulated;
use tllm_affinity_core::mask::CpuMask;

use super::{grace_nvml, mask};

/// The tray with its Grace nodes over `node0` and `node1` written under `dir`: the tree under
/// `sys/` and NVML's answer in `nvml` (the test double's format).
pub fn write_tray(dir: &Path, node0: &CpuMask, node1: &CpuMask) {
    let shape = simulated::gb200_tray_over(node0, node1);
    shape.host.write(dir).unwrap();
    std::fs::write(dir.join("nvml"), grace_nvml(&shape)).unwrap();
}

/// `ps --json`'s row of `server` (a line the servers' script printed, with its `pid`) in `phase`.
pub(crate) fn ps_row<'a>(
    phase: &'a Value,
    server: &Value,
    what: impl std::fmt::Display,
) -> &'a Value {
    phase["ps"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == server["pid"])
        .unwrap_or_else(|| panic!("{what}: no row for {server}"))
}

/// The pids a host-view flag (`ps --json`'s `flags[]`) names.
pub(crate) fn pids_of(flag: &Value) -> Vec<u64> {
    flag["pids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap())
        .collect()
}

/// What tray_servers.py printed for the tray over `node0` and `node1`, checked: in both phases
/// each server's workers on its GPU's Grace node and the host view's row saying so, and no two
/// of the four flagged for sharing workers' CPUs (GPUs 0 and 1, 2 and 3, share their node's CPUs
/// as their NUMA-local set); in the `auto` phase each step and result thread where `plan --gpu N`
/// says, pinned or not, and no CPU pinned for two servers. Where `auto` pinned every step thread,
/// the process-wide phase (every thread of a server pinned to its whole node, as upstream does)
/// must flag the step threads of each node's two servers. Returns whether it pinned them.
pub fn check_tray_servers(stdout: &str, node0: &CpuMask, node1: &CpuMask) -> bool {
    let phases: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(phases.len(), 2, "{stdout}");
    let nodes = [node0, node0, node1, node1];
    let servers = |phase: &Value| phase["servers"].as_array().unwrap().clone();
    let pids: Vec<u64> = servers(&phases[0])
        .iter()
        .map(|s| s["pid"].as_u64().unwrap())
        .collect();
    for phase in &phases {
        let what = &phase["phase"];
        let mut pinned_by: BTreeMap<usize, u64> = BTreeMap::new();
        for (s, node) in servers(phase).iter().zip(nodes) {
            let gpu = s["gpu"].as_u64().unwrap();
            assert_eq!(
                mask(s["masks"]["worker"].as_str().unwrap()),
                *node,
                "{what}: {s}"
            );
            let row = ps_row(phase, s, what);
            assert_eq!(row["leases"][0]["gpu"], gpu, "{what}: {row}");
            assert_eq!(row["worker_cpus"], node.to_list(), "{what}: {row}");
            if what != "auto" {
                continue;
            }
            let placement = &s["plan"]["placement"];
            match placement["step_cpus"].as_str() {
                Some(step) => {
                    assert_eq!(s["masks"]["step"], step, "{s}");
                    let result = placement["result_cpu"].as_u64().unwrap() as usize;
                    assert_eq!(
                        mask(s["masks"]["result"].as_str().unwrap()),
                        CpuMask::from_cpus([result]),
                        "{s}"
                    );
                    for cpu in mask(step).iter().chain([result]) {
                        let other = pinned_by.insert(cpu, s["pid"].as_u64().unwrap());
                        assert_eq!(other, None, "CPU {cpu} pinned for two servers: {s}");
                    }
                }
                None => assert_eq!(s["rc"]["step"], 0, "{s}"),
            }
        }
        let shared: Vec<&Value> = phase["ps"]["flags"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["kind"] == "workers-share-cpus")
            .filter(|f| pids_of(f).iter().all(|p| pids.contains(p)))
            .collect();
        assert_eq!(
            shared,
            Vec::<&Value>::new(),
            "{what}: {}",
            phase["ps"]["flags"]
        );
    }
    let pinned = servers(&phases[0])
        .iter()
        .all(|s| s["rc"]["step"].as_i64() > Some(0));
    if pinned {
        for pair in [[pids[0], pids[1]], [pids[2], pids[3]]] {
            let flags = &phases[1]["ps"]["flags"];
            let flagged = flags.as_array().unwrap().iter().any(|f| {
                let named = pids_of(f);
                f["kind"] == "step-threads-share-a-core"
                    && named.contains(&pair[0])
                    && named.contains(&pair[1])
            });
            assert!(flagged, "{pair:?}: {flags}");
        }
    }
    pinned
}
