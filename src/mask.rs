//! CPU masks sized at run time.
//!
//! `cpu_set_t` (and the `libc`/`nix` wrappers over it) stops at CPU 1023; the kernel's mask is as
//! wide as `nr_cpu_ids`. A [`CpuMask`] is a bit vector of 64-bit words that grows to whatever CPU
//! it is asked to hold, and converts to and from the kernel's byte layout (little-endian longs) of
//! any size.

use std::fmt;

/// A set of CPU numbers.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct CpuMask {
    words: Vec<u64>,
}

/// A cpulist that could not be parsed, with the offending text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuListError {
    pub text: String,
    pub reason: &'static str,
}

impl fmt::Display for CpuListError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "'{}' is not a cpulist ({})", self.text, self.reason)
    }
}

impl std::error::Error for CpuListError {}

/// Largest CPU number a cpulist may name; far above any machine, low enough that a typo cannot
/// make us allocate gigabytes.
pub const MAX_CPU: usize = 1 << 20;

impl CpuMask {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn from_cpus<I: IntoIterator<Item = usize>>(cpus: I) -> Self {
        let mut mask = Self::new();
        for cpu in cpus {
            mask.insert(cpu);
        }
        mask
    }

    pub fn insert(&mut self, cpu: usize) {
        let word = cpu / 64;
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (cpu % 64);
    }

    pub fn remove(&mut self, cpu: usize) {
        if let Some(w) = self.words.get_mut(cpu / 64) {
            *w &= !(1 << (cpu % 64));
        }
        self.trim();
    }

    pub fn contains(&self, cpu: usize) -> bool {
        self.words
            .get(cpu / 64)
            .is_some_and(|w| w & (1 << (cpu % 64)) != 0)
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn first(&self) -> Option<usize> {
        self.iter().next()
    }

    pub fn last(&self) -> Option<usize> {
        self.iter().last()
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            (0..64)
                .filter(move |b| w & (1u64 << b) != 0)
                .map(move |b| i * 64 + b)
        })
    }

    pub fn intersection(&self, other: &CpuMask) -> CpuMask {
        let mut out = CpuMask {
            words: self
                .words
                .iter()
                .zip(&other.words)
                .map(|(a, b)| a & b)
                .collect(),
        };
        out.trim();
        out
    }

    pub fn union(&self, other: &CpuMask) -> CpuMask {
        let (long, short) = if self.words.len() >= other.words.len() {
            (self, other)
        } else {
            (other, self)
        };
        let mut out = long.clone();
        for (w, s) in out.words.iter_mut().zip(&short.words) {
            *w |= s;
        }
        out
    }

    pub fn difference(&self, other: &CpuMask) -> CpuMask {
        let mut out = self.clone();
        for (w, o) in out.words.iter_mut().zip(&other.words) {
            *w &= !o;
        }
        out.trim();
        out
    }

    pub fn is_subset(&self, other: &CpuMask) -> bool {
        self.difference(other).is_empty()
    }

    /// True when `self` allows fewer CPUs than `other` does (a strict subset).
    pub fn is_narrower_than(&self, other: &CpuMask) -> bool {
        self.is_subset(other) && self != other
    }

    fn trim(&mut self) {
        while self.words.last() == Some(&0) {
            self.words.pop();
        }
    }

    /// Parses the kernel's cpulist format: `0-3,8,10-11`, whitespace around it ignored, an empty
    /// string meaning no CPU. A stride form `0-15:2` (every second CPU) is accepted as the kernel
    /// accepts it.
    pub fn parse_list(text: &str) -> Result<CpuMask, CpuListError> {
        let err = |reason| CpuListError {
            text: text.to_string(),
            reason,
        };
        let mut mask = CpuMask::new();
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Ok(mask);
        }
        for part in trimmed.split(',') {
            let part = part.trim();
            if part.is_empty() {
                return Err(err("empty element"));
            }
            let (range, stride) = match part.split_once(':') {
                Some((r, s)) => (r, parse_cpu(s).ok_or_else(|| err("bad stride"))?),
                None => (part, 1),
            };
            if stride == 0 {
                return Err(err("stride 0"));
            }
            let (lo, hi) = match range.split_once('-') {
                Some((a, b)) => (
                    parse_cpu(a).ok_or_else(|| err("bad range start"))?,
                    parse_cpu(b).ok_or_else(|| err("bad range end"))?,
                ),
                None => {
                    let cpu = parse_cpu(range).ok_or_else(|| err("bad CPU number"))?;
                    (cpu, cpu)
                }
            };
            if lo > hi {
                return Err(err("range start above its end"));
            }
            if hi > MAX_CPU {
                return Err(err("CPU number too large"));
            }
            for cpu in (lo..=hi).step_by(stride) {
                mask.insert(cpu);
            }
        }
        Ok(mask)
    }

    /// Formats as a cpulist with ranges (`0-3,8`), the inverse of [`CpuMask::parse_list`].
    pub fn to_list(&self) -> String {
        let mut out = String::new();
        let _ = write_cpulist(&mut out, &self.words);
        out
    }

    /// The mask as 64-bit words: CPU n is bit n % 64 of word n / 64.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Parses the kernel's hex mask format (`Cpus_allowed: ff,ffffffff`).
    pub fn parse_hex(text: &str) -> Option<CpuMask> {
        let mut mask = CpuMask::new();
        let groups: Vec<&str> = text.trim().split(',').collect();
        for (i, group) in groups.iter().rev().enumerate() {
            let value = u32::from_str_radix(group, 16).ok()?;
            for bit in 0..32 {
                if value & (1 << bit) != 0 {
                    mask.insert(i * 32 + bit);
                }
            }
        }
        Some(mask)
    }

    /// The kernel's hex format (`%*pb`) over `nbits` bits, the inverse of
    /// [`CpuMask::parse_hex`]: comma-separated 32-bit groups, most significant first, the first
    /// group only as wide as the bits it holds.
    pub fn to_hex(&self, nbits: usize) -> String {
        let groups = nbits.div_ceil(32).max(1);
        (0..groups)
            .rev()
            .map(|g| {
                let value = (0..32)
                    .filter(|b| self.contains(g * 32 + b))
                    .fold(0u32, |acc, b| acc | (1 << b));
                let bits = if g + 1 == groups && !nbits.is_multiple_of(32) {
                    nbits % 32
                } else {
                    32
                };
                format!("{value:0width$x}", width = bits.div_ceil(4))
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The kernel's byte layout, `len` bytes long (a multiple of 8), bits beyond it dropped.
    pub fn to_kernel_bytes(&self, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.write_kernel_bytes(&mut out);
        out
    }

    /// Whether `bytes`, in the kernel's layout, name exactly this mask; allocates nothing.
    pub fn equals_kernel_bytes(&self, bytes: &[u8]) -> bool {
        let mut held = self.words.iter();
        let same = kernel_words(bytes).all(|word| word == held.next().copied().unwrap_or(0));
        same && held.next().is_none()
    }

    /// Fills `out` with the kernel's byte layout; bits beyond it are dropped.
    pub fn write_kernel_bytes(&self, out: &mut [u8]) {
        let mut words = self.words.iter();
        let mut chunks = out.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&words.next().copied().unwrap_or(0).to_le_bytes());
        }
        let tail = chunks.into_remainder();
        let last = words.next().copied().unwrap_or(0).to_le_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }

    pub fn from_kernel_bytes(bytes: &[u8]) -> CpuMask {
        let mut mask = CpuMask {
            words: kernel_words(bytes).collect(),
        };
        mask.trim();
        mask
    }
}

fn parse_cpu(text: &str) -> Option<usize> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

impl fmt::Debug for CpuMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuMask({})", self.to_list())
    }
}

impl fmt::Display for CpuMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_list())
    }
}

impl FromIterator<usize> for CpuMask {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        CpuMask::from_cpus(iter)
    }
}

/// The 64-bit words of a mask in the kernel's byte layout (little-endian longs), the last one
/// zero-padded when the length is not a whole number of words.
fn kernel_words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    let chunks = bytes.chunks_exact(8);
    let tail = chunks.remainder();
    let last = (!tail.is_empty()).then(|| {
        let mut word = [0u8; 8];
        word[..tail.len()].copy_from_slice(tail);
        u64::from_le_bytes(word)
    });
    chunks
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
        .chain(last)
}

/// A cpulist with ranges (`0-3,8`) from 64-bit words, without allocating.
pub fn write_cpulist(out: &mut impl std::fmt::Write, words: &[u64]) -> std::fmt::Result {
    let set = |cpu: usize| {
        words
            .get(cpu / 64)
            .is_some_and(|w| w & (1 << (cpu % 64)) != 0)
    };
    let total = words.len() * 64;
    let (mut cpu, mut first) = (0, true);
    while cpu < total {
        if !set(cpu) {
            cpu += 1;
            continue;
        }
        let start = cpu;
        while cpu + 1 < total && set(cpu + 1) {
            cpu += 1;
        }
        if !first {
            out.write_char(',')?;
        }
        first = false;
        if start == cpu {
            write!(out, "{start}")?;
        } else {
            write!(out, "{start}-{cpu}")?;
        }
        cpu += 1;
    }
    Ok(())
}

/// Test shorthand: the mask of a cpulist known to be valid.
#[cfg(test)]
pub(crate) fn mask(list: &str) -> CpuMask {
    CpuMask::parse_list(list).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_formats_cpulists() {
        let m = CpuMask::parse_list("0-3,8, 10-11\n").unwrap();
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(m.to_list(), "0-3,8,10-11");
        assert_eq!(CpuMask::parse_list("").unwrap(), CpuMask::new());
        assert_eq!(CpuMask::parse_list("0-7:2").unwrap().to_list(), "0,2,4,6");
    }

    #[test]
    fn rejects_malformed_cpulists() {
        for bad in ["a", "1-", "-1", "3-1", "1,,2", "1-2:0", "99999999999"] {
            assert!(CpuMask::parse_list(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn masks_beyond_cpu_1024_round_trip_through_kernel_bytes() {
        let m = CpuMask::parse_list("0,1023,1024,1500,4095").unwrap();
        assert!(m.contains(1500));
        assert_eq!(m.count(), 5);
        let bytes = m.to_kernel_bytes(4096 / 8);
        assert_eq!(bytes.len(), 512);
        assert_eq!(CpuMask::from_kernel_bytes(&bytes), m);
        // A kernel mask narrower than the set drops the CPUs it cannot name.
        let short = CpuMask::from_kernel_bytes(&m.to_kernel_bytes(128));
        assert_eq!(short.to_list(), "0,1023");
    }

    #[test]
    fn comparing_with_kernel_bytes_agrees_with_parsing_them() {
        let m = CpuMask::parse_list("0,63,64,1500").unwrap();
        for len in [8, 16, 128, 256, 512] {
            let bytes = m.to_kernel_bytes(len);
            assert_eq!(
                m.equals_kernel_bytes(&bytes),
                CpuMask::from_kernel_bytes(&bytes) == m,
                "{len} bytes"
            );
        }
        assert!(m.equals_kernel_bytes(&m.to_kernel_bytes(256)));
        assert!(
            !m.equals_kernel_bytes(&m.to_kernel_bytes(128)),
            "CPU 1500 cut off"
        );
        assert!(!mask("0,63,64").equals_kernel_bytes(&m.to_kernel_bytes(256)));
        assert!(CpuMask::new().equals_kernel_bytes(&[0u8; 16]));
        assert!(!CpuMask::new().equals_kernel_bytes(&[1, 0, 0, 0, 0, 0, 0, 0]));
    }

    #[test]
    fn set_operations() {
        let a = CpuMask::parse_list("0-3").unwrap();
        let b = CpuMask::parse_list("2-5,2000").unwrap();
        assert_eq!(a.intersection(&b).to_list(), "2-3");
        assert_eq!(a.union(&b).to_list(), "0-5,2000");
        assert_eq!(b.difference(&a).to_list(), "4-5,2000");
        assert!(CpuMask::parse_list("1").unwrap().is_narrower_than(&a));
        assert!(!a.is_narrower_than(&a));
        let mut c = b.clone();
        c.remove(2000);
        assert_eq!(c, CpuMask::parse_list("2-5").unwrap());
    }

    #[test]
    fn hex_masks_both_ways() {
        assert_eq!(CpuMask::parse_hex("3").unwrap().to_list(), "0-1");
        assert_eq!(CpuMask::parse_hex("1,00000001").unwrap().to_list(), "0,32");
        assert_eq!(mask("0-1").to_hex(2), "3");
        assert_eq!(mask("0-7").to_hex(8), "ff");
        assert_eq!(mask("0,32").to_hex(40), "01,00000001");
        let wide = mask("0-55,112-167");
        assert_eq!(wide.to_hex(224).split(',').count(), 7);
        assert_eq!(CpuMask::parse_hex(&wide.to_hex(224)), Some(wide));
    }
}
