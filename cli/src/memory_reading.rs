//! Reading a process's resident memory per NUMA node, for `tllm-affinity ps`: where its pages
//! are, so worker memory on the remote node shows as plainly as a wrong mask. (The library's own
//! memory: `memory_decision` in the core decides a move, the engine's `memory_effects` makes it
//! and `memory_preference` holds a worker scope's preference; each `numa_maps` line is read by
//! `kernel_text::numa_maps_line` for both.)
//!
//! Two sources. The cheap one is the cgroup v2 `memory.numa_stat` of a process alone in its
//! cgroup (a server in its own container): counters the kernel keeps, read in one small file.
//! Otherwise `/proc/PID/numa_maps`, which the kernel builds by walking the process's page
//! tables under its `mmap_lock`: it is read in pieces and given up after [`READ_LIMIT`] or
//! [`TIME_LIMIT`], so `ps` never holds up a server with hundreds of GB mapped for long (the
//! figures are then marked partial). Pages count `kernelpagesize_kB` each: hugetlb pages are huge.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};
use tllm_affinity_core::host::kernel_text::{node_count, numa_maps_line, read_capped};

/// The most of `numa_maps` read: about 100 000 mappings.
pub const READ_LIMIT: usize = 16 << 20;
/// The longest `ps` spends in `numa_maps`.
pub const TIME_LIMIT: Duration = Duration::from_secs(2);
/// The most read of a process's `cgroup`, its cgroup's `cgroup.procs` and `memory.numa_stat`.
const SMALL_FILE_BYTES: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMemory {
    /// Bytes per node.
    pub bytes: BTreeMap<usize, u64>,
    /// Where the figures come from, in words.
    pub source: String,
    /// Why the figures cover only part of the process, when they do.
    pub partial: Option<String>,
}

/// The memory per node of process `pid` (whose `/proc` directory is `proc_dir`), or why it
/// cannot be read.
pub fn read(proc_dir: &Path, pid: u32) -> Result<NodeMemory, String> {
    if let Some(memory) = from_own_cgroup(proc_dir, pid) {
        return Ok(memory);
    }
    let path = proc_dir.join("numa_maps");
    let file = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    from_numa_maps(
        file,
        &path.display().to_string(),
        Instant::now() + TIME_LIMIT,
    )
}

/// `memory.numa_stat` of the process's cgroup v2, when the process is the only one in it: its
/// anonymous and mapped file pages there (`anon` + `file_mapped`).
fn from_own_cgroup(proc_dir: &Path, pid: u32) -> Option<NodeMemory> {
    let cgroups = read_capped(&proc_dir.join("cgroup"), SMALL_FILE_BYTES).ok()?;
    let path = cgroups.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    // A cgroup of more processes than fit here is not one process's own.
    let procs = read_capped(&dir.join("cgroup.procs"), SMALL_FILE_BYTES).ok()?;
    if procs.split_whitespace().collect::<Vec<_>>() != [pid.to_string()] {
        return None;
    }
    let stat = read_capped(&dir.join("memory.numa_stat"), SMALL_FILE_BYTES).ok()?;
    let bytes = parse_numa_stat(&stat).ok()?;
    Some(NodeMemory {
        bytes,
        source: format!(
            "{} (anon + file_mapped; the process is alone in its cgroup)",
            dir.join("memory.numa_stat").display()
        ),
        partial: None,
    })
}

/// Sums `anon` and `file_mapped` per node from a cgroup v2 `memory.numa_stat` (`anon N0=4096
/// N1=0` lines, in bytes).
pub fn parse_numa_stat(text: &str) -> Result<BTreeMap<usize, u64>, String> {
    let mut bytes = BTreeMap::new();
    let mut seen = false;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if !matches!(words.next(), Some("anon" | "file_mapped")) {
            continue;
        }
        seen = true;
        for word in words {
            let (node, value) = node_count(word).ok_or_else(|| format!("malformed: {line:?}"))?;
            *bytes.entry(node).or_insert(0) += value;
        }
    }
    if !seen {
        return Err("no anon line".into());
    }
    Ok(bytes)
}

/// Reads `numa_maps` text from `source` until its end, [`READ_LIMIT`] or `deadline`, and sums
/// each mapping's pages per node times its page size.
pub fn from_numa_maps(
    mut source: impl Read,
    name: &str,
    deadline: Instant,
) -> Result<NodeMemory, String> {
    let mut bytes = BTreeMap::new();
    let mut pending = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let (mut read, mut line_number, mut partial) = (0usize, 0usize, None);
    loop {
        if read >= READ_LIMIT {
            partial = Some(format!("stopped after {} MiB of {name}", READ_LIMIT >> 20));
            break;
        }
        if Instant::now() >= deadline {
            partial = Some(format!(
                "stopped after {} s in {name} (the kernel walks the page tables to write it)",
                TIME_LIMIT.as_secs()
            ));
            break;
        }
        let n = source
            .read(&mut chunk)
            .map_err(|e| format!("{name}: {e}"))?;
        if n == 0 {
            break;
        }
        read += n;
        let before = pending.len();
        pending.extend_from_slice(&chunk[..n]);
        // Only the new bytes can end a line: a long line without one is not scanned again.
        let whole = pending[before..]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |at| before + at + 1);
        for line in pending[..whole]
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
        {
            line_number += 1;
            let line = std::str::from_utf8(line)
                .map_err(|_| format!("line {line_number} of {name} is not text"))?;
            add_mapping(line, &mut bytes)
                .map_err(|problem| format!("line {line_number} of {name}: {problem}"))?;
        }
        pending.drain(..whole);
    }
    if read == 0 {
        return Err(format!("{name} is empty"));
    }
    Ok(NodeMemory {
        bytes,
        source: name.to_string(),
        partial,
    })
}

/// Adds one `numa_maps` line's resident bytes per node.
fn add_mapping(line: &str, bytes: &mut BTreeMap<usize, u64>) -> Result<(), String> {
    if let Some(mapping) = numa_maps_line(line)? {
        for (node, count) in mapping.pages {
            *bytes.entry(node).or_insert(0) += count.saturating_mul(mapping.page_bytes);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[test]
    fn pages_count_their_own_page_size() {
        let text = "\
5587cef77000 default file=/usr/bin/head mapped=2 N0=2 kernelpagesize_kB=4
7f0000000000 bind:1 file=/dev/hugepages/x huge dirty=2 N1=2 kernelpagesize_kB=2048
7f1000000000 default anon=3 dirty=3 N0=1 N1=2 kernelpagesize_kB=4
7ffd0000000 default stack
";
        let m = from_numa_maps(text.as_bytes(), "maps", far()).unwrap();
        assert_eq!(m.bytes[&0], 3 * 4096);
        assert_eq!(m.bytes[&1], 2 * 2048 * 1024 + 2 * 4096);
        assert_eq!(m.partial, None);
    }

    #[test]
    fn a_malformed_line_is_named() {
        let bad = "5587cef77000 default N0=2 kernelpagesize_kB=4\nnot-an-address default N0=1\n";
        let e = from_numa_maps(bad.as_bytes(), "maps", far()).unwrap_err();
        assert!(e.contains("line 2 of maps"), "{e}");
        let e = from_numa_maps(
            "1000 default N0=x kernelpagesize_kB=4\n".as_bytes(),
            "maps",
            far(),
        )
        .unwrap_err();
        assert!(e.contains("N0=x"), "{e}");
        assert!(from_numa_maps(&b""[..], "maps", far())
            .unwrap_err()
            .contains("empty"));
    }

    #[test]
    fn reading_stops_at_the_deadline_and_says_partial() {
        let text = "1000 default N0=1 kernelpagesize_kB=4\n".repeat(10);
        let m = from_numa_maps(text.as_bytes(), "maps", Instant::now()).unwrap_err();
        // Nothing read before the deadline: no figures to give.
        assert!(m.contains("empty"), "{m}");
        struct Slow(usize);
        impl Read for Slow {
            fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
                std::thread::sleep(Duration::from_millis(20));
                self.0 += 1;
                let line = b"1000 default N1=1 kernelpagesize_kB=4\n";
                out[..line.len()].copy_from_slice(line);
                Ok(line.len())
            }
        }
        let m =
            from_numa_maps(Slow(0), "maps", Instant::now() + Duration::from_millis(100)).unwrap();
        assert!(
            m.partial.as_deref().unwrap().contains("stopped after"),
            "{m:?}"
        );
        assert!(m.bytes[&1] >= 4096);
    }

    #[test]
    fn numa_stat_sums_anon_and_mapped_files() {
        let stat =
            "anon N0=4096 N1=8192\nfile N0=999999 N1=0\nfile_mapped N0=4096 N1=0\nshmem N0=1\n";
        let b = parse_numa_stat(stat).unwrap();
        assert_eq!(b[&0], 8192);
        assert_eq!(b[&1], 8192);
        assert!(parse_numa_stat("anon N0=x\n").is_err());
        assert!(parse_numa_stat("file N0=1\n").is_err());
    }

    #[test]
    fn this_process_has_memory_on_a_node() {
        let m = read(Path::new("/proc/self"), std::process::id()).unwrap();
        assert!(m.bytes.values().sum::<u64>() > 0, "{m:?}");
    }

    /// Any bytes, of any length (an endless stream included), never panic the reader, and it
    /// reads at most [`READ_LIMIT`] and one chunk more.
    #[test]
    fn numa_maps_reader_takes_any_bytes_and_stops_at_its_cap() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        /// `pattern` repeated until `length` bytes were served (`None`: forever).
        struct Repeating {
            pattern: Vec<u8>,
            length: Option<u64>,
            served: u64,
        }
        impl Read for Repeating {
            fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
                let left = self.length.map_or(u64::MAX, |l| l - self.served);
                let n = (out.len() as u64).min(left) as usize;
                if self.pattern.is_empty() {
                    return Ok(0);
                }
                for (i, b) in out[..n].iter_mut().enumerate() {
                    *b = self.pattern[(self.served as usize + i) % self.pattern.len()];
                }
                self.served += n as u64;
                Ok(n)
            }
        }
        let lines = prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            "([0-9a-f]{1,12} [a-z=]{0,12}( N[0-9]{1,3}=[0-9]{1,20}| kernelpagesize_kB=[0-9]{1,20}| [a-z]+=[0-9]{1,20}){0,6}\n){1,20}"
                .prop_map(String::into_bytes),
        ];
        let length = prop_oneof![
            4 => (0u64..100_000).prop_map(Some),
            1 => Just(None),
        ];
        let cases = std::env::var("TLLM_AFFINITY_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200);
        let mut runner = TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&(lines, length), |(pattern, length)| {
                let mut source = Repeating {
                    pattern,
                    length,
                    served: 0,
                };
                let _ = from_numa_maps(&mut source, "fuzz", far());
                prop_assert!(source.served <= (READ_LIMIT + 64 * 1024) as u64);
                Ok(())
            })
            .unwrap();
        let stats = prop::collection::vec(any::<String>(), 0..10);
        runner
            .run(&stats, |texts| {
                let _ = parse_numa_stat(&texts.join("\n"));
                Ok(())
            })
            .unwrap();
    }
}
