//! `tllm-affinity probe [--json] [--rounds N]`: thread handoff latency and cpuidle exit latencies,
//! with a recommendation for `TLLM_AFFINITY_STEP_CORE` (see [`tllm_affinity_core::placement::probe`]).

use std::path::PathBuf;

use tllm_affinity_core::host::topology::Topology;
use tllm_affinity_core::placement::probe;

#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Handoff rounds per CPU pair (each round wakes each thread once).
    #[arg(long, default_value_t = 2000)]
    pub rounds: usize,
    /// Read sysfs under this directory (default: TLLM_AFFINITY_SYSFS_ROOT, else /).
    #[arg(long)]
    pub sysfs_root: Option<PathBuf>,
}

pub fn run(args: &ProbeArgs) -> Result<(), String> {
    if args.rounds == 0 {
        return Err("--rounds 0: expected at least one round".to_string());
    }
    let root = crate::sysfs_root(args.sysfs_root.as_deref());
    let topology = Topology::read(&root).map_err(|e| e.to_string())?;
    let mask = crate::process_mask()?;
    let report = probe::run(&topology, &mask, args.rounds);
    if args.json {
        let text = crate::json::pretty(&report.to_json())?;
        println!("{text}");
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe on this machine's real topology and mask; `TLLM_AFFINITY_PROBE_ROUNDS` sets the
    /// rounds (default 50, to keep the test short); `--nocapture` shows the report.
    #[test]
    fn probes_this_machine() {
        let rounds = std::env::var("TLLM_AFFINITY_PROBE_ROUNDS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(50);
        let topology =
            Topology::read(&tllm_affinity_core::host::topology::SysfsRoot::default()).unwrap();
        let mask = crate::process_mask().unwrap();
        let report = probe::run(&topology, &mask, rounds);
        let text = report.to_text();
        println!("$ tllm-affinity probe --rounds {rounds}\n{text}");
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_json()).unwrap()
        );
        assert!(
            text.contains("recommendation: TLLM_AFFINITY_STEP_CORE="),
            "{text}"
        );
        let same_cpu = &report.cases[0];
        assert!(
            matches!(same_cpu.outcome, probe::Outcome::Measured(_)),
            "{same_cpu:?}"
        );
    }

    #[test]
    fn zero_rounds_is_refused() {
        let args = ProbeArgs {
            json: false,
            rounds: 0,
            sysfs_root: None,
        };
        assert!(run(&args).unwrap_err().contains("--rounds 0"));
    }
}
