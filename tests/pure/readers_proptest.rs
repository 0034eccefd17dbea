//! Issue 44, the readers fuzzed: the thread-table reader (`threadtable::open` and its records,
//! notes and leases) over files of arbitrary bytes and sizes — a believable header or not, sparse
//! files far past a table's size — never panics, and never reads more than a table's size
//! ([`threadtable::FILE_BYTES`]), measured with this thread's own read counter
//! (`/proc/thread-self/io`). `TLLM_AFFINITY_FUZZ_CASES` sets the number of cases (a bench run
//! asks for millions; CI runs a few hundred, in seconds).

use std::os::unix::fs::FileExt;
use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tllm_affinity_core::identity::{Placement, Role};
use tllm_affinity_core::table::threadtable::{self, Expect, FILE_BYTES, HEADER_BYTES};
use tllm_affinity_core::table::untrusted::Dir;

fn cases(default: u32) -> u32 {
    std::env::var("TLLM_AFFINITY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Bytes this thread has read so far (`rchar`).
fn read_by_this_thread() -> u64 {
    let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .unwrap()
        .parse()
        .unwrap()
}

/// What lies at the table's name: a start (a real header of this process, damaged or not, or
/// arbitrary bytes), bytes written at an arbitrary offset, and an arbitrary size.
#[derive(Debug, Clone)]
struct Planted {
    header: bool,
    start: Vec<u8>,
    at: u64,
    more: Vec<u8>,
    size: u64,
    notes_word: Option<u64>,
    leases_word: Option<u64>,
}

fn planted() -> impl Strategy<Value = Planted> {
    (
        any::<bool>(),
        prop::collection::vec(any::<u8>(), 0..200),
        0..(FILE_BYTES as u64 + 4096),
        prop::collection::vec(any::<u8>(), 0..9000),
        prop_oneof![
            0..(HEADER_BYTES as u64 * 2),
            0..(FILE_BYTES as u64 + 1),
            Just(FILE_BYTES as u64),
            (FILE_BYTES as u64)..(1u64 << 40),
        ],
        prop::option::of(any::<u64>()),
        prop::option::of(any::<u64>()),
    )
        .prop_map(
            |(header, start, at, more, size, notes_word, leases_word)| Planted {
                header,
                start,
                at,
                more,
                size,
                notes_word,
                leases_word,
            },
        )
}

#[test]
fn the_table_reader_takes_any_bytes_and_size_and_reads_at_most_a_table() {
    let dir = tempfile::tempdir().unwrap();
    let pid = std::process::id();
    let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap();
    let name = threadtable::file_name(pid, namespace);
    let path = dir.path().join(&name);
    let owner = std::fs::metadata(dir.path())
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap();
    let tids: Vec<i32> = (0..64).chain([pid as i32]).collect();
    let mut runner = TestRunner::new(Config {
        cases: cases(300),
        failure_persistence: None,
        ..Config::default()
    });
    let executed = std::cell::Cell::new(0u64);
    let result = runner.run(&planted(), |p| {
        executed.set(executed.get() + 1);
        let _ = std::fs::remove_file(&path);
        let file = std::fs::File::create(&path).unwrap();
        let mut start = p.start.clone();
        if p.header {
            let mut head = threadtable::header(pid, threadtable::start_time(pid).unwrap()).to_vec();
            if let Some(w) = p.notes_word {
                head[40..48].copy_from_slice(&w.to_le_bytes());
            }
            if let Some(w) = p.leases_word {
                head[56..64].copy_from_slice(&w.to_le_bytes());
            }
            head.extend(
                threadtable::encode(pid as i32, Role::Worker, Placement::Step).to_le_bytes(),
            );
            head.extend(start);
            start = head;
        }
        file.write_all_at(&start, 0).unwrap();
        file.write_all_at(&p.more, p.at).unwrap();
        file.set_len(p.size).unwrap();
        drop(file);
        let expect = Expect {
            pid,
            proc_pid: pid,
            namespace,
            owner,
            tids: &tids,
        };
        let before = read_by_this_thread();
        let table_dir = Dir::open(dir.path()).unwrap();
        if let Ok(table) = threadtable::open(&table_dir, &expect) {
            let _ = table.records(&tids);
            let _ = table.notes();
            let _ = table.leases();
        }
        // Three whole tables' worth at most (records, notes, leases each read once), plus
        // the reader's own look at /proc.
        let read = read_by_this_thread() - before;
        prop_assert!(
            read <= FILE_BYTES as u64 + 64 * 1024,
            "read {read} bytes of a {}-byte file",
            p.size
        );
        if p.size > FILE_BYTES as u64 {
            prop_assert!(threadtable::open(&table_dir, &expect).is_err());
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!("fuzz table reader: {} cases executed", executed.get());
}
