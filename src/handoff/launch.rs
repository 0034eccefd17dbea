//! What a launch hands from a process to the programs it starts (SPEC §2, §12), as one ordinary
//! environment variable that shells, `env`, `timeout`, pyenv shims and `srun` pass on untouched:
//!
//! ```text
//! TLLM_AFFINITY_LAUNCH=v1;id=<pid>-<start>;said=<fingerprint>[;mask=<launch mask>/<placed mask>]
//! ```
//!
//! - `id` names the launch: the pid and start time of its first process. The report at exit
//!   belongs to the process of the launch that used the library, not to a wrapper that exits
//!   after it.
//! - `said` is the fingerprint of the settings (every `TLLM_AFFINITY_*` and
//!   `TLLM_NUMA_AWARE_WORKER_AFFINITY` value) whose warnings and errors the launch has printed:
//!   a later image with the same settings prints them at `debug`.
//! - `mask` is present when the program was started from a thread on the library's worker mask:
//!   the mask the launcher gave the first process, and that worker mask. An image whose main
//!   thread is still on the worker mask judges "constrained" on the launch mask; one whose mask
//!   changed since (a `taskset` in between) judges on its own.
//!
//! This module is pure and allocates nothing where the exec shims use it ([`write_value`]): a
//! `vfork` child builds the new environment on its stack.

use std::fmt::{self, Write};

use crate::mask::{write_cpulist, CpuMask};

pub const VAR: &str = "TLLM_AFFINITY_LAUNCH";

/// A launch's identity: its first process's pid and start time (clock ticks since boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchId {
    pub pid: u32,
    pub start: u64,
}

impl fmt::Display for LaunchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.pid, self.start)
    }
}

/// What an earlier image of the launch handed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handed {
    pub id: LaunchId,
    pub said: Option<u64>,
    /// The launch mask and the worker mask the program was started from.
    pub masks: Option<(CpuMask, CpuMask)>,
}

impl Handed {
    /// Parses the variable's value; `None` for anything malformed (the variable is ours: a value
    /// we cannot read is ignored, never reported).
    pub fn parse(value: &str) -> Option<Handed> {
        let mut fields = value.split(';');
        if fields.next()? != "v1" {
            return None;
        }
        let (mut id, mut said, mut masks) = (None, None, None);
        for field in fields {
            let (key, value) = field.split_once('=')?;
            match key {
                "id" => {
                    let (pid, start) = value.split_once('-')?;
                    id = Some(LaunchId {
                        pid: pid.parse().ok()?,
                        start: start.parse().ok()?,
                    });
                }
                "said" => said = Some(u64::from_str_radix(value, 16).ok()?),
                "mask" => {
                    let (launch, placed) = value.split_once('/')?;
                    let launch = CpuMask::parse_list(launch).ok()?;
                    let placed = CpuMask::parse_list(placed).ok()?;
                    masks = (!launch.is_empty() && !placed.is_empty()).then_some((launch, placed));
                }
                _ => {}
            }
        }
        Some(Handed {
            id: id?,
            said,
            masks,
        })
    }

    /// The mask this image judges "constrained" on: the launch mask when its main thread is
    /// still on the worker mask it was started from, otherwise its own.
    pub fn launch_mask_for(&self, main_mask: &CpuMask) -> Option<CpuMask> {
        let (launch, placed) = self.masks.as_ref()?;
        (placed == main_mask).then(|| launch.clone())
    }
}

/// Whether a variable is one of the settings whose messages the launch prints once.
pub fn is_setting(name: &str) -> bool {
    (name.starts_with("TLLM_AFFINITY_") && name != VAR) || name == "TLLM_NUMA_AWARE_WORKER_AFFINITY"
}

/// FNV-1a over the settings' `name=value` pairs, in name order: equal settings, equal
/// fingerprint, whatever order the environment lists them in.
pub fn settings_fingerprint<'a>(vars: impl IntoIterator<Item = (&'a str, &'a str)>) -> u64 {
    let mut settings: Vec<(&str, &str)> = vars.into_iter().filter(|(n, _)| is_setting(n)).collect();
    settings.sort_unstable();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, value) in settings {
        for byte in name.bytes().chain([b'=']).chain(value.bytes()).chain([0]) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Writes the variable, `NAME=value`, as [`Handed::parse`] reads it. Masks come as the kernel's
/// 64-bit words (CPU n is bit n % 64 of word n / 64).
pub fn write_value(
    out: &mut impl Write,
    id: LaunchId,
    said: u64,
    masks: Option<(&[u64], &[u64])>,
) -> fmt::Result {
    write!(out, "{VAR}=v1;id={id};said={said:x}")?;
    if let Some((launch, placed)) = masks {
        out.write_str(";mask=")?;
        write_cpulist(out, launch)?;
        out.write_char('/')?;
        write_cpulist(out, placed)?;
    }
    Ok(())
}

/// A fixed buffer that `write!` fills without allocating; `overflowed` when it did not fit.
pub struct StackText<const N: usize> {
    bytes: [u8; N],
    len: usize,
    pub overflowed: bool,
}

impl<const N: usize> StackText<N> {
    pub const fn new() -> Self {
        StackText {
            bytes: [0; N],
            len: 0,
            overflowed: false,
        }
    }

    /// The text with a terminating NUL, as a C string; `None` when it overflowed.
    pub fn as_c_bytes(&mut self) -> Option<&[u8]> {
        if self.overflowed || self.len >= N {
            return None;
        }
        self.bytes[self.len] = 0;
        Some(&self.bytes[..=self.len])
    }
}

impl<const N: usize> Default for StackText<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> Write for StackText<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // One byte stays free for the NUL.
        if self.len + s.len() >= N {
            self.overflowed = true;
            return Err(fmt::Error);
        }
        self.bytes[self.len..self.len + s.len()].copy_from_slice(s.as_bytes());
        self.len += s.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(list: &str) -> Vec<u64> {
        let mask = CpuMask::parse_list(list).unwrap();
        let mut out = vec![0u64; 2];
        for cpu in mask.iter() {
            out[cpu / 64] |= 1 << (cpu % 64);
        }
        out
    }

    #[test]
    fn a_value_written_reads_back() {
        let id = LaunchId {
            pid: 41,
            start: 9000,
        };
        let mut text = StackText::<256>::new();
        write_value(
            &mut text,
            id,
            0xabc,
            Some((&words("0-3,64,66-70"), &words("2"))),
        )
        .unwrap();
        let c = text.as_c_bytes().unwrap();
        let line = std::str::from_utf8(&c[..c.len() - 1]).unwrap();
        assert_eq!(
            line,
            "TLLM_AFFINITY_LAUNCH=v1;id=41-9000;said=abc;mask=0-3,64,66-70/2"
        );
        let handed = Handed::parse(line.split_once('=').unwrap().1).unwrap();
        assert_eq!(handed.id, id);
        assert_eq!(handed.said, Some(0xabc));
        let (launch, placed) = handed.masks.clone().unwrap();
        assert_eq!(launch.to_list(), "0-3,64,66-70");
        assert_eq!(placed.to_list(), "2");
        assert_eq!(
            handed.launch_mask_for(&CpuMask::parse_list("2").unwrap()),
            Some(launch)
        );
        assert_eq!(
            handed.launch_mask_for(&CpuMask::parse_list("0").unwrap()),
            None
        );
    }

    #[test]
    fn malformed_values_are_ignored() {
        for bad in [
            "",
            "v2;id=1-2",
            "v1",
            "v1;id=x-2",
            "v1;id=1-2;said=zz",
            "v1;id=1-2;mask=0",
        ] {
            assert_eq!(Handed::parse(bad), None, "{bad:?}");
        }
        let no_masks = Handed::parse("v1;id=1-2;future=x").unwrap();
        assert_eq!((no_masks.said, no_masks.masks), (None, None));
    }

    #[test]
    fn the_fingerprint_covers_the_settings_alone_in_any_order() {
        let a = settings_fingerprint([
            ("TLLM_AFFINITY_POLICY", "numa"),
            ("PATH", "/bin"),
            ("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1"),
        ]);
        let b = settings_fingerprint([
            ("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1"),
            ("TLLM_AFFINITY_POLICY", "numa"),
            (VAR, "v1;id=1-2"),
        ]);
        assert_eq!(a, b);
        assert_ne!(a, settings_fingerprint([("TLLM_AFFINITY_POLICY", "numa")]));
        assert_ne!(
            settings_fingerprint([("TLLM_AFFINITY_POLICY", "a"), ("TLLM_AFFINITY_CPUS", "")]),
            settings_fingerprint([("TLLM_AFFINITY_POLICY", "a=TLLM_AFFINITY_CPUS")])
        );
    }

    #[test]
    fn a_full_buffer_says_so() {
        let mut text = StackText::<8>::new();
        assert!(write!(text, "0123456789").is_err());
        assert!(text.as_c_bytes().is_none());
    }
}
