//! `tllm-affinity plan --gpu N [--json]`: the CPU plan of [`tllm_affinity_core::placement::plan`] for one GPU, with the
//! `auto` step and result CPUs of every GPU of the host.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use tllm_affinity_core::host::cgroup;
use tllm_affinity_core::host::topology::Topology;
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::placement::device::{resolve_device_on, DeviceEnv};
use tllm_affinity_core::placement::plan::{self, CpuPlan, GpuPlacement, PlanInput, StepPlacement};
use tllm_affinity_core::placement::settings::{Settings, StepCore};
use tllm_affinity_core::placement::slice::GpuSlice;

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// CUDA device number (as `configure` takes it; -1: TLLM_AFFINITY_GPU, else the local rank).
    #[arg(long, allow_negative_numbers = true)]
    pub gpu: i32,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Read sysfs under this directory (default: TLLM_AFFINITY_SYSFS_ROOT, else /).
    #[arg(long)]
    pub sysfs_root: Option<PathBuf>,
    /// A cpulist to use as the process mask instead of the real one, for what-if plans.
    #[arg(long)]
    pub cpus: Option<String>,
}

/// Where the step-core setting shown came from.
enum StepCoreSource {
    Env,
    /// Unset: the library pins nothing by default, the plan shows what `auto` would do.
    WhatIf,
}

pub fn run(args: &PlanArgs) -> Result<(), String> {
    let root = crate::sysfs_root(args.sysfs_root.as_deref());
    let mut topology = Topology::read(&root).map_err(|e| e.to_string())?;
    // Slices follow the cache domains; they are shown whether slicing is on or not.
    topology.read_llc_domains(&root);
    // The list configure numbers into (NVML, the driver's list, sysfs), its GPUs laid into the
    // topology, so plan finds every GPU configure finds.
    let view = tllm_affinity_core::host::gpus::current_view(&root, &mut topology, true);
    if topology.gpus.is_empty() && args.gpu >= -1 {
        return Err(format!(
            "{} (looked under {})",
            super::NO_GPU_HINT,
            root.path("sys/bus/pci/devices").display()
        ));
    }
    let resolved = resolve_device_on(args.gpu, &DeviceEnv::from_env(), &view, &root)
        .map_err(|e| e.to_string())?;
    // The plan is laid over sysfs's GPUs (the whole host); NVML or the driver picked which.
    let gpu_index = topology
        .gpus
        .iter()
        .position(|g| g.address == resolved.address)
        .ok_or_else(|| {
            format!(
                "{}: sysfs under {root} does not list {}, so there is no plan for it",
                resolved.how, resolved.address
            )
        })?;
    let process_mask = match &args.cpus {
        Some(list) => match CpuMask::parse_list(list) {
            Ok(m) if !m.is_empty() => m,
            Ok(_) => return Err(format!("--cpus '{list}': expected a non-empty cpulist")),
            Err(e) => return Err(format!("--cpus: {e}")),
        },
        None => crate::process_mask()?,
    };
    // The cgroup describes this machine; a simulated tree describes another one, whose cpuset is
    // taken as all its online CPUs, with no quota.
    let real_host = root.root() == Path::new("/");
    let (cpuset, quota) = if real_host {
        let limits = cgroup::read_limits();
        (limits.cpuset_within(&topology.online), limits.quota)
    } else {
        (topology.online.clone(), None)
    };
    let (step_core, source) = step_core_from_env()?;
    // The policy as the library would read it in a process started here, malformed values at
    // their defaults (the library itself would say so at load, and stay passive).
    let (settings, _) = Settings::from_env();
    let plan = plan::plan(&PlanInput {
        topology: &topology,
        process_mask: &process_mask,
        cpuset: &cpuset,
        quota,
        step_core,
        gpu_index,
        nvml_cpus: view.gpus[resolved.gpu_index].nvml_cpus.as_ref(),
        settings: &settings,
    });
    let context = Context {
        device: args.gpu,
        how: &resolved.how,
        gpu_source: view.source.to_string(),
        mask_from: if args.cpus.is_some() {
            "--cpus"
        } else {
            "this process's mask"
        },
        cpuset_from: if real_host {
            "the cgroup cpuset"
        } else {
            "the simulated host's online CPUs; no cgroup"
        },
        source,
        topology: &topology,
    };
    if args.json {
        let text = crate::json::pretty(&to_json(&plan, &context))?;
        println!("{text}");
    } else {
        print!("{}", to_text(&plan, &context));
    }
    Ok(())
}

fn step_core_from_env() -> Result<(StepCore, StepCoreSource), String> {
    let value = std::env::var("TLLM_AFFINITY_STEP_CORE").ok();
    let Some(value) = value.filter(|v| !v.trim().is_empty()) else {
        return Ok((StepCore::Auto, StepCoreSource::WhatIf));
    };
    let (settings, errors) =
        Settings::from_lookup(|name| (name == "TLLM_AFFINITY_STEP_CORE").then(|| value.clone()));
    match errors.first() {
        Some(e) => Err(e.to_string()),
        None => Ok((settings.step_core, StepCoreSource::Env)),
    }
}

struct Context<'a> {
    device: i32,
    how: &'a str,
    /// Which list the CUDA number was resolved in (NVML, the driver's, sysfs).
    gpu_source: String,
    mask_from: &'a str,
    cpuset_from: &'a str,
    source: StepCoreSource,
    topology: &'a Topology,
}

fn setting_text(step_core: StepCore) -> String {
    match step_core {
        StepCore::Off => "off".to_string(),
        StepCore::Auto => "auto".to_string(),
        StepCore::Cpu(cpu) => cpu.to_string(),
    }
}

fn setting_note(source: &StepCoreSource) -> &'static str {
    match source {
        StepCoreSource::Env => "from TLLM_AFFINITY_STEP_CORE",
        StepCoreSource::WhatIf => {
            "TLLM_AFFINITY_STEP_CORE is unset, so the library pins nothing; shown: what auto would do"
        }
    }
}

fn node_text(node: Option<usize>) -> String {
    node.map_or("-1".to_string(), |n| n.to_string())
}

fn to_text(plan: &CpuPlan, cx: &Context<'_>) -> String {
    let t = cx.topology;
    let gpu = &t.gpus[plan.gpu_index];
    let mut out = String::new();
    let _ = writeln!(out, "CPU plan for {}", cx.how);
    let _ = writeln!(
        out,
        "  host:          {} CPUs online, {}; this GPU on NUMA node {}",
        t.online.count(),
        crate::draw::host_counts(t),
        node_text(gpu.numa_node)
    );
    let _ = writeln!(
        out,
        "  process mask:  {} ({})",
        plan.process_mask, cx.mask_from
    );
    let _ = writeln!(out, "  cpuset:        {} ({})", plan.cpuset, cx.cpuset_from);
    let _ = writeln!(
        out,
        "  allowed:       {} ({} CPUs: process mask within the cpuset)",
        plan.allowed,
        plan.allowed.count()
    );
    let quota = match plan.quota {
        Some(q) => format!(
            "{:.2} CPUs ({} µs per {} µs)",
            q.cpus(),
            q.quota_us,
            q.period_us
        ),
        None => "none".to_string(),
    };
    let _ = writeln!(out, "  CPU quota:     {quota}");
    let constrained = if plan.constrained {
        "constrained"
    } else {
        "not constrained"
    };
    let _ = match (&plan.worker, &plan.decision.empty_reason) {
        (Some(worker), _) => writeln!(
            out,
            "  worker set:    {worker} ({} CPUs; policy {}, {constrained}; GPU-local CPUs from {})",
            worker.count(),
            plan.decision.rule.name(),
            plan.worker_source
        ),
        (None, Some(reason)) => writeln!(out, "  worker set:    none pinned: {reason}"),
        (None, None) => writeln!(
            out,
            "  worker set:    unchanged (policy {}: worker threads keep their masks)",
            plan.decision.rule.name()
        ),
    };
    let _ = writeln!(out, "  slice:         {}", slice_text(plan));
    let _ = writeln!(
        out,
        "  step core:     {} ({})",
        setting_text(plan.step_core),
        setting_note(&cx.source)
    );
    match &plan.placement {
        Ok(p) => {
            let _ = writeln!(out, "  step thread:   CPU(s) {} ({})", p.step, p.why);
            let result = p
                .result
                .map_or("none (the mask has no other core)".to_string(), |c| {
                    c.to_string()
                });
            let _ = writeln!(out, "  result thread: CPU {result}");
        }
        Err(reason) => {
            let _ = writeln!(out, "  step thread:   not pinned: {reason}");
            let _ = writeln!(out, "  result thread: not pinned");
        }
    }
    let pools = &plan.pools;
    let _ = writeln!(out, "  pools:");
    let _ = writeln!(
        out,
        "    worker CPUs:    {:>5}  (the worker set less this GPU's step and result CPUs)",
        pools.worker_cpus
    );
    let _ = writeln!(
        out,
        "    free CPUs:      {:>5}  (allowed CPUs no step or result thread sits on)",
        pools.free_cpus
    );
    let quota_cpus = pools
        .quota_cpus
        .map_or("none".to_string(), |q| q.to_string());
    let _ = writeln!(
        out,
        "    quota CPUs:     {quota_cpus:>5}  (floor of the cgroup quota: CPUs' worth of time per period)"
    );
    let _ = writeln!(
        out,
        "    worker threads: {:>5}  (worker CPUs, capped by the quota less the pinned threads)",
        pools.worker_threads
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "auto step and result CPUs of every GPU of the host:");
    let _ = writeln!(
        out,
        "  {:<4} {:<14} {:<5} {:<16} result",
        "GPU", "address", "node", "step CPUs"
    );
    for (i, g) in plan.all_gpus.iter().enumerate() {
        let mark = if i == plan.gpu_index {
            "  <- this GPU"
        } else {
            ""
        };
        let (step, result) = match &g.placement {
            Ok(p) => (
                p.step.to_list(),
                p.result.map_or("-".to_string(), |c| c.to_string()),
            ),
            Err(_) => ("not pinned".to_string(), "-".to_string()),
        };
        let row = format!(
            "  {:<4} {:<14} {:<5} {:<16} {:<7}{mark}",
            i,
            g.address,
            node_text(g.numa_node),
            step,
            result
        );
        let _ = writeln!(out, "{}", row.trim_end());
    }
    // Each distinct reason once, after the table.
    let mut reasons: Vec<&str> = Vec::new();
    for g in &plan.all_gpus {
        if let Err(r) = &g.placement {
            if !reasons.contains(&r.as_str()) {
                reasons.push(r);
            }
        }
    }
    for r in reasons {
        let _ = writeln!(out, "  not pinned: {r}");
    }
    let _ = writeln!(out);
    let state = if plan.slicing {
        "on"
    } else {
        "off: what TLLM_AFFINITY_SLICE=gpu would give"
    };
    let _ = writeln!(out, "slices of every GPU of the host (slicing {state}):");
    let _ = writeln!(
        out,
        "  {:<4} {:<14} {:<24} {:<9} cache domains",
        "GPU", "address", "slice", "cut"
    );
    for (i, s) in plan.all_slices.iter().enumerate() {
        let domains: Vec<String> = s.domains.iter().map(|d| format!("[{d}]")).collect();
        let domains = if domains.is_empty() {
            "none known".to_string()
        } else {
            domains.join(" ")
        };
        let mark = if i == plan.gpu_index {
            "  <- this GPU"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  {:<4} {:<14} {:<24} {:<9} {domains}{mark}",
            i,
            s.address,
            s.cpus.to_list(),
            short_cut(s)
        );
    }
    out
}

/// The cut in a table's few letters.
fn short_cut(s: &GpuSlice) -> &'static str {
    match s.cut {
        tllm_affinity_core::placement::slice::Cut::Alone => "alone",
        tllm_affinity_core::placement::slice::Cut::WholeDomains => "domains",
        tllm_affinity_core::placement::slice::Cut::Cores => "cores",
        tllm_affinity_core::placement::slice::Cut::TooSmall => "too-small",
    }
}

/// The plan's slice line: this GPU's slice under slicing, the whole set with the reason, or what
/// slicing would give.
fn slice_text(plan: &CpuPlan) -> String {
    let mine = plan.all_slices.get(plan.gpu_index);
    match (&plan.slice, mine) {
        (Some(base), _) => match (&base.slice, &base.warning) {
            (Some(s), _) => format!("{} ({})", s.cpus, s.describe()),
            (None, Some(w)) => format!("none: {w}"),
            (None, None) => format!("{}", base.cpus),
        },
        (None, Some(s)) => format!(
            "off (TLLM_AFFINITY_SLICE=gpu would give [{}]: {})",
            s.cpus,
            s.describe()
        ),
        (None, None) => "off".to_string(),
    }
}

fn slice_json(s: &GpuSlice) -> Value {
    json!({
        "cpus": s.cpus.to_list(),
        "set": s.set.to_list(),
        "rank": s.rank,
        "sharing": s.sharing,
        "cut": s.cut.name(),
        "domains": s.domains.iter().map(|d| d.to_list()).collect::<Vec<_>>(),
        "fallback": s.fallback,
    })
}

fn placement_json(p: &Result<StepPlacement, String>) -> Value {
    match p {
        Ok(p) => json!({
            "step_cpus": p.step.to_list(),
            "result_cpu": p.result,
            "why": p.why,
        }),
        Err(reason) => json!({ "not_pinned": reason }),
    }
}

fn gpu_json(index: usize, g: &GpuPlacement) -> Value {
    let mut v = placement_json(&g.placement);
    v["index"] = json!(index);
    v["address"] = json!(g.address);
    v["numa_node"] = json!(g.numa_node);
    v
}

fn to_json(plan: &CpuPlan, cx: &Context<'_>) -> Value {
    let gpu = &cx.topology.gpus[plan.gpu_index];
    json!({
        "gpu": {
            "device": cx.device,
            "index": plan.gpu_index,
            "address": plan.address,
            "numa_node": gpu.numa_node,
            "resolved": cx.how,
            "source": cx.gpu_source,
        },
        "process_mask": plan.process_mask.to_list(),
        "process_mask_from": cx.mask_from,
        "cpuset": plan.cpuset.to_list(),
        "allowed": plan.allowed.to_list(),
        "quota": plan.quota.map(|q| json!({
            "quota_us": q.quota_us,
            "period_us": q.period_us,
            "cpus": q.cpus(),
        })),
        "worker": {
            "cpus": plan.worker.as_ref().map(|w| w.to_list()),
            "rule": plan.decision.rule.name(),
            "constrained": plan.constrained,
            "empty_reason": plan.decision.empty_reason,
            "source": plan.worker_source.to_string(),
        },
        "slice": {
            "on": plan.slicing,
            "cpus": plan.slice.as_ref().map(|b| b.cpus.to_list()),
            "warning": plan.slice.as_ref().and_then(|b| b.warning.clone()),
            "this_gpu": plan.all_slices.get(plan.gpu_index).map(slice_json),
        },
        "step_core": setting_text(plan.step_core),
        "step_core_note": setting_note(&cx.source),
        "placement": placement_json(&plan.placement),
        "pools": {
            "worker_cpus": plan.pools.worker_cpus,
            "free_cpus": plan.pools.free_cpus,
            "quota_cpus": plan.pools.quota_cpus,
            "worker_threads": plan.pools.worker_threads,
        },
        "gpus": plan.all_gpus.iter().enumerate().map(|(i, g)| {
            let mut v = gpu_json(i, g);
            v["slice"] = plan.all_slices.get(i).map_or(Value::Null, slice_json);
            v
        }).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tllm_affinity_core::host::simulated::dgx_h100_like;

    #[test]
    fn text_and_json_for_the_dgx_under_several_masks() {
        let dir = tempfile::tempdir().unwrap();
        dgx_h100_like().write(dir.path()).unwrap();
        let t = Topology::read(&tllm_affinity_core::host::topology::SysfsRoot::new(
            dir.path(),
        ))
        .unwrap();
        for (mask, expect) in [
            ("0-223", "0,112"),
            ("0-27,56-83,112-139,168-195", "0,112"),
            ("0-55,112-167", "0,112"),
            // Too small for node 1's four GPUs: they pin nothing, with the reason.
            ("0-7,56-61", "0"),
        ] {
            let process_mask = CpuMask::parse_list(mask).unwrap();
            let plan = plan::plan(&PlanInput {
                topology: &t,
                process_mask: &process_mask,
                cpuset: &t.online,
                quota: None,
                step_core: StepCore::Auto,
                gpu_index: 0,
                nvml_cpus: None,
                settings: &Settings::default(),
            });
            let cx = Context {
                device: 0,
                how: "CUDA device 0 = GPU 0 (0000:18:00.0) in PCI order",
                gpu_source: "sysfs".to_string(),
                mask_from: "--cpus",
                cpuset_from: "the simulated host's online CPUs; no cgroup",
                source: StepCoreSource::WhatIf,
                topology: &t,
            };
            let text = to_text(&plan, &cx);
            if std::env::var_os("TLLM_AFFINITY_SHOW_PLAN").is_some() {
                println!("$ tllm-affinity plan --gpu 0 --cpus {mask}\n{text}");
            }
            assert!(
                text.contains(&format!("step thread:   CPU(s) {expect}")),
                "{text}"
            );
            assert!(text.contains("<- this GPU"), "{text}");
            if mask == "0-7,56-61" {
                assert!(
                    text.contains("not pinned: NUMA node 1 has 6 allowed core(s)"),
                    "{text}"
                );
            }
            let json = to_json(&plan, &cx);
            assert_eq!(json["placement"]["step_cpus"], expect);
            assert_eq!(json["gpus"].as_array().unwrap().len(), 8);
            assert_eq!(json["gpu"]["address"], "0000:18:00.0");
        }
    }
}
