//! Slices (SPEC §18, `TLLM_AFFINITY_SLICE=gpu`): the GPUs that share a CPU set divide it, so each
//! GPU's workers get CPUs of their own.
//!
//! [`slices`] is the one decision; `configure` (the engine), the step threads' `auto`, `plan` and
//! `topo` all call it. It reads the topology alone, so every process on the host computes the same
//! slices with no lock and no shared state, and a restarted rank gets its CPUs back.
//!
//! # The rule
//!
//! 1. Every GPU of the host (sysfs' NVIDIA display/3D functions, in PCI address order, visible or
//!    not, as SPEC §6 ranks them) has the set it is placed on without slicing: its GPU-local CPUs
//!    from sysfs ([`Topology::gpu_local_cpus`]: its node, or for a GPU whose memory node has no
//!    CPUs the node it is placed on instead), within `allowed`. GPUs with the same set share it
//!    and rank in PCI order.
//! 2. The unit is a core: the allowed SMT siblings of one physical core, never split.
//! 3. Where the set holds at least as many last-level-cache domains as GPUs share it, each GPU
//!    gets whole domains: the domains, by first CPU, are cut into as many runs as GPUs, as evenly
//!    as possible, the first runs one domain longer.
//! 4. Otherwise the cores, by first CPU, are cut into runs as evenly as possible.
//! 5. A run of fewer than two cores gives every GPU of the set the whole set, with a reason:
//!    nothing is ever empty or wraps.

use crate::host::topology::Topology;
use crate::mask::CpuMask;

/// How a GPU's slice was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// No other GPU shares the set: the slice is all of it.
    Alone,
    /// Whole last-level-cache domains.
    WholeDomains,
    /// Runs of cores: fewer domains than GPUs, or no cache information.
    Cores,
    /// Fewer than two cores per GPU: every GPU of the set keeps all of it.
    TooSmall,
}

impl Cut {
    pub fn name(self) -> &'static str {
        match self {
            Cut::Alone => "alone",
            Cut::WholeDomains => "whole-cache-domains",
            Cut::Cores => "cores",
            Cut::TooSmall => "too-small",
        }
    }
}

/// One GPU's slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSlice {
    pub address: String,
    /// The set its GPUs divide: the GPU's sysfs-local CPUs within `allowed`.
    pub set: CpuMask,
    /// Its rank among the GPUs sharing `set` (PCI order), and how many share it.
    pub rank: usize,
    pub sharing: usize,
    /// The slice: the GPU's worker CPUs under slicing (all of `set` when `Alone` or `TooSmall`).
    pub cpus: CpuMask,
    /// The last-level-cache domains of `set` the slice lies in (each within `set`); none when
    /// sysfs describes no caches.
    pub domains: Vec<CpuMask>,
    pub cut: Cut,
    /// Why the slice is the whole set although other GPUs share it (`TooSmall`).
    pub fallback: Option<String>,
}

impl GpuSlice {
    /// One phrase for log lines and `plan`: which GPUs share what, and how it was cut.
    pub fn describe(&self) -> String {
        let list: Vec<String> = self.domains.iter().map(|d| format!("[{d}]")).collect();
        let domains = list.join(" ");
        match self.cut {
            Cut::Alone => format!("the only GPU on [{}]: all of it", self.set),
            Cut::TooSmall => format!(
                "{} GPUs share [{}]: {}",
                self.sharing,
                self.set,
                self.fallback.as_deref().unwrap_or("too small to divide")
            ),
            Cut::WholeDomains => format!(
                "slice {} of {} of [{}], whole last-level-cache domains {domains}",
                self.rank, self.sharing, self.set
            ),
            Cut::Cores if self.domains.is_empty() => format!(
                "slice {} of {} of [{}], runs of cores (no cache domains known)",
                self.rank, self.sharing, self.set
            ),
            Cut::Cores => format!(
                "slice {} of {} of [{}], runs of cores (fewer last-level-cache domains than \
                 GPUs: {domains})",
                self.rank, self.sharing, self.set
            ),
        }
    }
}

/// Every GPU's slice of `allowed` (the CPUs slices may hold: the cpuset's online CPUs), in the
/// order of `topology.gpus`. Cache domains are `topology.llc_domains` (read them first with
/// [`Topology::read_llc_domains`]; none known cuts by cores).
pub fn slices(topology: &Topology, allowed: &CpuMask) -> Vec<GpuSlice> {
    let sets: Vec<CpuMask> = topology
        .gpus
        .iter()
        .map(|gpu| topology.gpu_local_cpus(gpu).cpus.intersection(allowed))
        .collect();
    // GPUs grouped by the set they share, each group in PCI order.
    let mut groups: Vec<(CpuMask, Vec<usize>)> = Vec::new();
    for (g, set) in sets.iter().enumerate() {
        match groups.iter_mut().find(|(s, _)| s == set) {
            Some((_, members)) => members.push(g),
            None => groups.push((set.clone(), vec![g])),
        }
    }
    let all_cores = topology.cores();
    let mut out: Vec<Option<GpuSlice>> = vec![None; topology.gpus.len()];
    for (set, members) in &groups {
        let cores: Vec<CpuMask> = all_cores
            .iter()
            .map(|core| core.intersection(set))
            .filter(|core| !core.is_empty())
            .collect();
        let domains: Vec<CpuMask> = topology
            .llc_domains
            .iter()
            .map(|d| d.intersection(set))
            .filter(|d| !d.is_empty())
            .collect();
        let division = divide(set, &cores, &domains, members.len());
        for (rank, (&g, (cpus, cut))) in members.iter().zip(division.runs).enumerate() {
            let lies_in = domains
                .iter()
                .filter(|d| !d.intersection(&cpus).is_empty())
                .cloned()
                .collect();
            out[g] = Some(GpuSlice {
                address: topology.gpus[g].address.clone(),
                set: set.clone(),
                rank,
                sharing: members.len(),
                cpus,
                domains: lies_in,
                cut,
                fallback: division.fallback.clone(),
            });
        }
    }
    out.into_iter().flatten().collect()
}

/// The slice of the GPU at `address` among `all`, when slicing applies to the set `placed_on`
/// it is placed on without slicing (within the same `allowed`): a GPU sysfs does not list, or
/// one placed elsewhere than sysfs says (NVML's affinity), is not sliced.
pub fn slice_for<'a>(
    all: &'a [GpuSlice],
    address: &str,
    placed_on: &CpuMask,
) -> Option<&'a GpuSlice> {
    all.iter()
        .find(|s| s.address == address)
        .filter(|s| s.set == *placed_on && !s.cpus.is_empty())
}

/// A GPU's worker base (the set the policy's `numa` rule applies) under slicing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerBase {
    pub cpus: CpuMask,
    /// The GPU's slice, when it got one narrower than its set or was alone on it.
    pub slice: Option<GpuSlice>,
    /// Why the GPU keeps its whole set although slicing is on: one warning line.
    pub warning: Option<String>,
}

/// Under `TLLM_AFFINITY_SLICE=gpu`, the worker base of the GPU at `address` placed on
/// `placed_on` (its GPU-local CPUs): its slice among `all` (computed over `allowed`), or its whole
/// set with a warning saying why. `configure` and `plan` both ask this.
pub fn worker_base(
    all: &[GpuSlice],
    allowed: &CpuMask,
    address: &str,
    placed_on: &CpuMask,
) -> WorkerBase {
    let keep = |warning: String| WorkerBase {
        cpus: placed_on.clone(),
        slice: None,
        warning: Some(format!(
            "TLLM_AFFINITY_SLICE=gpu: GPU {address} keeps its whole set [{placed_on}]: {warning}"
        )),
    };
    let placed = placed_on.intersection(allowed);
    match slice_for(all, address, &placed) {
        Some(s) if s.cut == Cut::TooSmall => keep(s.describe()),
        Some(s) => WorkerBase {
            cpus: s.cpus.clone(),
            slice: Some(s.clone()),
            warning: None,
        },
        None if all.iter().any(|s| s.address == address) => keep(
            "it is placed on other CPUs than sysfs places it on (NVML's affinity), so no \
             slices are known for them"
                .to_string(),
        ),
        None => keep("sysfs does not list it, so no slices are known for it".to_string()),
    }
}

struct Division {
    /// One (slice, cut) per GPU, in rank order.
    runs: Vec<(CpuMask, Cut)>,
    fallback: Option<String>,
}

/// Cuts `set` (its `cores` and cache `domains`, each by first CPU, both within `set`) among `n`
/// GPUs.
fn divide(set: &CpuMask, cores: &[CpuMask], domains: &[CpuMask], n: usize) -> Division {
    let whole = |cut| Division {
        runs: vec![(set.clone(), cut); n],
        fallback: None,
    };
    if n <= 1 {
        return whole(Cut::Alone);
    }
    if cores.len() < 2 * n {
        return Division {
            fallback: Some(format!(
                "{} core(s) for {n} GPUs is fewer than two each, so every one of them keeps the \
                 whole set (nothing wraps)",
                cores.len()
            )),
            ..whole(Cut::TooSmall)
        };
    }
    // Each core belongs to the domain holding its first CPU; domains that miss a core say too
    // little to cut along.
    let domain_of = |core: &CpuMask| {
        core.first()
            .and_then(|c| domains.iter().position(|d| d.contains(c)))
    };
    let domains_cover = cores.iter().all(|core| domain_of(core).is_some());
    if domains_cover && domains.len() >= n {
        let runs: Vec<CpuMask> = even_runs(domains.len(), n)
            .map(|range| {
                cores
                    .iter()
                    .filter(|core| domain_of(core).is_some_and(|d| range.contains(&d)))
                    .fold(CpuMask::new(), |acc, core| acc.union(core))
            })
            .collect();
        let cores_in = |run: &CpuMask| cores.iter().filter(|c| c.is_subset(run)).count();
        if runs.iter().all(|run| cores_in(run) >= 2) {
            return Division {
                runs: runs.into_iter().map(|r| (r, Cut::WholeDomains)).collect(),
                fallback: None,
            };
        }
    }
    Division {
        runs: even_runs(cores.len(), n)
            .map(|range| {
                cores[range]
                    .iter()
                    .fold(CpuMask::new(), |acc, core| acc.union(core))
            })
            .map(|run| (run, Cut::Cores))
            .collect(),
        fallback: None,
    }
}

/// `len` items cut into `n` consecutive runs as evenly as possible, the first `len % n` runs one
/// longer.
fn even_runs(len: usize, n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let (base, extra) = (len / n, len % n);
    (0..n).map(move |i| {
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::simulated::{
        amd_epyc_like, dgx_h100_like, gb200_tray, gh200, single_node_vm, GpuMemoryMode,
        SimulatedHost,
    };
    use crate::host::topology::SysfsRoot;
    use crate::mask::mask;

    /// `host` written and read back with its cache domains, as slicing reads it.
    fn read(host: &SimulatedHost) -> Topology {
        let dir = tempfile::tempdir().unwrap();
        host.write(dir.path()).unwrap();
        let root = SysfsRoot::new(dir.path());
        let mut t = Topology::read(&root).unwrap();
        t.read_llc_domains(&root);
        t
    }

    /// The properties every division holds: within the set, disjoint among the GPUs sharing a
    /// set and covering it, SMT siblings together, runs in order (never wrapping), whole domains
    /// when cut along them; returns the slices.
    fn check(t: &Topology, allowed: &CpuMask) -> Vec<GpuSlice> {
        let all = slices(t, allowed);
        assert_eq!(all.len(), t.gpus.len());
        for s in &all {
            assert!(
                s.cpus.is_subset(&s.set),
                "{}: {} outside {}",
                s.address,
                s.cpus,
                s.set
            );
            for core in t.cores() {
                let part = core.intersection(&s.set);
                let inside = part.intersection(&s.cpus);
                assert!(
                    inside.is_empty() || inside == part,
                    "{}: core {core} split",
                    s.address
                );
            }
            if s.cut == Cut::WholeDomains {
                for d in &s.domains {
                    assert!(d.is_subset(&s.cpus), "{}: domain {d} split", s.address);
                }
            }
        }
        let mut sets: Vec<&CpuMask> = all.iter().map(|s| &s.set).collect();
        sets.dedup();
        for set in sets {
            let group: Vec<&GpuSlice> = all.iter().filter(|s| s.set == *set).collect();
            if group[0].cut == Cut::TooSmall || group.len() == 1 {
                assert!(group.iter().all(|s| s.cpus == *set));
                continue;
            }
            let mut union = CpuMask::new();
            let mut last = None;
            for s in &group {
                assert!(
                    union.intersection(&s.cpus).is_empty(),
                    "{} overlaps",
                    s.address
                );
                assert!(s.cpus.count() >= 2);
                // In rank order, each slice lies above the one before: nothing wraps.
                let first_core = t
                    .cores()
                    .into_iter()
                    .position(|c| c.contains(s.cpus.first().unwrap()));
                assert!(first_core > last, "{}: out of order", s.address);
                last = first_core;
                union = union.union(&s.cpus);
            }
            assert_eq!(union, *set, "the slices cover the set");
        }
        all
    }

    #[test]
    fn dgx_h100_four_gpus_per_socket_get_14_cores_each_with_their_siblings() {
        let t = read(&dgx_h100_like());
        assert_eq!(t.llc_domains.len(), 2);
        let all = check(&t, &mask("0-223"));
        // Each slice is 14 whole cores with their siblings; tests/process/slices.rs checks the
        // exact lists `plan` prints.
        assert!(all.iter().all(|s| s.cpus.count() == 28), "{all:?}");
        assert_eq!(all[0].cpus.to_list(), "0-13,112-125");
        assert!(all.iter().all(|s| s.cut == Cut::Cores && s.sharing == 4));
        assert_eq!(all[5].rank, 1);
        assert_eq!(all[0].domains, vec![mask("0-55,112-167")]);
        assert!(
            all[0].describe().contains("slice 0 of 4"),
            "{}",
            all[0].describe()
        );
    }

    #[test]
    fn amd_ccds_are_given_whole_two_per_gpu() {
        let t = read(&amd_epyc_like());
        assert_eq!(t.llc_domains.len(), 16);
        let all = check(&t, &t.online.clone());
        assert!(all.iter().all(|s| s.cut == Cut::WholeDomains));
        assert_eq!(all[0].cpus, mask("0-15,128-143"));
        assert_eq!(
            all[0].domains,
            vec![mask("0-7,128-135"), mask("8-15,136-143")]
        );
        assert_eq!(all[7].cpus, mask("112-127,240-255"));
    }

    #[test]
    fn amd_ccds_among_three_gpus_and_a_mask_that_splits_a_ccd() {
        // Three GPUs on node 0's 8 CCDs: 3, 3 and 2 whole CCDs.
        let mut t = read(&amd_epyc_like());
        t.gpus.remove(3);
        let all = check(&t, &t.online.clone());
        assert_eq!(all[0].cpus, mask("0-23,128-151"));
        assert_eq!(all[1].cpus, mask("24-47,152-175"));
        assert_eq!(all[2].cpus, mask("48-63,176-191"));
        // A cpuset of 3 cores of CCD 0 and all of CCD 1 on node 0: two domains for four GPUs,
        // so cores: 11 cores cut 3, 3, 3, 2.
        let t = read(&amd_epyc_like());
        let all = check(&t, &mask("0-2,8-15,128-130,136-143,64-127,192-255"));
        assert!(all[..4].iter().all(|s| s.cut == Cut::Cores));
        assert_eq!(all[0].cpus, mask("0-2,128-130"));
        assert_eq!(all[3].cpus, mask("14-15,142-143"));
    }

    #[test]
    fn gb200_numa_and_cdmm_two_gpus_per_grace_get_36_cores_each() {
        for mode in [GpuMemoryMode::Numa, GpuMemoryMode::Cdmm] {
            let t = read(&gb200_tray(mode).host);
            let all = check(&t, &t.online.clone());
            let cpus: Vec<String> = all.iter().map(|s| s.cpus.to_list()).collect();
            assert_eq!(cpus, ["0-35", "36-71", "72-107", "108-143"], "{mode:?}");
            assert!(all
                .iter()
                .all(|s| s.cut == Cut::Cores && s.domains.len() == 1));
        }
    }

    #[test]
    fn gh200_one_gpu_keeps_its_grace() {
        let t = read(&gh200().host);
        let all = check(&t, &t.online.clone());
        assert_eq!(all[0].cpus, mask("0-71"));
        assert_eq!(all[0].cut, Cut::Alone);
    }

    #[test]
    fn two_cpus_for_two_gpus_is_the_whole_set_with_a_reason() {
        let t = read(&single_node_vm(2, 2));
        let all = check(&t, &mask("0-1"));
        assert!(all
            .iter()
            .all(|s| s.cpus == mask("0-1") && s.cut == Cut::TooSmall));
        let why = all[0].fallback.as_deref().unwrap();
        assert!(
            why.contains("2 core(s) for 2 GPUs") && why.contains("whole set"),
            "{why}"
        );
        // One GPU on two CPUs is simply alone.
        let t = read(&single_node_vm(2, 1));
        assert_eq!(check(&t, &mask("0-1"))[0].cut, Cut::Alone);
    }

    #[test]
    fn a_gpu_without_a_node_divides_what_it_is_placed_on_with_its_kind() {
        // Two GPUs with numa_node -1 on the DGX share every online CPU and halve it; the
        // node-local GPUs keep their slices of their nodes.
        let host = dgx_h100_like()
            .gpu("0000:e0:00.0", None, None)
            .gpu("0000:e1:00.0", None, None);
        let t = read(&host);
        let all = check(&t, &t.online.clone());
        assert_eq!(all[8].set, t.online);
        assert_eq!(all[8].cpus, mask("0-55,112-167"));
        assert_eq!(all[9].cpus, mask("56-111,168-223"));
        assert_eq!(all[0].cpus, mask("0-13,112-125"));
    }

    #[test]
    fn no_cache_information_cuts_by_cores_and_only_allowed_cpus_count() {
        let mut t = read(&dgx_h100_like());
        t.llc_domains.clear();
        let all = check(&t, &mask("0-111"));
        assert_eq!(all[0].cpus, mask("0-13"));
        assert!(all[0].domains.is_empty());
        assert!(all[0].describe().contains("no cache domains known"));
    }

    #[test]
    fn every_process_computes_the_same_slices() {
        let t = read(&amd_epyc_like());
        assert_eq!(slices(&t, &t.online), slices(&t, &t.online));
    }

    #[test]
    fn slice_for_needs_the_set_the_gpu_is_placed_on() {
        let t = read(&dgx_h100_like());
        let all = slices(&t, &t.online);
        let node0 = mask("0-55,112-167");
        assert_eq!(
            slice_for(&all, "0000:2a:00.0", &node0).unwrap().cpus,
            mask("14-27,126-139")
        );
        assert!(slice_for(&all, "0000:2a:00.0", &mask("0-7")).is_none());
        assert!(slice_for(&all, "0000:ff:00.0", &node0).is_none());
    }

    #[test]
    fn even_runs_are_consecutive_and_the_first_are_longer() {
        let runs: Vec<_> = even_runs(11, 4).collect();
        assert_eq!(runs, [0..3, 3..6, 6..9, 9..11]);
        let runs: Vec<_> = even_runs(8, 8).collect();
        assert_eq!(runs[7], 7..8);
    }
}
