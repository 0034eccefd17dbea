//! The CPU plan (SPEC §4, §6): from the host topology, the CPUs the process may use and its cgroup
//! CPU quota, which CPUs a GPU's worker threads get, where its step and result threads go, and how
//! large the thread pools should be with what is left.
//!
//! Everything here is pure: the engine (`crate::placement::step`) and the CLI (`tllm-affinity plan`) read the
//! inputs and call the same functions, so what the plan prints is what the library does.
//!
//! # The `auto` rule (SPEC §6)
//!
//! The unit of placement is a *core*: the SMT siblings of one physical core that are in the
//! allowed set (allowed = process mask at load ∩ cpuset). Every process on the host computes the
//! placement of *all* the host's GPUs (PCI order, visible or not), so two servers on two GPUs pick
//! disjoint CPUs without talking to each other:
//!
//! 1. A GPU whose NUMA node has allowed cores is *node-local*. The node's allowed cores, by first
//!    CPU, are its pool; the GPU's rank r among the node-local GPUs of that node (PCI order)
//!    picks step core `pool[r]` (from the bottom) and result core `pool[len - 1 - r]` (from the
//!    top).
//! 2. The other GPUs (`numa_node` -1, or a node with no allowed CPU) rank among themselves and
//!    pick the same way from the cores the placed node-local GPUs leave, over all nodes.
//! 3. A pool with fewer than two cores per GPU picking from it places none of its GPUs: each gets
//!    a reason instead. Nothing ever wraps, so no two GPUs share a CPU.

use std::collections::BTreeMap;

use crate::host::cgroup::CpuQuota;
use crate::host::topology::{LocalCpuSource, Topology};
use crate::mask::CpuMask;
use crate::placement::policy::{self, Decision};
use crate::placement::settings::{Settings, SliceMode, StepCore};
use crate::placement::slice::{self, Cut, GpuSlice, WorkerBase};

/// Where one GPU's step and result threads go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlacement {
    /// The step core's CPUs within the allowed set (both SMT siblings where both are allowed).
    pub step: CpuMask,
    /// One CPU of another core for the result thread; `None` only for `<cpu>` when the mask has
    /// no other core.
    pub result: Option<usize>,
    /// How the CPUs were chosen, for log lines and the plan.
    pub why: String,
}

/// One GPU of the host under `auto`: its placement or why it has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPlacement {
    pub address: String,
    pub numa_node: Option<usize>,
    pub placement: Result<StepPlacement, String>,
}

/// The allowed cores (allowed siblings of each core), by first CPU, with their NUMA node.
fn allowed_cores(topology: &Topology, allowed: &CpuMask) -> Vec<(CpuMask, Option<usize>)> {
    topology
        .cores()
        .iter()
        .map(|core| core.intersection(allowed))
        .filter(|core| !core.is_empty())
        .map(|core| {
            let node = core.first().and_then(|c| topology.node_of_cpu(c));
            (core, node)
        })
        .collect()
}

/// SPEC §6 `auto` for every GPU of `topology` at once, in the order of `topology.gpus`.
pub fn auto_placement(topology: &Topology, allowed: &CpuMask) -> Vec<GpuPlacement> {
    let cores = allowed_cores(topology, allowed);
    let mut by_node: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, (_, node)) in cores.iter().enumerate() {
        if let Some(n) = node {
            by_node.entry(*n).or_default().push(i);
        }
    }
    let mut local: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut off_node = Vec::new();
    for (g, gpu) in topology.gpus.iter().enumerate() {
        match gpu.numa_node.filter(|n| by_node.contains_key(n)) {
            Some(n) => local.entry(n).or_default().push(g),
            None => off_node.push(g),
        }
    }

    let mut placements: Vec<Option<Result<StepPlacement, String>>> =
        vec![None; topology.gpus.len()];
    let mut taken = vec![false; cores.len()];
    for (node, gpus) in &local {
        let pool = &by_node[node];
        let pool_name = format!("NUMA node {node}");
        for (g, placed) in pick(pool, gpus, &pool_name, "on it") {
            if let Ok((step, result)) = placed {
                taken[step] = true;
                taken[result] = true;
            }
            placements[g] = Some(placed.map(|p| to_placement(&cores, p, gpus, &pool_name, g)));
        }
    }
    let leftover: Vec<usize> = (0..cores.len()).filter(|&i| !taken[i]).collect();
    let pool_name = "the pool of cores the node-local GPUs leave".to_string();
    let whose = "without an allowed CPU on their NUMA node";
    for (g, placed) in pick(&leftover, &off_node, &pool_name, whose) {
        placements[g] = Some(placed.map(|p| to_placement(&cores, p, &off_node, &pool_name, g)));
    }

    topology
        .gpus
        .iter()
        .zip(placements)
        .map(|(gpu, placed)| GpuPlacement {
            address: gpu.address.clone(),
            numa_node: gpu.numa_node,
            placement: placed.unwrap_or_else(|| Err("not placed".to_string())),
        })
        .collect()
}

/// SPEC §6 `auto` under slicing (§18): a GPU with a slice of its own picks its step core from the
/// bottom of its slice and its result core from the top, within `allowed`, so no other GPU's
/// workers or pinned threads share them; a GPU that keeps its whole set (alone on it, or too
/// small to divide) is placed as without slicing. `slices` are [`slice::slices`] of `topology`.
pub fn auto_placement_sliced(
    topology: &Topology,
    allowed: &CpuMask,
    slices: &[GpuSlice],
) -> Vec<GpuPlacement> {
    let unsliced = auto_placement(topology, allowed);
    let cores = allowed_cores(topology, allowed);
    unsliced
        .into_iter()
        .zip(slices)
        .map(|(placed, s)| {
            if !matches!(s.cut, Cut::WholeDomains | Cut::Cores) {
                return placed;
            }
            let mine: Vec<&CpuMask> = cores
                .iter()
                .map(|(core, _)| core)
                .filter(|core| core.is_subset(&s.cpus))
                .collect();
            let placement = match (mine.first(), mine.last()) {
                (Some(step), Some(result)) if mine.len() >= 2 => Ok(StepPlacement {
                    step: (*step).clone(),
                    result: result.first(),
                    why: format!(
                        "step core from the bottom of the GPU's slice [{}], result core from \
                         its top",
                        s.cpus
                    ),
                }),
                _ => Err(format!(
                    "the GPU's slice [{}] has {} allowed core(s), and a step and a result core \
                     need two; nothing wraps: widen the mask or name a CPU with \
                     TLLM_AFFINITY_STEP_CORE=<cpu>",
                    s.cpus,
                    mine.len()
                )),
            };
            GpuPlacement {
                placement,
                ..placed
            }
        })
        .collect()
}

/// The CPUs slices divide: the cpuset's online CPUs (what a worker mask is bounded by).
pub fn slice_allowed(topology: &Topology, cpuset: &CpuMask) -> CpuMask {
    cpuset.intersection(&topology.online)
}

/// `auto` for every GPU: sliced when `slices` is given (slicing on), else SPEC §6 as is.
pub fn step_placements(
    topology: &Topology,
    allowed: &CpuMask,
    slices: Option<&[GpuSlice]>,
) -> Vec<GpuPlacement> {
    match slices {
        Some(slices) => auto_placement_sliced(topology, allowed, slices),
        None => auto_placement(topology, allowed),
    }
}

/// A GPU's (step core, result core) as indices into the allowed cores, or why it has none.
type Picked = Result<(usize, usize), String>;

/// Ranks `gpus` in `pool` (core indices, ascending): step core from the bottom, result core from
/// the top, or for all of them the reason the pool is too small.
fn pick(pool: &[usize], gpus: &[usize], pool_name: &str, whose: &str) -> Vec<(usize, Picked)> {
    if pool.len() < 2 * gpus.len() {
        let reason = format!(
            "{pool_name} has {} allowed core(s) for the {} GPU(s) {whose}, and each GPU needs two \
             (a step core and a result core); nothing wraps, so none of them is pinned: widen \
             the mask or name a CPU with TLLM_AFFINITY_STEP_CORE=<cpu>",
            pool.len(),
            gpus.len(),
        );
        return gpus.iter().map(|&g| (g, Err(reason.clone()))).collect();
    }
    gpus.iter()
        .enumerate()
        .map(|(rank, &g)| (g, Ok((pool[rank], pool[pool.len() - 1 - rank]))))
        .collect()
}

fn to_placement(
    cores: &[(CpuMask, Option<usize>)],
    (step, result): (usize, usize),
    gpus: &[usize],
    pool_name: &str,
    g: usize,
) -> StepPlacement {
    let rank = gpus.iter().position(|&x| x == g).unwrap_or(0);
    StepPlacement {
        step: cores[step].0.clone(),
        result: cores[result].0.first(),
        why: format!(
            "rank {rank} of {} GPU(s) picking from {pool_name}: step core from the bottom, \
             result core from the top",
            gpus.len()
        ),
    }
}

/// SPEC §6 `<cpu>`: the step thread on `cpu`'s core (its siblings within `allowed`), the result
/// thread on the lowest allowed CPU of the next allowed core (cores ordered by their lowest CPU),
/// wrapping to the lowest core when `cpu`'s core is the highest (so an operator who names the last
/// core still gets a result CPU). `Err` when `cpu` is not allowed.
pub fn explicit_placement(
    topology: &Topology,
    allowed: &CpuMask,
    cpu: usize,
) -> Result<StepPlacement, String> {
    if !allowed.contains(cpu) {
        return Err(format!(
            "TLLM_AFFINITY_STEP_CORE={cpu}: CPU {cpu} is outside the allowed CPUs [{allowed}]"
        ));
    }
    let cores = allowed_cores(topology, allowed);
    let mine = cores.iter().position(|(core, _)| core.contains(cpu));
    let step = match mine {
        Some(i) => cores[i].0.clone(),
        // A CPU the topology does not list (an odd sysfs tree) is its own core.
        None => CpuMask::from_cpus([cpu]),
    };
    let others: Vec<&CpuMask> = cores
        .iter()
        .map(|(core, _)| core)
        .filter(|core| !core.contains(cpu) && core.intersection(&step).is_empty())
        .collect();
    let result = others
        .iter()
        .find(|core| core.first() > step.first())
        .or_else(|| others.first())
        .and_then(|core| core.first());
    Ok(StepPlacement {
        step,
        result,
        why: format!("step thread on CPU {cpu}'s core, result thread on the next allowed core"),
    })
}

/// Thread-pool sizes from the CPUs the pinned threads leave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSizes {
    /// CPUs of the worker set with no step or result thread of this GPU on them: where the
    /// worker's pools (intra-op threads, data loaders) run without queueing behind the pinned
    /// threads.
    pub worker_cpus: usize,
    /// Allowed CPUs with no step or result thread of any GPU on them (under `auto`, every GPU of
    /// the host; under `<cpu>`, this process's): the share a pool sized for the whole process
    /// (an API server's) should stay within.
    pub free_cpus: usize,
    /// `floor(quota / period)` when a cgroup CPU quota is set: how many CPUs' worth of time the
    /// process gets, whatever its mask allows. `None` without a quota.
    pub quota_cpus: Option<usize>,
    /// The thread count to size a worker pool with: `worker_cpus`, capped by `quota_cpus` less
    /// the CPUs the pinned step and result threads keep busy (one each), and at least 1.
    pub worker_threads: usize,
}

/// The whole plan for one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuPlan {
    pub gpu_index: usize,
    pub address: String,
    pub process_mask: CpuMask,
    pub cpuset: CpuMask,
    /// Process mask ∩ cpuset ∩ online CPUs.
    pub allowed: CpuMask,
    pub quota: Option<CpuQuota>,
    /// The worker set `configure` applies ([`policy::worker_set`]): `None` when the policy keeps
    /// the workers' masks, or when nothing can be pinned (`decision.empty_reason` says why).
    pub worker: Option<CpuMask>,
    pub decision: Decision,
    /// The process mask is narrower than the cpuset ([`policy::is_constrained`]).
    pub constrained: bool,
    pub worker_source: LocalCpuSource,
    pub step_core: StepCore,
    /// This GPU's step and result CPUs under `step_core` (`Err` with the reason when none, or
    /// when the setting is off).
    pub placement: Result<StepPlacement, String>,
    /// `auto` for every GPU of the host, whatever `step_core` is: what servers on the other GPUs
    /// would take.
    pub all_gpus: Vec<GpuPlacement>,
    /// `TLLM_AFFINITY_SLICE` (SPEC §18) applies: on, and no `TLLM_AFFINITY_CPUS`.
    pub slicing: bool,
    /// Under slicing, this GPU's worker base: its slice, or its whole set with the warning why.
    pub slice: Option<WorkerBase>,
    /// Every GPU's slice, in the order of `topology.gpus`, whether slicing is on or not (what
    /// `TLLM_AFFINITY_SLICE=gpu` gives).
    pub all_slices: Vec<GpuSlice>,
    pub pools: PoolSizes,
}

/// What [`plan`] needs; the caller reads the masks and the quota.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub topology: &'a Topology,
    pub process_mask: &'a CpuMask,
    pub cpuset: &'a CpuMask,
    pub quota: Option<CpuQuota>,
    pub step_core: StepCore,
    /// Index into `topology.gpus` (the resolved device).
    pub gpu_index: usize,
    /// NVML's CPU affinity for that GPU, when NVML answered ([`Topology::local_cpus`]).
    pub nvml_cpus: Option<&'a CpuMask>,
    /// The policy settings the process would run with.
    pub settings: &'a Settings,
}

pub fn plan(input: &PlanInput<'_>) -> CpuPlan {
    let topology = input.topology;
    let allowed = input
        .process_mask
        .intersection(input.cpuset)
        .intersection(&topology.online);
    let gpu = &topology.gpus[input.gpu_index];
    let local = topology.local_cpus(Some(gpu), input.nvml_cpus);
    let constrained = policy::is_constrained(input.process_mask, input.cpuset);
    let sliceable = slice_allowed(topology, input.cpuset);
    let all_slices = slice::slices(topology, &sliceable);
    let slicing = input.settings.slice == SliceMode::Gpu && input.settings.cpus_override.is_none();
    let slice =
        slicing.then(|| slice::worker_base(&all_slices, &sliceable, &gpu.address, &local.cpus));
    let base = slice.as_ref().map_or(&local.cpus, |s| &s.cpus);
    let decision = policy::worker_set(input.settings, base, constrained, input.cpuset);
    let worker = decision.mask.clone();
    // Pools are sized on where the workers run: their set, or, when the policy keeps their masks,
    // the CPUs the process may use.
    let worker_cpus_of = worker.clone().unwrap_or_else(|| allowed.clone());
    let all_gpus = step_placements(topology, &allowed, slicing.then_some(&all_slices[..]));
    let placement = match input.step_core {
        StepCore::Off => Err("TLLM_AFFINITY_STEP_CORE is off: nothing pinned".to_string()),
        StepCore::Auto => all_gpus[input.gpu_index].placement.clone(),
        StepCore::Cpu(cpu) => explicit_placement(topology, &allowed, cpu),
    };

    let pinned_of = |p: &StepPlacement| {
        let mut cpus = p.step.clone();
        if let Some(r) = p.result {
            cpus.insert(r);
        }
        cpus
    };
    let mine = placement.as_ref().map(pinned_of).unwrap_or_default();
    let everyone = match input.step_core {
        StepCore::Auto => all_gpus
            .iter()
            .filter_map(|g| g.placement.as_ref().ok())
            .fold(CpuMask::new(), |acc, p| acc.union(&pinned_of(p))),
        _ => mine.clone(),
    };
    let worker_cpus = worker_cpus_of.difference(&mine).count();
    let quota_cpus = input.quota.map(|q| q.cpus().floor() as usize);
    let busy = placement
        .as_ref()
        .map_or(0, |p| 1 + usize::from(p.result.is_some()));
    let worker_threads = quota_cpus
        .map_or(worker_cpus, |q| worker_cpus.min(q.saturating_sub(busy)))
        .max(1);
    CpuPlan {
        gpu_index: input.gpu_index,
        address: gpu.address.clone(),
        process_mask: input.process_mask.clone(),
        cpuset: input.cpuset.clone(),
        pools: PoolSizes {
            worker_cpus,
            free_cpus: allowed.difference(&everyone).count(),
            quota_cpus,
            worker_threads,
        },
        allowed,
        quota: input.quota,
        worker,
        decision,
        constrained,
        worker_source: local.source,
        step_core: input.step_core,
        placement,
        all_gpus,
        slicing,
        slice,
        all_slices,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::simulated::{dgx_h100_like, single_node_vm};

    use crate::mask::mask;

    /// Every placed GPU's CPUs (step and result), and the reasons of the others.
    fn placed(all: &[GpuPlacement]) -> Vec<Option<(CpuMask, usize)>> {
        all.iter()
            .map(|g| {
                g.placement
                    .as_ref()
                    .ok()
                    .map(|p| (p.step.clone(), p.result.unwrap()))
            })
            .collect()
    }

    /// `auto_placement` within `allowed` on `t`, checked by [`assert_disjoint`], with what
    /// [`placed`] makes of it.
    fn placed_within(
        t: &Topology,
        allowed: &str,
    ) -> (Vec<GpuPlacement>, Vec<Option<(CpuMask, usize)>>) {
        let allowed = mask(allowed);
        let all = auto_placement(t, &allowed);
        assert_disjoint(t, &allowed, &all);
        let p = placed(&all);
        (all, p)
    }

    /// No CPU belongs to two GPUs, every CPU is allowed, and step and result sit on different
    /// cores.
    fn assert_disjoint(t: &Topology, allowed: &CpuMask, all: &[GpuPlacement]) {
        let mut seen = CpuMask::new();
        for (g, p) in placed(all).into_iter().enumerate() {
            let Some((step, result)) = p else { continue };
            assert!(!step.is_empty());
            assert!(step.is_subset(allowed), "GPU {g}: step {step} not allowed");
            assert!(
                allowed.contains(result),
                "GPU {g}: result {result} not allowed"
            );
            let step_core = t
                .cpus
                .iter()
                .find(|c| c.id == step.first().unwrap())
                .unwrap();
            assert!(
                !step_core.siblings.contains(result),
                "GPU {g}: result on step core"
            );
            let core = |cpu: usize| {
                t.cpus
                    .iter()
                    .find(|c| c.id == cpu)
                    .unwrap()
                    .siblings
                    .clone()
            };
            let mut cpus = core(step.first().unwrap()).intersection(allowed);
            cpus = cpus.union(&core(result).intersection(allowed));
            assert!(
                seen.intersection(&cpus).is_empty(),
                "GPU {g}: {cpus} collides with {seen}"
            );
            seen = seen.union(&cpus);
        }
    }

    #[test]
    fn dgx_full_mask_every_gpu_gets_its_own_cores() {
        let t = dgx_h100_like().topology();
        let (all, p) = placed_within(&t, "0-223");
        assert_eq!(all.len(), 8);
        assert_eq!(p[0], Some((mask("0,112"), 55)));
        assert_eq!(p[1], Some((mask("1,113"), 54)));
        assert_eq!(p[3], Some((mask("3,115"), 52)));
        assert_eq!(p[4], Some((mask("56,168"), 111)));
        assert_eq!(p[7], Some((mask("59,171"), 108)));
        assert!(all[0]
            .placement
            .as_ref()
            .unwrap()
            .why
            .contains("NUMA node 0"));
    }

    #[test]
    fn dgx_taskset_half_of_each_socket() {
        let t = dgx_h100_like().topology();
        // Cores 0-27 and 56-83 with their siblings, as `taskset -c` would give a half host.
        let (_, p) = placed_within(&t, "0-27,56-83,112-139,168-195");
        assert!(p.iter().all(Option::is_some));
        assert_eq!(p[0], Some((mask("0,112"), 27)));
        assert_eq!(p[4], Some((mask("56,168"), 83)));
        assert_eq!(p[7], Some((mask("59,171"), 80)));
    }

    #[test]
    fn dgx_with_one_sibling_per_core_pins_single_cpus() {
        let t = dgx_h100_like().topology();
        let (_, p) = placed_within(&t, "0-111");
        assert_eq!(p[0], Some((mask("0"), 55)));
    }

    #[test]
    fn dgx_node_1_without_allowed_cpus_ranks_its_gpus_in_what_node_0_leaves() {
        let t = dgx_h100_like().topology();
        let (all, p) = placed_within(&t, "0-55,112-167");
        assert_eq!(p[0], Some((mask("0,112"), 55)));
        assert_eq!(p[3], Some((mask("3,115"), 52)));
        // GPUs 4-7 rank among themselves in cores 4-51.
        assert_eq!(p[4], Some((mask("4,116"), 51)));
        assert_eq!(p[7], Some((mask("7,119"), 48)));
        let why = &all[4].placement.as_ref().unwrap().why;
        assert!(why.contains("node-local GPUs leave"), "{why}");
    }

    #[test]
    fn a_mask_too_small_pins_nothing_rather_than_wrapping() {
        let t = dgx_h100_like().topology();
        // 8 cores on node 0 (enough for its 4 GPUs), 6 on node 1 (not enough for 4).
        let (all, p) = placed_within(&t, "0-7,56-61");
        assert!(p[..4].iter().all(Option::is_some));
        for g in &all[4..] {
            let reason = g.placement.as_ref().unwrap_err();
            assert!(
                reason.contains("NUMA node 1 has 6 allowed core(s)"),
                "{reason}"
            );
            assert!(reason.contains("4 GPU(s)"), "{reason}");
            assert!(reason.contains("needs two"), "{reason}");
        }
        // 7 cores on node 0 and none on node 1: nobody is placed, nobody wraps.
        let (all, p) = placed_within(&t, "0-6");
        assert!(p.iter().all(Option::is_none));
        let reason = all[5].placement.as_ref().unwrap_err();
        assert!(reason.contains("node-local GPUs leave has 7"), "{reason}");
        assert!(reason.contains("without an allowed CPU"), "{reason}");
        // Exactly two cores per GPU is enough.
        let (_, p) = placed_within(&t, "0-7");
        assert_eq!(p[0], Some((mask("0"), 7)));
        assert_eq!(p[3], Some((mask("3"), 4)));
        assert!(p[4..].iter().all(Option::is_none));
    }

    /// Random masks on the DGX shape: whatever is placed never collides and never leaves the
    /// mask.
    #[test]
    fn random_masks_never_collide() {
        let t = dgx_h100_like().topology();
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..100 {
            let density = next() % 100;
            let allowed: CpuMask = (0..224).filter(|_| next() % 100 < density).collect();
            let all = auto_placement(&t, &allowed);
            assert_disjoint(&t, &allowed, &all);
        }
    }

    /// Under slicing each GPU's step core is the bottom core of its own slice and its result CPU
    /// the top one; where a slice holds fewer than two allowed cores nothing is pinned, and a
    /// GPU that keeps its whole set is placed as without slicing.
    #[test]
    fn sliced_step_and_result_cores_come_from_each_gpus_slice() {
        let t = dgx_h100_like().topology();
        let all = crate::placement::slice::slices(&t, &t.online);
        let sliced = auto_placement_sliced(&t, &mask("0-223"), &all);
        assert_disjoint(&t, &mask("0-223"), &sliced);
        let p = placed(&sliced);
        assert_eq!(p[0], Some((mask("0,112"), 13)));
        assert_eq!(p[1], Some((mask("14,126"), 27)));
        assert_eq!(p[7], Some((mask("98,210"), 111)));
        let why = &sliced[1].placement.as_ref().unwrap().why;
        assert!(why.contains("slice [14-27,126-139]"), "{why}");
        // A process mask holding one core of GPU 1's slice: GPU 1 pins nothing, never wraps.
        let allowed = mask("0-14,28-125,140-223");
        let sliced = auto_placement_sliced(&t, &allowed, &all);
        let reason = sliced[1].placement.as_ref().unwrap_err();
        assert!(reason.contains("1 allowed core(s)"), "{reason}");
        assert_eq!(placed(&sliced)[2], Some((mask("28,140"), 41)));
        // Two CPUs for two GPUs: too small to slice, so §6's own rule answers (and it too
        // places nobody: two cores for two GPUs).
        let t = single_node_vm(2, 2).topology();
        let all = crate::placement::slice::slices(&t, &t.online);
        assert_eq!(
            auto_placement_sliced(&t, &mask("0-1"), &all),
            auto_placement(&t, &mask("0-1"))
        );
    }

    #[test]
    fn single_node_vm_without_numa() {
        let t = single_node_vm(8, 2).topology();
        let (_, p) = placed_within(&t, "0-7");
        assert_eq!(p[0], Some((mask("0"), 7)));
        assert_eq!(p[1], Some((mask("1"), 6)));
        // Three cores for two GPUs: neither is pinned.
        let (_, p) = placed_within(&t, "0-2");
        assert!(p.iter().all(Option::is_none));
    }

    #[test]
    fn a_gpu_with_numa_node_minus_one_takes_what_node_local_gpus_leave() {
        let host = dgx_h100_like().gpu("0000:e0:00.0", None, None);
        let t = host.topology();
        assert_eq!(t.gpus[8].numa_node, None);
        // Node-local GPUs keep their cores; the unknown one ranks 0 of 1 in the leftover cores
        // (4-51 and 60-107 of the two nodes): bottom core 4, top core 107.
        let (_, p) = placed_within(&t, "0-223");
        assert_eq!(p[0], Some((mask("0,112"), 55)));
        assert_eq!(p[8], Some((mask("4,116"), 107)));
    }

    #[test]
    fn two_processes_on_one_gpu_compute_the_same_cpus() {
        // The plan is a function of the host and the mask only: a second server (or a second
        // worker of a split configuration) on the same GPU gets the same CPUs, which is why
        // `auto` takes the per-GPU lock (tested in tests/step_threads.rs).
        let t = dgx_h100_like().topology();
        let allowed = mask("0-223");
        assert_eq!(auto_placement(&t, &allowed), auto_placement(&t, &allowed));
    }

    #[test]
    fn explicit_cpu_pins_its_core_and_the_next_core() {
        let t = dgx_h100_like().topology();
        let allowed = mask("0-223");
        let p = explicit_placement(&t, &allowed, 5).unwrap();
        assert_eq!((p.step, p.result), (mask("5,117"), Some(6)));
        // Naming the second sibling gives the same core.
        let p = explicit_placement(&t, &allowed, 117).unwrap();
        assert_eq!((p.step, p.result), (mask("5,117"), Some(6)));
        // Only the allowed sibling, and the next allowed core.
        let p = explicit_placement(&t, &mask("5,8-9"), 5).unwrap();
        assert_eq!((p.step, p.result), (mask("5"), Some(8)));
        // The highest core wraps to the lowest.
        let p = explicit_placement(&t, &mask("3,7,119"), 119).unwrap();
        assert_eq!((p.step, p.result), (mask("7,119"), Some(3)));
        // One core only: no result CPU.
        let p = explicit_placement(&t, &mask("7,119"), 7).unwrap();
        assert_eq!(p.result, None);
        let e = explicit_placement(&t, &mask("0-3"), 9).unwrap_err();
        assert!(e.contains("CPU 9") && e.contains("[0-3]"), "{e}");
    }

    #[test]
    fn the_plan_for_one_gpu_with_pools_and_quota() {
        let t = dgx_h100_like().topology();
        let process_mask = mask("0-223");
        let cpuset = mask("0-223");
        let settings = Settings::default();
        let input = PlanInput {
            topology: &t,
            process_mask: &process_mask,
            cpuset: &cpuset,
            quota: None,
            step_core: StepCore::Auto,
            gpu_index: 0,
            nvml_cpus: None,
            settings: &settings,
        };
        let p = plan(&input);
        assert_eq!(p.address, "0000:18:00.0");
        assert_eq!(p.worker, Some(mask("0-55,112-167")));
        assert_eq!(
            (p.decision.rule, p.constrained),
            (policy::Rule::Numa, false)
        );
        assert_eq!(p.worker_source, LocalCpuSource::PciLocalCpulist);
        let placed = p.placement.as_ref().unwrap();
        assert_eq!(
            (placed.step.clone(), placed.result),
            (mask("0,112"), Some(55))
        );
        // 112 worker CPUs less the step core's two and the result CPU.
        assert_eq!(p.pools.worker_cpus, 109);
        // 8 GPUs × 3 CPUs pinned host-wide.
        assert_eq!(p.pools.free_cpus, 224 - 24);
        assert_eq!(p.pools.quota_cpus, None);
        assert_eq!(p.pools.worker_threads, 109);

        // A 6.5-CPU quota: 6 CPUs' worth, less the two pinned threads.
        let quota = CpuQuota {
            quota_us: 650_000,
            period_us: 100_000,
        };
        let p = plan(&PlanInput {
            quota: Some(quota),
            ..input.clone()
        });
        assert_eq!(p.pools.quota_cpus, Some(6));
        assert_eq!(p.pools.worker_threads, 4);

        // Off: nothing pinned, the whole worker set is the pool.
        let p = plan(&PlanInput {
            step_core: StepCore::Off,
            ..input.clone()
        });
        assert!(p.placement.is_err());
        assert_eq!(p.pools.worker_cpus, 112);
        assert_eq!(p.pools.free_cpus, 224);

        // A cpuset narrower than the mask: allowed is their intersection.
        let cpuset = mask("56-111,168-223");
        let p = plan(&PlanInput {
            cpuset: &cpuset,
            gpu_index: 4,
            ..input.clone()
        });
        assert_eq!(p.allowed, cpuset);
        assert_eq!(p.worker, Some(cpuset.clone()));
        assert!(p.all_gpus[0].placement.is_ok());

        // <cpu> mode.
        let p = plan(&PlanInput {
            step_core: StepCore::Cpu(10),
            ..input
        });
        let placed = p.placement.as_ref().unwrap();
        assert_eq!(
            (placed.step.clone(), placed.result),
            (mask("10,122"), Some(11))
        );
        assert_eq!(p.pools.free_cpus, 221);
    }

    #[test]
    fn quota_below_the_pinned_threads_still_leaves_one_worker_thread() {
        let t = single_node_vm(4, 1).topology();
        let all = mask("0-3");
        let p = plan(&PlanInput {
            topology: &t,
            process_mask: &all,
            cpuset: &all,
            quota: Some(CpuQuota {
                quota_us: 150_000,
                period_us: 100_000,
            }),
            step_core: StepCore::Auto,
            gpu_index: 0,
            nvml_cpus: None,
            settings: &Settings::default(),
        });
        assert_eq!(p.pools.quota_cpus, Some(1));
        assert_eq!(p.pools.worker_cpus, 2);
        assert_eq!(p.pools.worker_threads, 1);
    }

    /// A GPU without a node whose `local_cpulist` names every CPU: the plan's worker set is
    /// NVML's CPU affinity when the caller has it, every CPU without.
    #[test]
    fn nvml_affinity_is_the_worker_set_of_a_gpu_sysfs_knows_no_node_for() {
        let t = dgx_h100_like().gpu("000f:01:00.0", None, None).topology();
        let index = t
            .gpus
            .iter()
            .position(|g| g.address == "000f:01:00.0")
            .unwrap();
        let node1 = t.node(1).unwrap().cpus.clone();
        let input = PlanInput {
            topology: &t,
            process_mask: &t.online,
            cpuset: &t.online,
            quota: None,
            step_core: StepCore::Auto,
            gpu_index: index,
            nvml_cpus: Some(&node1),
            settings: &Settings::default(),
        };
        let p = plan(&input);
        assert_eq!(p.worker, Some(node1.clone()));
        assert_eq!(p.worker_source, LocalCpuSource::NvmlAffinity);
        let p = plan(&PlanInput {
            nvml_cpus: None,
            ..input
        });
        assert_eq!(p.worker, Some(t.online.clone()));
        assert_eq!(p.worker_source, LocalCpuSource::PciLocalCpulist);
    }
}
