//! The process tier: real programs (C, Python, OpenMP, `taskset`, `numactl`, containers, `mpirun`)
//! with the real library preloaded, their real per-thread masks read back. What `scripts/test
//! --quick` runs, with the pure tier.
//!
//! Each module is one of the tier's files; `scripts/test` runs them one module at a time
//! (`cargo test --test process -- <module>::`), as separate binaries ran before.

#[path = "../common/mod.rs"]
mod common;
#[path = "../hostile_files/mod.rs"]
mod hostile_files;

mod bad_input;
mod captured_hosts;
mod cli;
mod constraints;
mod containers;
mod deployments;
mod device_variables;
mod docs;
mod engine_population;
mod fault_injection;
mod grace_shapes;
mod header;
mod host_view;
mod hostile;
mod launch;
mod lazy_table;
mod lifecycle;
mod memcheck;
mod metrics;
mod mpi;
mod never_hang;
mod nvml;
mod off_switch;
mod plan_and_configure;
mod python_hook;
mod python_module;
mod readme_recipes;
mod reload;
mod resources;
mod runtimes;
mod security;
mod shared_host;
mod slices;
mod step_threads;
mod stress;
mod wheel;
mod worker_scope;
mod zero_code;
