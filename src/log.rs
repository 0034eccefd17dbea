//! One line per event on stderr, prefixed `[tllm-affinity]`, filtered by `TLLM_AFFINITY_LOG`.
//!
//! Lines go out with a single raw `write(2)` ([`crate::sys::write_stderr`]): no buffered stream,
//! no lock that a fork or a signal could leave held.

use std::sync::atomic::{AtomicU8, Ordering};

/// `TLLM_AFFINITY_LOG`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Warn as u8);

pub const PREFIX: &str = "[tllm-affinity]";

pub fn set_level(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

pub fn enabled(level: LogLevel) -> bool {
    level != LogLevel::Off && level as u8 <= LEVEL.load(Ordering::Relaxed)
}

/// Writes `message` as one line when `level` is enabled.
pub fn emit(level: LogLevel, message: &str) {
    if !enabled(level) {
        return;
    }
    let tag = match level {
        LogLevel::Error => "error",
        LogLevel::Warn => "warning",
        LogLevel::Info => "info",
        LogLevel::Debug | LogLevel::Off => "debug",
    };
    let line = format!("{PREFIX} {tag}: {}\n", message.trim_end());
    crate::sys::write_stderr(line.as_bytes());
}

/// Formats only when the level is enabled: configure and release log on every call.
#[doc(hidden)]
#[macro_export]
macro_rules! log_at {
    ($level:ident, $($t:tt)*) => {
        if $crate::log::enabled($crate::log::LogLevel::$level) {
            $crate::log::emit($crate::log::LogLevel::$level, &format!($($t)*))
        }
    };
}
#[macro_export]
macro_rules! log_error { ($($t:tt)*) => { $crate::log_at!(Error, $($t)*) } }
#[macro_export]
macro_rules! log_warn { ($($t:tt)*) => { $crate::log_at!(Warn, $($t)*) } }
#[macro_export]
macro_rules! log_info { ($($t:tt)*) => { $crate::log_at!(Info, $($t)*) } }
#[macro_export]
macro_rules! log_debug { ($($t:tt)*) => { $crate::log_at!(Debug, $($t)*) } }
