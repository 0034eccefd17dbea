//! glibc's cleanup buffers: how a frame has a routine run when a forced unwind (`pthread_exit`,
//! cancellation) leaves it. A Rust value with `Drop` cannot be trusted to: Rust defines a forced
//! unwind only through frames with nothing to drop, so the trampoline holds no such value across
//! the user's routine and links one of glibc's own buffers instead.

use std::ffi::{c_int, c_void};

/// glibc's `struct _pthread_cleanup_buffer`, as `_pthread_cleanup_push` links it into the
/// thread's list.
#[repr(C)]
pub struct CleanupBuffer {
    routine: Option<extern "C" fn(*mut c_void)>,
    arg: *mut c_void,
    canceltype: c_int,
    prev: *mut CleanupBuffer,
}

impl CleanupBuffer {
    pub const fn new() -> Self {
        CleanupBuffer {
            routine: None,
            arg: std::ptr::null_mut(),
            canceltype: 0,
            prev: std::ptr::null_mut(),
        }
    }
}

impl Default for CleanupBuffer {
    fn default() -> Self {
        Self::new()
    }
}

extern "C" {
    fn _pthread_cleanup_push(
        buffer: *mut CleanupBuffer,
        routine: extern "C" fn(*mut c_void),
        arg: *mut c_void,
    );
    fn _pthread_cleanup_pop(buffer: *mut CleanupBuffer, execute: c_int);
}

/// Links `buffer` into the calling thread's list: `routine(arg)` runs when a forced unwind
/// leaves the frame that holds the buffer, or at [`pop`].
///
/// # Safety
/// `buffer` stays where it is, in the caller's frame, until [`pop`] or the forced unwind, and
/// `arg` is valid for `routine` until then.
#[inline(always)]
pub unsafe fn push(
    buffer: &mut CleanupBuffer,
    routine: extern "C" fn(*mut c_void),
    arg: *mut c_void,
) {
    // SAFETY: the caller keeps the buffer in place until it is unlinked.
    unsafe { _pthread_cleanup_push(buffer, routine, arg) }
}

/// Unlinks `buffer`, running its routine first when `run`.
///
/// # Safety
/// `buffer` is the calling thread's innermost linked buffer.
#[inline(always)]
pub unsafe fn pop(buffer: &mut CleanupBuffer, run: bool) {
    // SAFETY: the caller's innermost buffer, linked by `push`.
    unsafe { _pthread_cleanup_pop(buffer, c_int::from(run)) }
}
