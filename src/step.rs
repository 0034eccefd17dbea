//! Step and result threads (SPEC §6).

use crate::engine::process;
use crate::log_warn;
use crate::mask::CpuMask;
use crate::registry::Slot;
use crate::settings::StepCore;

/// SPEC §6: `TLLM_AFFINITY_STEP_CORE=<cpu>` outside the process mask is a startup error; the
/// returned line names the CPU and the mask.
pub fn check_at_load(step_core: StepCore, mask_at_load: &CpuMask) -> Result<(), String> {
    match step_core {
        StepCore::Cpu(cpu) if !mask_at_load.contains(cpu) => Err(format!(
            "TLLM_AFFINITY_STEP_CORE={cpu}: CPU {cpu} is outside the process mask [{mask_at_load}]"
        )),
        _ => Ok(()),
    }
}

/// Pins the calling thread for `device_id`; returns the number of CPUs pinned to, 0 when not
/// pinned (with a warning saying why), or `-errno`.
pub fn pin_calling_thread(_caller: Slot, device_id: i32, result: bool) -> i32 {
    let what = if result { "result" } else { "step" };
    if process().step_core_invalid {
        return -libc::EINVAL;
    }
    match process().settings.step_core {
        StepCore::Off => {
            log_warn!(
                "TLLM_AFFINITY_STEP_CORE is off: {what} thread for device {device_id} not pinned"
            );
            0
        }
        StepCore::Auto | StepCore::Cpu(_) => -libc::ENOTSUP,
    }
}
