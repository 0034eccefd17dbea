//! The policy table of SPEC §3: which mask worker threads get, decided in one place.

use crate::mask::CpuMask;
use crate::placement::settings::{NumaAwareFlag, PolicyChoice, Settings};

/// What the table says to do with worker threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// The GPU-local (NUMA-aware) set.
    Numa,
    /// Every CPU the cpuset allows (the dist-serving fix for constrained processes).
    Clear,
    /// Leave worker masks as they are; roles are still tracked.
    Keep,
}

/// Everything the table looks at.
#[derive(Debug, Clone)]
pub struct PolicyInput<'a> {
    pub choice: Option<PolicyChoice>,
    pub numa_flag: &'a NumaAwareFlag,
    /// The mask captured at load is narrower than the cpuset (see [`is_constrained`]).
    pub constrained: bool,
    pub gpu_local: &'a CpuMask,
    /// `gpu_local` is the user's own list (`TLLM_AFFINITY_CPUS`), not the GPU's CPUs.
    pub gpu_local_named: bool,
    pub cpuset: &'a CpuMask,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub rule: Rule,
    /// The worker mask, already intersected with the cpuset; `None` pins nothing.
    pub mask: Option<CpuMask>,
    /// Why nothing is pinned when `mask` is `None` under `Numa` or `Clear`.
    pub empty_reason: Option<String>,
}

/// SPEC §3: the process is constrained when the mask captured at load, before the library
/// changed anything, is narrower than what its cpuset allows. Judging on the load-time mask is
/// what keeps our own placement from ever reading as an external constraint.
pub fn is_constrained(mask_at_load: &CpuMask, cpuset: &CpuMask) -> bool {
    mask_at_load.intersection(cpuset).is_narrower_than(cpuset)
}

/// The table: `TLLM_AFFINITY_POLICY` first, else `TLLM_NUMA_AWARE_WORKER_AFFINITY` with the
/// inference server's meanings (unset: NUMA unless constrained, then clear; `1`: NUMA; any other
/// value: keep).
pub fn rule_for(choice: Option<PolicyChoice>, flag: &NumaAwareFlag, constrained: bool) -> Rule {
    match choice {
        Some(PolicyChoice::Numa) => Rule::Numa,
        Some(PolicyChoice::Clear) => Rule::Clear,
        Some(PolicyChoice::Keep) => Rule::Keep,
        Some(PolicyChoice::Auto) | None => match flag {
            NumaAwareFlag::Unset if constrained => Rule::Clear,
            NumaAwareFlag::Unset | NumaAwareFlag::One => Rule::Numa,
            NumaAwareFlag::Other(_) => Rule::Keep,
        },
    }
}

pub fn decide(input: &PolicyInput<'_>) -> Decision {
    let rule = rule_for(input.choice, input.numa_flag, input.constrained);
    let wanted = match rule {
        Rule::Numa => input.gpu_local.intersection(input.cpuset),
        Rule::Clear => input.cpuset.clone(),
        Rule::Keep => {
            return Decision {
                rule,
                mask: None,
                empty_reason: None,
            }
        }
    };
    if wanted.is_empty() {
        let reason = match rule {
            Rule::Numa if input.gpu_local_named => format!(
                "TLLM_AFFINITY_CPUS [{}] names no CPU this process may use (its cpuset allows \
                 [{}])",
                input.gpu_local, input.cpuset
            ),
            Rule::Numa => format!(
                "the GPU-local CPUs [{}] and the cpuset [{}] have no CPU in common",
                input.gpu_local, input.cpuset
            ),
            _ => "the cpuset allows no CPU".to_string(),
        };
        return Decision {
            rule,
            mask: None,
            empty_reason: Some(reason),
        };
    }
    Decision {
        rule,
        mask: Some(wanted),
        empty_reason: None,
    }
}

/// The worker set a `configure` applies: the settings (`TLLM_AFFINITY_POLICY`,
/// `TLLM_NUMA_AWARE_WORKER_AFFINITY`, `TLLM_AFFINITY_CPUS`), the device's GPU-local CPUs, and
/// what the process was at load (constrained, its cpuset). The engine and `tllm-affinity plan`
/// both ask this, so the plan shows the mask `configure` applies.
pub fn worker_set(
    settings: &Settings,
    gpu_local: &CpuMask,
    constrained: bool,
    cpuset: &CpuMask,
) -> Decision {
    decide(&PolicyInput {
        choice: settings.policy,
        numa_flag: &settings.numa_aware,
        constrained,
        gpu_local: settings.cpus_override.as_ref().unwrap_or(gpu_local),
        gpu_local_named: settings.cpus_override.is_some(),
        cpuset,
    })
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Rule::Numa => "numa",
            Rule::Clear => "clear",
            Rule::Keep => "keep",
        }
    }
}

/// The NUMA node of a worker's memory: the node a worker scope's caller prefers while the scope
/// is open (the engine's `memory_preference`), and the node a dedicated worker's pages move to
/// (`memory_decision`). `memory_nodes` are the host's nodes with memory, with their CPUs; the
/// answer is the one among them that the worker mask lies on, and `None` on a host of one node
/// or a mask that spans several (no single node to prefer).
pub fn worker_memory_node(
    memory_nodes: &[(usize, CpuMask)],
    worker_mask: &CpuMask,
) -> Option<usize> {
    if memory_nodes.len() < 2 || worker_mask.is_empty() {
        return None;
    }
    let mut on = memory_nodes
        .iter()
        .filter(|(_, cpus)| !cpus.intersection(worker_mask).is_empty());
    match (on.next(), on.next()) {
        (Some((node, _)), None) => Some(*node),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> CpuMask {
        CpuMask::parse_list(s).unwrap()
    }

    #[test]
    fn the_table_row_by_row() {
        let unset = NumaAwareFlag::Unset;
        let one = NumaAwareFlag::One;
        let other = NumaAwareFlag::Other("0".into());
        assert_eq!(rule_for(None, &unset, false), Rule::Numa);
        assert_eq!(rule_for(None, &unset, true), Rule::Clear);
        assert_eq!(rule_for(None, &one, false), Rule::Numa);
        assert_eq!(rule_for(None, &one, true), Rule::Numa);
        assert_eq!(rule_for(None, &other, false), Rule::Keep);
        assert_eq!(rule_for(None, &other, true), Rule::Keep);
        assert_eq!(
            rule_for(Some(PolicyChoice::Auto), &unset, true),
            Rule::Clear
        );
        assert_eq!(rule_for(Some(PolicyChoice::Keep), &one, false), Rule::Keep);
        assert_eq!(rule_for(Some(PolicyChoice::Numa), &other, true), Rule::Numa);
        assert_eq!(
            rule_for(Some(PolicyChoice::Clear), &unset, false),
            Rule::Clear
        );
    }

    #[test]
    fn constrained_is_judged_against_the_cpuset() {
        assert!(is_constrained(&m("0"), &m("0-1")));
        assert!(!is_constrained(&m("0-1"), &m("0-1")));
        // A container limited by its cpuset is not constrained.
        assert!(!is_constrained(&m("0-3"), &m("0-3")));
    }

    #[test]
    fn worker_masks_are_intersected_with_the_cpuset() {
        let decide_numa = |gpu_local: &str, gpu_local_named: bool, cpuset: &str| {
            decide(&PolicyInput {
                choice: None,
                numa_flag: &NumaAwareFlag::One,
                constrained: false,
                gpu_local: &m(gpu_local),
                gpu_local_named,
                cpuset: &m(cpuset),
            })
        };
        let d = decide_numa("0-7", false, "4-11");
        assert_eq!(d.mask, Some(m("4-7")));
        let d = decide_numa("0-3", false, "4-11");
        assert_eq!(d.mask, None);
        assert!(d.empty_reason.unwrap().contains("no CPU in common"));
        // The user's own list is called by its name, never "the GPU-local CPUs".
        let d = decide_numa("32-63", true, "0-1");
        let reason = d.empty_reason.unwrap();
        assert!(reason.starts_with("TLLM_AFFINITY_CPUS [32-63]"), "{reason}");
        assert!(!reason.contains("GPU-local"), "{reason}");
    }

    #[test]
    fn a_workers_memory_node_is_the_one_node_the_worker_mask_lies_on() {
        let m = |l: &str| CpuMask::parse_list(l).unwrap();
        let two = [(0, m("0-1")), (1, m("2-3"))];
        assert_eq!(worker_memory_node(&two, &m("2-3")), Some(1));
        assert_eq!(worker_memory_node(&two, &m("3")), Some(1));
        assert_eq!(worker_memory_node(&two, &m("1-2")), None, "spans two nodes");
        assert_eq!(worker_memory_node(&two, &CpuMask::default()), None);
        assert_eq!(worker_memory_node(&two[..1], &m("0-1")), None, "one node");
        // A memory-only node has no CPUs: never the one the mask lies on.
        let gb200 = [(0, m("0-3")), (1, CpuMask::default())];
        assert_eq!(worker_memory_node(&gb200, &m("0-3")), Some(0));
    }
}
