//! The shapes of the kernel's small text files, parsed in one place: a hex number (a PCI
//! `vendor`'s `0x10de`), a number where a negative one means "unknown" (`numa_node`'s `-1`), a
//! row of numbers (a node's `distance`), a `N<node>=<count>` token (`memory.numa_stat`,
//! `numa_maps`), a line of `numa_maps` (for the engine's memory move and the CLI's `ps`), a field of `/proc/<pid>/stat`, the value of a `Key: value` line
//! (`/proc/<pid>/status`, the NVIDIA driver's `information`), a file that may be absent, and
//! another process's file read with a cap on its size.
//!
//! Cpulists (`0-3,8`) and hex masks (`ff,ffffffff`) make a mask, so they are the mask's own text
//! forms, both ways: `CpuMask::parse_list` / `to_list` and `parse_hex` / `to_hex` in `mask.rs`.
//!
//! Each parser takes the text as read (trimmed where the file ends in a newline) and answers
//! `None` for what the kernel would not write there; the caller names the file and what it
//! expected.

#![forbid(unsafe_code)]

use std::fs;
use std::io;
use std::path::Path;
use std::str::FromStr;

/// The text of a file that may be absent (sysfs leaves out what a device does not have):
/// `Ok(None)` when it does not exist.
pub fn read_if_present(path: &Path) -> io::Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// At most `cap` bytes of `path`, as text (invalid UTF-8 replaced: kept visible, escaped when
/// shown): another process's `/proc` file, whose size is not ours to trust.
pub fn read_capped(path: &Path, cap: u64) -> io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    fs::File::open(path)?.take(cap).read_to_end(&mut bytes)?;
    Ok(String::from_utf8(bytes)
        .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
}

/// A hex number, with or without `0x` (`0x10de`, `0x030200`, `3b`).
pub fn hex_number(text: &str) -> Option<u64> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    u64::from_str_radix(digits, 16).ok()
}

/// A non-negative number, or a negative one meaning "unknown" (`Some(None)`): the kernel writes
/// `-1` for a device's unknown `numa_node` and, on some ARM and VM kernels, for the package.
pub fn number_or_unknown(text: &str) -> Option<Option<usize>> {
    let value: i64 = text.parse().ok()?;
    Some(usize::try_from(value).ok())
}

/// Numbers separated by white space (`10 21`, a node's `distance` row); `None` when one is not.
pub fn numbers<T: FromStr>(text: &str) -> Option<Vec<T>> {
    text.split_whitespace()
        .map(|word| word.parse().ok())
        .collect()
}

/// The value of the first `key: value` line of `text` (`/proc/<pid>/status`, the driver's
/// `information` files), without the white space around it; `None` when no line has that key.
pub fn keyed_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        (name.trim() == key).then(|| value.trim())
    })
}

/// A `N<node>=<count>` token, as `memory.numa_stat` and `numa_maps` write them.
pub fn node_count(word: &str) -> Option<(usize, u64)> {
    let (node, count) = word.strip_prefix('N')?.split_once('=')?;
    Some((node.parse().ok()?, count.parse().ok()?))
}

/// One mapping of `/proc/<pid>/numa_maps`: its start, whether its policy is the default, its page
/// size and its resident pages per node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePages {
    pub start: u64,
    pub default_policy: bool,
    pub page_bytes: u64,
    pub pages: Vec<(usize, u64)>,
}

/// One line of `/proc/<pid>/numa_maps` (`7f00... default anon=3 N0=2 N1=1 kernelpagesize_kB=4`):
/// `Ok(None)` for a mapping without a resident page, an error naming what the kernel would not
/// write there.
pub fn numa_maps_line(line: &str) -> Result<Option<NodePages>, String> {
    let mut words = line.split_whitespace();
    let address = words.next().unwrap_or_default();
    let start = u64::from_str_radix(address, 16)
        .map_err(|_| format!("{address:?} is not a mapping's address"))?;
    let policy = words.next().unwrap_or_default();
    let mut page_kb = None;
    let mut pages = Vec::new();
    for word in words {
        if let Some(kb) = word.strip_prefix("kernelpagesize_kB=") {
            page_kb = Some(kb.parse::<u64>().map_err(|_| format!("page size {kb:?}"))?);
        } else if word.starts_with('N') && word.contains('=') {
            pages.push(node_count(word).ok_or_else(|| format!("{word:?} is not N<node>=<pages>"))?);
        }
    }
    if pages.is_empty() {
        return Ok(None);
    }
    let page_kb = page_kb.ok_or("pages without kernelpagesize_kB")?;
    Ok(Some(NodePages {
        start,
        default_policy: policy == "default",
        page_bytes: page_kb.saturating_mul(1024),
        pages,
    }))
}

/// Field `n` of a `/proc/<pid>/stat` line, numbered from 1 as proc(5) does. Counted from the
/// last `)`: the command name (field 2) may hold spaces and parentheses.
pub fn stat_field<T: FromStr>(stat: &str, n: usize) -> Option<T> {
    let after = &stat[stat.rfind(')')? + 1..];
    after
        .split_whitespace()
        .nth(n.checked_sub(3)?)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_numbers_with_or_without_their_prefix() {
        assert_eq!(hex_number("0x10de"), Some(0x10de));
        assert_eq!(hex_number("0X030200"), Some(0x030200));
        assert_eq!(hex_number("3b"), Some(0x3b));
        for bad in ["", "0x", "nvidia", "0x10de\n", "-1"] {
            assert_eq!(hex_number(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_negative_number_is_unknown_and_a_word_is_no_number() {
        assert_eq!(number_or_unknown("3"), Some(Some(3)));
        assert_eq!(number_or_unknown("-1"), Some(None));
        assert_eq!(number_or_unknown("three"), None);
        assert_eq!(number_or_unknown(""), None);
    }

    #[test]
    fn rows_of_numbers() {
        assert_eq!(numbers::<u32>("10 21\n"), Some(vec![10, 21]));
        assert_eq!(numbers::<u32>(""), Some(vec![]));
        assert_eq!(numbers::<u32>("10 x"), None);
    }

    #[test]
    fn keyed_values_of_status_and_driver_files() {
        let status = "Name:\tpython3\nUid:\t1000\t1000\t1000\t1000\nNSpid:\t412\t7\n";
        assert_eq!(keyed_value(status, "Uid"), Some("1000\t1000\t1000\t1000"));
        assert_eq!(keyed_value(status, "NSpid"), Some("412\t7"));
        assert_eq!(keyed_value(status, "Gid"), None);
        let information = "Model: \t\t NVIDIA H100\nGPU UUID: \t GPU-8f3c\nDevice Minor: \t 3\n";
        assert_eq!(keyed_value(information, "GPU UUID"), Some("GPU-8f3c"));
        assert_eq!(keyed_value(information, "Device Minor"), Some("3"));
        assert_eq!(keyed_value("Device Minor:\n", "Device Minor"), Some(""));
    }

    #[test]
    fn node_count_tokens() {
        assert_eq!(node_count("N1=4096"), Some((1, 4096)));
        for bad in ["anon=3", "N=3", "N1=", "N1", "Nx=3", "N1=-2"] {
            assert_eq!(node_count(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 7 0 12345 0";
        assert_eq!(stat_field::<u64>(stat, 4), Some(1));
        assert_eq!(stat_field::<usize>(stat, 20), Some(7));
        assert_eq!(stat_field::<u64>(stat, 22), Some(12345));
        assert_eq!(stat_field::<u64>(stat, 2), None);
        assert_eq!(stat_field::<u64>(stat, 99), None);
        assert_eq!(stat_field::<u64>("no parenthesis 1 2", 3), None);
    }

    #[test]
    fn an_absent_file_is_none_and_a_present_one_its_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("numa_node");
        assert_eq!(read_if_present(&path).unwrap(), None);
        fs::write(&path, "1\n").unwrap();
        assert_eq!(read_if_present(&path).unwrap().as_deref(), Some("1\n"));
        assert!(read_if_present(dir.path()).is_err());
    }
}
