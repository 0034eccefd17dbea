//! A tier: one build of the library and the programs, and how its processes run. The x86_64
//! tier runs them here, natively ([`Native`]); the aarch64 tier (tests/emulated/aarch64.rs) runs the
//! aarch64 build under qemu-user in an arm64 root filesystem. The checks both tiers make are
//! written once, against this trait (tests/common/fork_exec.rs, bad_input.rs, never_hang.rs,
//! deployments.rs), so the aarch64 tier asserts exactly what the x86_64 one does.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::*;

/// What a tier does differently. The defaults are this machine's (x86_64, native); a tier that
/// runs elsewhere (tests/emulated/aarch64.rs) overrides them.
pub trait Tier {
    /// A C program of tests/programs, built for this tier.
    fn program(&self, source: &str) -> PathBuf {
        Program::c(source).build()
    }

    /// A shared object of tests/programs built for this tier, under the file name `name`.
    fn shared_object(&self, source: &str, name: &str) -> PathBuf {
        Program::c(source).shared().named(name).build()
    }

    /// `tests/programs/openmp_region.c` with `-fopenmp`: a real libgomp pool of this tier.
    fn openmp_library(&self) -> PathBuf {
        openmp_library()
    }

    /// `program` (a path this tier runs) with this tier's library preloaded on `sysfs`.
    fn preloaded(&self, program: &Path, sysfs: &Sysfs) -> Command;

    /// The Python interpreter this tier runs.
    fn python(&self) -> PathBuf {
        python()
    }

    /// The POSIX shell this tier runs.
    fn shell(&self) -> PathBuf {
        PathBuf::from("sh")
    }

    /// The threads the program of live process `pid` made, of its `live` threads (read from
    /// `/proc/<pid>/task` while it waits), given `listed`, the threads the library lists for it
    /// at that moment. Here, every live thread; under qemu-user, every live thread but qemu's own.
    fn program_threads(
        &self,
        _pid: u32,
        live: &BTreeSet<i32>,
        _listed: &BTreeSet<i32>,
    ) -> BTreeSet<i32> {
        live.clone()
    }

    /// How much longer than here a run may take: 1 here; more under emulation.
    fn slowdown(&self) -> u32 {
        1
    }

    /// `limit` as this tier needs it ([`Tier::slowdown`] times it).
    fn limit(&self, limit: Duration) -> Duration {
        limit * self.slowdown()
    }
}

/// The x86_64 tier: the programs built by `cc`, run here under the library of this checkout.
pub struct Native;

impl Tier for Native {
    fn preloaded(&self, program: &Path, sysfs: &Sysfs) -> Command {
        preloaded(program, sysfs)
    }
}

/// At the program's next phase, the threads its program made (of `/proc/<pid>/task`, read while
/// it waits); answered, the program prints `REPORT <tag> <json>`, whose threads must be exactly
/// those (the library's registry equals the program's live threads). The phase, the threads and
/// the report: [`Driver::phase_and_registry`] for any tier.
pub fn phase_and_registry(
    tier: &dyn Tier,
    run: &mut Driver,
    tag: &str,
) -> (Phase, BTreeSet<i32>, serde_json::Value) {
    let phase = run.phase();
    let live = task_tids(run.pid());
    run.proceed();
    let report = run.report(tag);
    let listed = report_tids(&report);
    let made = tier.program_threads(run.pid(), &live, &listed);
    assert_eq!(listed, made, "{report}");
    (phase, made, report)
}
