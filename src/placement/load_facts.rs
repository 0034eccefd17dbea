//! What the library learned about the process at load: its settings, the mask and cpuset it
//! started with, whether it was constrained. The engine fills it once, at initialisation; the
//! step pinning and the report read it.

use crate::mask::CpuMask;
use crate::placement::settings::Settings;

/// The load-time facts of one process; a fork child keeps its parent's.
#[derive(Debug)]
pub struct LoadFacts {
    pub settings: Settings,
    /// The main thread's mask when the library loaded, before it changed anything.
    pub mask_at_load: CpuMask,
    /// What the cgroup cpuset allows (the online CPUs where no cpuset is readable).
    pub cpuset: CpuMask,
    pub constrained: bool,
    /// `TLLM_AFFINITY_STEP_CORE=<cpu>` names a CPU outside the mask at load: pins return -EINVAL.
    pub step_core_invalid: bool,
}
