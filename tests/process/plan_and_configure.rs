//! `tllm-affinity plan --gpu N` shows the worker set `configure(N)` applies: one function decides
//! both (`policy::worker_set`). Over the policy table — every setting, with and without a
//! launcher's constraint — the plan's worker set equals the mask a real process under the
//! library gets from `configure(0)` (its report's `worker_mask`).

use crate::common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;

const SETTINGS: &[&[(&str, &str)]] = &[
    &[],
    &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1")],
    &[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "0")],
    &[("TLLM_AFFINITY_POLICY", "keep")],
    &[("TLLM_AFFINITY_POLICY", "clear")],
    &[("TLLM_AFFINITY_POLICY", "numa")],
    &[("TLLM_AFFINITY_POLICY", "auto")],
    &[("TLLM_AFFINITY_CPUS", "FIRST")],
    &[("TLLM_AFFINITY_SLICE", "gpu")],
    &[
        ("TLLM_AFFINITY_SLICE", "gpu"),
        ("TLLM_AFFINITY_CPUS", "FIRST"),
    ],
    &[
        ("TLLM_AFFINITY_CPUS", "FIRST"),
        ("TLLM_AFFINITY_POLICY", "clear"),
    ],
];

fn under(launcher: &[String], program: impl AsRef<std::ffi::OsStr>) -> Command {
    match launcher.split_first() {
        None => Command::new(program),
        Some((first, rest)) => {
            let mut cmd = Command::new(first);
            cmd.args(rest).arg(program);
            cmd
        }
    }
}

#[test]
fn plan_shows_the_worker_set_configure_applies_over_the_policy_table() {
    require!(two_cpus(
        "a constraint and a worker set narrower than the host"
    ));
    let sysfs = Sysfs::two_nodes();
    let first = allowed_cpus().first().unwrap().to_string();
    let launchers: [Vec<String>; 2] = [
        Vec::new(),
        vec!["taskset".into(), "-c".into(), first.clone()],
    ];
    let mut table = Vec::new();
    for launcher in &launchers {
        for settings in SETTINGS {
            let vars: Vec<(&str, String)> = settings
                .iter()
                .map(|&(name, value)| (name, value.replace("FIRST", &first)))
                .collect();
            let mut plan = under(launcher, cli());
            plan.args(["plan", "--gpu", "0", "--json"])
                .env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path());
            for var in [
                "TLLM_NUMA_AWARE_WORKER_AFFINITY",
                "TLLM_AFFINITY_POLICY",
                "TLLM_AFFINITY_CPUS",
                "TLLM_AFFINITY_SLICE",
            ] {
                plan.env_remove(var);
            }
            plan.envs(vars.iter().map(|(n, v)| (n, v)));
            let out = plan.output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let planned: Value = serde_json::from_slice(&out.stdout).unwrap();
            let planned = planned["worker"]["cpus"].clone();

            // The library's own variables as `preloaded` sets them, on the launcher's command.
            let base = preloaded(python(), &sysfs);
            let mut configure = under(launcher, python());
            for (k, v) in base.get_envs() {
                match v {
                    Some(v) => configure.env(k, v),
                    None => configure.env_remove(k),
                };
            }
            configure
                .args([
                    "-c",
                    "import json, tllm_affinity as t; l = t.configure(0); \
                     print(json.dumps(t.report()['worker_mask']))",
                ])
                .env(
                    "PYTHONPATH",
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("python"),
                )
                .envs(vars.iter().map(|(n, v)| (n, v)));
            let out = configure.output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let applied: Value =
                serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
            table.push(format!(
                "{launcher:?} {vars:?}: plan {planned}, configure {applied}"
            ));
            assert_eq!(
                planned,
                applied,
                "under {launcher:?} with {vars:?}: the plan says {planned}, configure applied {applied}"
            );
        }
    }
    println!("{}", table.join("\n"));
}
