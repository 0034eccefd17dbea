//! What every integration test needs: the real library built and located, test programs
//! compiled, a simulated sysfs tree, and processes run under the library whose per-thread masks
//! are read from `/proc`. Each concern is a file of its own, all re-exported here, so a test
//! says `use common::*`; the checks several tiers share are the files named by what they check.
#![allow(dead_code)]

// The helpers, one concern a file.
mod aarch64;
mod build;
mod cgroup;
mod driver;
mod hosts;
mod phases;
mod python_package;
mod reports;
mod rootfs;
#[allow(unused_imports)]
pub use aarch64::*;
#[allow(unused_imports)]
pub use build::*;
#[allow(unused_imports)]
pub use cgroup::*;
#[allow(unused_imports)]
pub use driver::*;
#[allow(unused_imports)]
pub use hosts::*;
#[allow(unused_imports)]
pub use phases::*;
#[allow(unused_imports)]
pub use python_package::*;
#[allow(unused_imports)]
pub use reports::*;
#[allow(unused_imports)]
pub use rootfs::*;

// The checks the tiers share (tests/common/tier.rs), and the launchers' and guests' harnesses.
pub mod bad_input;
pub mod deployments;
pub mod fork_exec;
pub mod guest;
pub mod host_view_target;
pub mod leases;
pub mod never_hang;
pub mod slices;
pub mod slurm;
pub mod tier;
pub mod tray;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use tllm_affinity_core::host::simulated;
use tllm_affinity_core::host::topology::{SysfsRoot, Topology};
use tllm_affinity_core::mask::CpuMask;

/// Skips the test where the host lacks something it needs: prints `skipped: needs <what>` and
/// returns, except in CI (`CI=true`, where `.ci/run` installs everything), where it fails.
/// `require!(available, "what")` for a condition; `let x = require!(probe())` for a probe giving
/// `Result<T, String>`, its error saying what is missing.
#[allow(unused_macros)]
macro_rules! require {
    ($available:expr, $what:expr $(,)?) => {
        if !$available {
            $crate::common::missing(&$what);
            return;
        }
    };
    ($probe:expr $(,)?) => {
        match $probe {
            Ok(found) => found,
            Err(what) => {
                $crate::common::missing(&what);
                return;
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use require;

/// A table of scenarios, one `#[test]` per row, named and documented by the row, each running
/// `check(&row)`: `table_tests! { check; /// doc\n name: row; ... }`.
#[allow(unused_macros)]
macro_rules! table_tests {
    ($check:path; $($(#[$doc:meta])* $name:ident: $row:expr;)*) => {
        $(
            $(#[$doc])*
            #[test]
            fn $name() {
                $check(&$row);
            }
        )*
    };
}
#[allow(unused_imports)]
pub(crate) use table_tests;

/// The tests of one tier that each hand the tier to a check of tests/common (tests/emulated/aarch64.rs):
/// `tier_tests! { tier(); /// doc\n name: check; ... }`, one `#[test]` per row, named and
/// documented by the row, each taking the tier with [`require!`] (a probe giving
/// `Result<&Tier, String>`) and running `check(tier)`.
#[allow(unused_macros)]
macro_rules! tier_tests {
    ($tier:expr; $($(#[$doc:meta])* $name:ident: $check:path;)*) => {
        $( $(#[$doc])* #[test] fn $name() { $check(require!($tier)); } )*
    };
}
#[allow(unused_imports)]
pub(crate) use tier_tests;

/// What [`require!`] does for a missing capability: fails in CI, says the test is skipped
/// elsewhere.
pub fn missing(what: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{what} is missing in CI, where .ci/run installs it"
    );
    println!("skipped: needs {what}");
}

/// Whether `name` is a program on PATH.
pub fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()))
        .unwrap_or(false)
}

/// Whether this process runs as root.
pub fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
