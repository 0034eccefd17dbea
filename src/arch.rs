//! The per-architecture facts: everything that differs between the two architectures the
//! project ships for (x86_64 and aarch64) lives here, so that the engine and the rest of the
//! core never test `target_arch` themselves. Another architecture is refused at compile time
//! until its facts are written here.

use std::ffi::CStr;

/// The architecture's name as `uname -m` and the wheel's platform tag spell it.
#[cfg(target_arch = "x86_64")]
pub const NAME: &str = "x86_64";
#[cfg(target_arch = "aarch64")]
pub const NAME: &str = "aarch64";

/// The glibc symbol version of the three-argument `sched_setaffinity` and
/// `pthread_setaffinity_np` (a `cpu_set_t` size and pointer), which the engine asks `dlvsym` for.
///
/// x86_64: GLIBC_2.3.4; the same names at GLIBC_2.3.3 take two arguments, and older glibc hands
/// a plain `dlsym` that one. aarch64: GLIBC_2.17, the oldest version its glibc has (it never had
/// 2.3.4, where `dlvsym` finds nothing); `pthread_setaffinity_np` is also at 2.34 there with the
/// same arguments, but 2.17 is in every aarch64 glibc.
#[cfg(target_arch = "x86_64")]
pub const AFFINITY_SYMBOL_VERSION: &CStr = c"GLIBC_2.3.4";
#[cfg(target_arch = "aarch64")]
pub const AFFINITY_SYMBOL_VERSION: &CStr = c"GLIBC_2.17";

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!(
    "tllm-affinity is built for x86_64 and aarch64; another architecture needs its facts in \
     src/arch.rs first (above all the glibc version of sched_setaffinity)"
);
