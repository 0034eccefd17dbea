//! Every `sh` block of README.md, docs/recipes.md and docs/monitoring.md, run as written, so that
//! a recipe that stops working fails here.
//!
//! Each block runs in a fresh `bash -e` from the repository root, in the state the README's
//! Install section leaves a reader in: `target/release` (the real `tllm-affinity` and library) on
//! `PATH`, and the Python package with its start-up hook importable, as `pip install ./python`
//! makes it. What needs hardware or software absent here is stood in for by `tests/recipes/`:
//!
//! - `trtllm-serve`: the upstream-shaped TensorRT-LLM stand-in of `tests/programs/upstream_trtllm`
//!   building an in-process worker (whose `configure_cpu_affinity` pins every thread it can), and
//!   checking, when the library and its hook are on, that the main thread keeps its mask and the
//!   worker's lease is released;
//! - `python -m my_server.worker`: a dedicated worker process that checks its threads share the
//!   worker mask;
//! - `srun` and `numactl`: they bind as the real ones do, on the simulated host; `pip`: checks the
//!   package is there to install. Open MPI's `mpirun` is the real one.
//!
//! The GPU is the simulated host of `tllm-affinity simulate` (`TLLM_AFFINITY_SYSFS_ROOT`). A block
//! passes when it exits 0 with no library error, no false "constrained" warning and no panic.
//! The blocks not run are `scripts/test` and `scripts/test --quick`, which run this test, and
//! `scripts/demo`, which builds the whole workspace first (minutes) and is the reader's own first
//! command.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

// A recipe that builds the wheel takes minutes on a loaded two-core machine.
const LIMIT: Duration = Duration::from_secs(400);

/// The pages whose `sh` blocks are recipes a reader runs as written.
const PAGES: [&str; 3] = ["README.md", "docs/recipes.md", "docs/monitoring.md"];

/// Blocks not run here, and why.
fn not_run(script: &str) -> Option<&'static str> {
    match script.trim() {
        "scripts/test" | "scripts/test --quick" => Some("it runs this test"),
        "scripts/demo" => Some("the reader's first command: it builds the workspace first"),
        _ => None,
    }
}

/// One fenced `sh` block of a page: where it starts and what it says.
struct Recipe {
    line: usize,
    script: String,
}

fn recipes(readme: &str) -> Vec<Recipe> {
    let mut found = Vec::new();
    let mut current: Option<Recipe> = None;
    for (index, line) in readme.lines().enumerate() {
        match current.as_mut() {
            None if line.trim_end() == "```sh" => {
                current = Some(Recipe {
                    line: index + 1,
                    script: String::new(),
                })
            }
            Some(_) if line.trim_end() == "```" => found.extend(current.take()),
            Some(recipe) => {
                recipe.script.push_str(line);
                recipe.script.push('\n');
            }
            None => {}
        }
    }
    assert!(current.is_none(), "an sh block is never closed");
    found
}

/// The environment after the README's Install section, plus the stand-ins and the simulated
/// host.
fn reader_shell(script: &str, sim: &Path, scratch: &Path) -> std::process::Command {
    let recipes = repo().join("tests/recipes");
    let release = cli().parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}:{}",
        recipes.join("bin").display(),
        release.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // What `pip install ./python` puts on the path: the package and its start-up hook (the
    // `.pth` file's job); then the stand-ins' own packages.
    let python_path: Vec<PathBuf> = vec![
        repo().join("python/tllm_affinity/_sitecustomize"),
        repo().join("python"),
        recipes.join("python"),
        programs_dir().join("upstream_trtllm"),
    ];
    let python_path = std::env::join_paths(python_path).unwrap();
    let mut cmd = clean("bash");
    cmd.args(["-e", "-c", script])
        .current_dir(repo())
        .env("PATH", path)
        .env("PYTHONPATH", python_path)
        .env("TLLM_AFFINITY_SYSFS_ROOT", sim)
        .env("TLLM_AFFINITY_LOCK_DIR", scratch)
        // Open MPI as root, on more ranks than CPUs, with a session directory of its own.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("TMPDIR", scratch)
        .env_remove("NO_COLOR");
    cmd
}

/// Why a finished recipe failed, if it did.
fn failure(end: &Finished) -> Option<String> {
    if !end.status.success() {
        return Some(format!("exit {:?}", end.status));
    }
    let all = format!("{}\n{}", end.stdout, end.stderr);
    let bad = [
        ("[tllm-affinity] error", "a library error"),
        (
            "Removing CPU affinity constraints",
            "a 'constrained' warning",
        ),
        ("panicked", "a panic"),
        ("Traceback", "a Python traceback"),
    ];
    bad.iter()
        .find(|(needle, _)| all.contains(needle))
        .map(|(_, what)| format!("{what} in its output"))
}

#[test]
fn every_readme_recipe_runs_as_written() {
    let mut all = Vec::new();
    for page in PAGES {
        let text = std::fs::read_to_string(repo().join(page)).unwrap();
        all.extend(recipes(&text).into_iter().map(|recipe| (page, recipe)));
    }
    assert!(all.len() >= 20, "only {} sh blocks in {PAGES:?}", all.len());

    let scratch = tempfile::tempdir().unwrap();
    let sim = scratch.path().join("simulated-host");
    let out = std::process::Command::new(cli())
        .arg("simulate")
        .arg(&sim)
        .output()
        .unwrap();
    assert!(out.status.success(), "tllm-affinity simulate failed");

    let mut ran = Vec::new();
    let mut failed = Vec::new();
    for (page, recipe) in &all {
        let first = recipe.script.lines().next().unwrap_or_default().to_string();
        let at = format!("{page}:{}", recipe.line);
        if let Some(why) = not_run(&recipe.script) {
            ran.push(format!("{at:<24} not run  {first}  ({why})"));
            continue;
        }
        let work = tempfile::tempdir_in(scratch.path()).unwrap();
        let started = Instant::now();
        let end = run_bounded(reader_shell(&recipe.script, &sim, work.path()), LIMIT);
        let took = started.elapsed().as_secs_f64();
        let verdict = failure(&end);
        ran.push(format!(
            "{at:<24} {}  {first}{}  ({took:.1} s)",
            if verdict.is_none() {
                "ok     "
            } else {
                "FAILED "
            },
            if recipe.script.lines().count() > 1 {
                " ..."
            } else {
                ""
            }
        ));
        if let Some(why) = verdict {
            failed.push(format!(
                "{at}: {why}\n--- recipe\n{}--- stdout\n{}\n--- stderr\n{}",
                recipe.script, end.stdout, end.stderr
            ));
        }
    }
    println!("recipes ({} sh blocks):", all.len());
    for line in &ran {
        println!("  {line}");
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}

#[test]
fn sh_blocks_are_found_with_their_lines() {
    let text = "intro\n```sh\necho one\necho two\n```\n```text\nnot me\n```\n```sh\nls\n```\n";
    let found = recipes(text);
    assert_eq!(found.len(), 2);
    assert_eq!(
        (found[0].line, found[0].script.as_str()),
        (2, "echo one\necho two\n")
    );
    assert_eq!((found[1].line, found[1].script.as_str()), (9, "ls\n"));
}
