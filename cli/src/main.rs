//! The `tllm-affinity` command line: `run`, `simulate`, `topo`, `plan`, `ps`, `metrics`, `probe`
//! and `cdi`.
//!
//! Each subcommand lives in its own module with its clap arguments and a `run` function; this
//! module only parses and turns failures into one line on stderr (a JSON object under `--json`)
//! and an exit status.

#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tllm_affinity_core::host::topology::SysfsRoot;
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::sys;

mod cdi;
mod draw;
mod grid;
mod host;
mod json;
mod memory_reading;
mod metrics;
mod plan;
mod probe;
mod ps;
mod run;
#[cfg(test)]
mod samples;
mod simulate;
mod topo;

/// What `plan` and `topo` add when the host shows no GPU: how to look at a simulated one.
pub const NO_GPU_HINT: &str = "no GPU found on this host; try --simulate (tllm-affinity run), or     `tllm-affinity simulate DIR` and then --sysfs-root DIR (or TLLM_AFFINITY_SYSFS_ROOT=DIR)";

#[derive(Parser, Debug)]
#[command(
    name = "tllm-affinity",
    version,
    about = "Role-aware CPU affinity for the threads of GPU inference servers",
    long_about = "Role-aware CPU affinity for the threads of GPU inference servers.\n\n\
        `run` starts a program under libtllm_affinity.so; `simulate` writes a simulated host for \
        machines without a GPU; `topo`, `plan`, `ps` and `probe` show what the library sees and \
        does; `metrics` gives the host view to Prometheus; `cdi` writes the Container Device \
        Interface spec that brings the library into \
        containers. Every subcommand takes --json."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a program with libtllm_affinity.so preloaded (execs it, --simulate included).
    Run(Box<run::RunArgs>),
    /// Write a simulated host (two NUMA nodes over this machine's CPUs, two GPUs) into DIR, to
    /// reuse with --sysfs-root DIR or TLLM_AFFINITY_SYSFS_ROOT=DIR.
    Simulate(simulate::SimulateArgs),
    /// Show the host: NUMA nodes, cores and SMT siblings, GPUs, cgroup limits, idle states.
    Topo(topo::TopoArgs),
    /// Show the CPU plan for one GPU: worker set, step and result CPUs, pool sizes.
    Plan(plan::PlanArgs),
    /// Show every thread of a live process: role, placement and CPU mask, as a picture; without
    /// a PID, every process on the host with its GPUs and CPUs, and what collides.
    Ps(ps::PsArgs),
    /// Print the host view in Prometheus' text format: once, into node_exporter's textfile
    /// directory (--textfile DIR, --every SECONDS), or served on /metrics (--listen ADDR:PORT).
    Metrics(metrics::MetricsArgs),
    /// Measure thread handoff latency and read idle states; recommend TLLM_AFFINITY_STEP_CORE.
    Probe(probe::ProbeArgs),
    /// Write a Container Device Interface spec (device tllm-affinity.dev/preload=default) that
    /// preloads the library into any glibc container, images unchanged.
    Cdi(cdi::CdiArgs),
}

/// The sysfs tree a subcommand reads: `--sysfs-root`, else `TLLM_AFFINITY_SYSFS_ROOT`, else `/`.
pub fn sysfs_root(arg: Option<&Path>) -> SysfsRoot {
    match arg {
        Some(path) => SysfsRoot::new(path),
        None => {
            SysfsRoot::from_env_value(std::env::var("TLLM_AFFINITY_SYSFS_ROOT").ok().as_deref())
        }
    }
}

/// This process's CPU mask, or the line saying why it cannot be read.
pub fn process_mask() -> Result<CpuMask, String> {
    sys::get_mask(0).map_err(|errno| {
        format!(
            "cannot read the process mask: {}",
            std::io::Error::from_raw_os_error(errno)
        )
    })
}

/// A subcommand that failed: the line to print and the exit status.
#[derive(Debug)]
pub struct Failure {
    pub status: u8,
    pub message: String,
}

impl Failure {
    /// A usage or environment error: status 2, as clap uses for bad arguments.
    pub fn usage(message: impl Into<String>) -> Self {
        Failure {
            status: 2,
            message: message.into(),
        }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::usage(message)
    }
}

impl Command {
    /// The subcommand was asked for JSON, so its errors are JSON too.
    fn json(&self) -> bool {
        match self {
            Command::Run(args) => args.json,
            Command::Simulate(args) => args.json,
            Command::Topo(args) => args.json,
            Command::Plan(args) => args.json,
            Command::Ps(args) => args.json,
            Command::Metrics(args) => args.json,
            Command::Probe(args) => args.json,
            Command::Cdi(args) => args.json,
        }
    }
}

/// Parses the process arguments and runs the subcommand.
fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so `ps PID | head` would end in a panic on the closed pipe; with the
    // default action the process ends quietly, as coreutils do. Programs `run` execs get the
    // default action either way.
    tllm_affinity_core::sys::default_sigpipe();
    let cli = Cli::parse();
    let (name, outcome) = match &cli.command {
        Command::Run(args) => ("run", run::run(args)),
        Command::Simulate(args) => (
            "simulate",
            simulate::run(args).map(|()| 0).map_err(Failure::from),
        ),
        Command::Topo(args) => ("topo", topo::run(args).map(|()| 0).map_err(Failure::from)),
        Command::Plan(args) => ("plan", plan::run(args).map(|()| 0).map_err(Failure::from)),
        Command::Ps(args) => {
            // Without a PID, the host view: every process with a table.
            let shown = match args.pid {
                Some(pid) => ps::run(pid, args),
                None => host::run(args),
            };
            ("ps", shown.map(|()| 0).map_err(Failure::from))
        }
        Command::Metrics(args) => (
            "metrics",
            metrics::run(args).map(|()| 0).map_err(Failure::from),
        ),
        Command::Probe(args) => ("probe", probe::run(args).map(|()| 0).map_err(Failure::from)),
        Command::Cdi(args) => ("cdi", cdi::run(args).map(|()| 0)),
    };
    match outcome {
        Ok(status) => ExitCode::from(status),
        Err(failure) => {
            // One line whatever the message holds, so scripts can grep it (or parse it).
            let line = failure.message.replace('\n', "; ");
            if cli.command.json() {
                let error = serde_json::json!({ "error": format!("tllm-affinity {name}: {line}") });
                eprintln!("{}", json::line(&error));
            } else {
                eprintln!("tllm-affinity {name}: {line}");
            }
            ExitCode::from(failure.status)
        }
    }
}
