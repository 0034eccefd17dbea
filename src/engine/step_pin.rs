//! Pinning a step or result thread (SPEC §6): [`crate::placement::step`] chooses the CPUs and takes the
//! GPU's lock; this pins the calling thread under the registry lock, whose birth rule then keeps
//! the pinned thread's children off its core.

use std::io;

use super::kernel::Kernel;
use super::state::{load_facts, lock_registry};
use crate::placement::step;
use crate::registry::Slot;
use crate::sys;
use crate::{log_info, log_warn};

/// Pins the calling thread for `device_id`; returns the number of CPUs pinned to, 0 when not
/// pinned (with a warning saying why), or `-errno`.
pub fn pin_calling_thread(caller: Slot, device_id: i32, result: bool) -> i32 {
    let what = step::thread_word(result);
    let pin = match step::choose(load_facts(), device_id, result) {
        Ok(pin) => pin,
        Err(rc) => return rc,
    };
    let mask = pin.mask;
    match lock_registry().pin(caller, mask.clone(), pin.how, &Kernel) {
        Ok(()) => {
            log_info!(
                "{what} thread {} pinned to CPU(s) [{mask}] for {} ({})",
                sys::gettid(),
                pin.target,
                pin.why
            );
            mask.count() as i32
        }
        Err(errno) => {
            log_warn!(
                "{what} thread for {} not pinned: setting its mask to [{mask}] failed ({})",
                pin.target,
                io::Error::from_raw_os_error(errno)
            );
            -errno
        }
    }
}
