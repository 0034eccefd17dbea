//! The real kernel behind the registry model: [`Kernel`] runs the model's [`ThreadMasks`] on the
//! raw syscalls of [`crate::sys`].

use crate::host::kernel_text::stat_field;
use crate::mask::CpuMask;
use crate::registry::{ThreadMasks, Tid};
use crate::sys::{get_mask, set_mask, with_mask};

/// The real kernel, for the registry model.
pub struct Kernel;

impl ThreadMasks for Kernel {
    fn get(&self, tid: Tid) -> Result<CpuMask, i32> {
        get_mask(tid)
    }
    fn set(&self, tid: Tid, mask: &CpuMask) -> Result<(), i32> {
        set_mask(tid, mask)
    }
    fn thread_count(&self) -> usize {
        // Field 20 of stat: the number of threads, from the main thread's own file
        // (qemu-user answers 0 for the process's /proc/self/stat).
        std::fs::read_to_string(format!("/proc/self/task/{}/stat", std::process::id()))
            .ok()
            .and_then(|stat| stat_field(&stat, 20))
            .unwrap_or_else(|| self.thread_ids().len())
    }
    fn thread_ids(&self) -> Vec<Tid> {
        std::fs::read_dir("/proc/self/task")
            .map(|dir| {
                dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
    fn differs_from(&self, tid: Tid, expected: &CpuMask) -> Result<Option<CpuMask>, i32> {
        with_mask(tid, |bytes| {
            (!expected.equals_kernel_bytes(bytes)).then(|| CpuMask::from_kernel_bytes(bytes))
        })
    }
}
