//! Several engines on one node, one per GPU (tests/programs/slice_servers.py), on the written tree
//! of [`two_nodes_two_gpus_each`]: checked in the guest of eight CPUs (tests/guests/guest.rs), where each
//! GPU's slice has the two cores a slice needs, which this machine's two CPUs cannot give.

use std::path::Path;

use serde_json::Value;
use tllm_affinity_core::host::simulated::SimulatedHost;
use tllm_affinity_core::mask::CpuMask;

use super::mask;
use super::tray::{pids_of, ps_row};

/// Two nodes over `cpus` (the lower half and the rest), each CPU its own core, each node two
/// last-level-cache domains (its halves), two GPUs per node.
pub fn two_nodes_two_gpus_each(cpus: &[usize]) -> (SimulatedHost, [CpuMask; 2]) {
    let half = cpus.len() / 2;
    let of = |part: &[usize]| CpuMask::from_cpus(part.iter().copied());
    let nodes = [of(&cpus[..half]), of(&cpus[half..])];
    let mut host = SimulatedHost::new();
    for (i, &c) in cpus.iter().enumerate() {
        host = host.cpu(c, c, usize::from(i >= half), &CpuMask::from_cpus([c]));
    }
    for part in [&cpus[..half], &cpus[half..]] {
        let quarter = part.len() / 2;
        host = host
            .llc_domain(&of(&part[..quarter]))
            .llc_domain(&of(&part[quarter..]));
    }
    let host = host
        .node(0, &nodes[0])
        .node(1, &nodes[1])
        .node_distances(vec![vec![10, 21], vec![21, 10]])
        .gpu("0000:1a:00.0", Some(0), None)
        .gpu("0000:2a:00.0", Some(0), None)
        .gpu("0000:9a:00.0", Some(1), None)
        .gpu("0000:aa:00.0", Some(1), None);
    (host, nodes)
}

/// The GPUs of [`two_nodes_two_gpus_each`].
pub const SLICE_GPUS: usize = 4;

/// The tree of [`two_nodes_two_gpus_each`] over `cpus`, written under `dir`.
pub fn write_slice_tree(dir: &Path, cpus: &[usize]) {
    two_nodes_two_gpus_each(cpus).0.write(dir).unwrap();
}

fn kernel(server: &Value, thread: &str) -> CpuMask {
    mask(
        server["masks"][thread]
            .as_str()
            .unwrap_or_else(|| panic!("no {thread} mask: {server}")),
    )
}

/// What slice_servers.py printed for the tree over `cpus`, checked. Phase `sliced`: each GPU's
/// workers on its own quarter of the CPUs (one last-level-cache domain, none shared with another
/// GPU's workers), `plan --gpu N` saying the same, the host thread on every CPU, the executor loop
/// where upstream asked (the node's CPU of the GPU's rank there) when that lies in the slice and
/// on the slice's step core (its first CPU) when not, each with its log line, the host view
/// showing each lease's slice and flagging no CPU shared among them, and `metrics` one slice
/// series each.
/// Phase `whole` (no slicing): each worker on its whole node, the loop where upstream asked,
/// no slice anywhere. Prints what each phase measured.
pub fn check_slice_servers(stdout: &str, cpus: &[usize]) {
    let phases: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(phases.len(), 2, "{stdout}");
    let all = CpuMask::from_cpus(cpus.iter().copied());
    let (_, nodes) = two_nodes_two_gpus_each(cpus);
    let quarter = cpus.len() / SLICE_GPUS;
    let slice_of =
        |g: usize| CpuMask::from_cpus(cpus[g * quarter..(g + 1) * quarter].iter().copied());
    for phase in &phases {
        let what = phase["phase"].as_str().unwrap();
        let sliced = what == "sliced";
        let servers = phase["servers"].as_array().unwrap();
        assert_eq!(servers.len(), SLICE_GPUS, "{phase}");
        let pids: Vec<u64> = servers.iter().map(|s| s["pid"].as_u64().unwrap()).collect();
        let mut taken = CpuMask::new();
        for (g, s) in servers.iter().enumerate() {
            let stderr = s["stderr"].as_str().unwrap_or_default();
            let node = &nodes[g / 2];
            let want = if sliced { slice_of(g) } else { node.clone() };
            let worker = kernel(s, "worker");
            let loop_mask = kernel(s, "loop");
            println!("{what} GPU {g}: workers [{worker}], executor loop [{loop_mask}]");
            assert_eq!(worker, want, "{what} GPU {g}: {s}");
            assert_eq!(kernel(s, "host"), all, "{what} GPU {g}: host thread: {s}");
            assert_eq!(
                mask(s["plan"]["worker"]["cpus"].as_str().unwrap()),
                want,
                "{what} GPU {g}: plan: {}",
                s["plan"]
            );
            // Upstream's pin, offset 0 and one CPU: the node's CPU of the GPU's rank on it.
            let asked = CpuMask::from_cpus([node.iter().nth(g % 2).unwrap()]);
            if sliced {
                assert!(
                    taken.intersection(&worker).is_empty(),
                    "GPU {g}'s workers [{worker}] share CPUs with another GPU's [{taken}]"
                );
                taken = taken.union(&worker);
                let (on, line) = if asked.is_subset(&want) {
                    (asked.clone(), "lie inside the GPU's slice")
                } else {
                    (
                        CpuMask::from_cpus([want.first().unwrap()]),
                        "on the slice's step core instead",
                    )
                };
                assert_eq!(loop_mask, on, "GPU {g}: asked [{asked}]: {stderr}");
                assert!(
                    stderr.contains(&format!("executor loop of GPU {g} on CPUs"))
                        && stderr.contains(line),
                    "GPU {g}: {stderr}"
                );
            } else {
                assert_eq!(loop_mask, asked, "GPU {g}: upstream's own pin: {stderr}");
                assert!(!stderr.contains("executor loop of GPU"), "{stderr}");
            }
            let row = ps_row(phase, s, what);
            let lease = &row["leases"][0];
            let series = format!(
                "tllm_affinity_lease_slice_cpus{{pid=\"{}\",",
                s["pid"].as_u64().unwrap()
            );
            let metrics = phase["metrics"].as_str().unwrap();
            let lines: Vec<&str> = metrics.lines().filter(|l| l.starts_with(&series)).collect();
            if sliced {
                assert_eq!(lease["slice"], want.to_list(), "{row}");
                assert_eq!(lines.len(), 1, "{metrics}");
                assert!(
                    lines[0].ends_with(&format!("cpus=\"{}\"}} {}", want.to_list(), want.count())),
                    "{}",
                    lines[0]
                );
            } else {
                assert_eq!(lease.get("slice"), None, "{row}");
                assert_eq!(lines, Vec::<&str>::new(), "{metrics}");
            }
        }
        // Where the engines' threads may run: no two of them share CPUs. (Their memory is the
        // kernel's business: what the interpreter touched before configure stays where it is, and
        // the host view may flag it as off the workers' node, which slicing does not change.)
        let flags = phase["ps"]["flags"].as_array().unwrap();
        for f in flags {
            println!("{what}: host view: {}", f["text"]);
        }
        let flagged: Vec<&Value> = flags
            .iter()
            .filter(|f| f["kind"] != "memory-off-node")
            .filter(|f| pids_of(f).iter().any(|p| pids.contains(p)))
            .collect();
        assert_eq!(flagged, Vec::<&Value>::new(), "{what}: host view flags");
    }
}
