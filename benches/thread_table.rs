//! What `ps` and the host view pay to read a thread table: `Table::records` over a full table
//! (a million records) asked for 20 000 threads, half of them not in it, so that every record
//! is read. Linear in records plus threads; a search of the threads per record (what it was
//! before issue 56) took records x threads.

use std::path::Path;

use criterion::{criterion_group, Criterion};
use tllm_affinity_core::identity::{Placement, Role, Tid};
use tllm_affinity_core::table::threadtable::{self, Expect};
use tllm_affinity_core::table::untrusted::Dir;

fn records(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let pid = std::process::id();
    let namespace =
        threadtable::pid_namespace(Path::new("/proc/self")).expect("this process's namespace");
    let start = threadtable::start_time(pid).expect("this process's start time");
    let records = 1_000_000u32;
    let mut bytes = threadtable::header(pid, start).to_vec();
    for tid in 1..=records {
        let (role, placement) = if tid % 2 == 0 {
            (Role::Worker, Placement::Worker)
        } else {
            (Role::Host, Placement::Inherited)
        };
        bytes.extend_from_slice(&threadtable::encode(tid as Tid, role, placement).to_le_bytes());
    }
    std::fs::write(
        dir.path().join(threadtable::file_name(pid, namespace)),
        &bytes,
    )
    .expect("the table written");
    let tids: Vec<Tid> = (1..=10_000u32)
        .map(|i| (i * 100) as Tid)
        .chain((1..=10_000u32).map(|i| (records + i) as Tid))
        .collect();
    let opened = Dir::open(dir.path()).expect("the directory");
    let expect = Expect {
        pid,
        proc_pid: pid,
        namespace,
        owner: tllm_affinity_core::sys::effective_uid(),
        tids: &tids,
    };
    let table = threadtable::open(&opened, &expect).expect("the table believed");
    let mut group = c.benchmark_group("thread table");
    group.sample_size(10);
    group.bench_function("records: 1 000 000 records, 20 000 threads", |b| {
        b.iter(|| {
            let found = table.records(&tids).expect("the records read");
            assert_eq!(found.len(), 10_000);
        })
    });
    group.finish();
}

criterion_group!(benches, records);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
