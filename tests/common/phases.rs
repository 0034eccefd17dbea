//! What a program under the library says at each phase, and the masks a test expects then.

use super::*;

/// One checkpoint of a population program: its threads by name, with the role the library
/// reported and the mask the kernel reports.
#[derive(Debug)]
pub struct Phase {
    pub name: String,
    pub threads: BTreeMap<String, ThreadSeen>,
}

#[derive(Debug, Clone)]
pub struct ThreadSeen {
    pub tid: i32,
    /// 0 host, 1 worker, negative errno (or -1 without the library).
    pub role: i32,
    pub mask: CpuMask,
}

impl Phase {
    pub fn mask(&self, thread: &str) -> String {
        self.thread(thread).mask.to_list()
    }

    pub fn role(&self, thread: &str) -> i32 {
        self.thread(thread).role
    }

    pub fn thread(&self, thread: &str) -> &ThreadSeen {
        self.threads
            .get(thread)
            .unwrap_or_else(|| panic!("phase {} has no thread {thread}", self.name))
    }

    /// Names of the threads whose kernel mask is `mask`.
    pub fn on(&self, mask: &str) -> Vec<String> {
        self.threads
            .iter()
            .filter(|(_, t)| t.mask.to_list() == mask)
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// A `PHASE` line's words after the prefix (`<name> <thread>=<tid>:<role> ...`), each named
/// thread's mask read from `/proc/<pid>/task/<tid>`, where `tid` is what `host_tid` makes of the
/// printed one (the identity, or a container's namespace tid mapped to ours). Threads gone since
/// they were noted are left out.
pub fn parse_phase(words: &str, pid: u32, host_tid: impl Fn(i32) -> Option<i32>) -> Phase {
    let mut words = words.split_whitespace();
    let name = words.next().unwrap_or_default().to_string();
    let threads = words
        .filter_map(|w| {
            let (thread, rest) = w.split_once('=')?;
            let (tid, role) = rest.split_once(':')?;
            let tid = host_tid(tid.parse().ok()?)?;
            let mask = try_kernel_mask(pid, tid)?;
            Some((
                thread.to_string(),
                ThreadSeen {
                    tid,
                    role: role.parse().ok()?,
                    mask,
                },
            ))
        })
        .collect();
    Phase { name, threads }
}

/// The threads of a phase an [`expect`] speaks of.
#[derive(Clone, Copy, Debug)]
pub enum Threads<'a> {
    /// Every thread the phase lists.
    All,
    /// These threads, each of which the phase must list.
    Named(&'a [&'a str]),
    /// The threads whose names match a pattern (a name prefix, or `head*tail`); each pattern
    /// must match at least one.
    Matching(&'a [&'a str]),
}

/// Whether a thread's name matches one of `patterns`: each a name prefix, or `head*tail`.
pub fn matches(name: &str, patterns: &[&str]) -> bool {
    patterns.iter().any(|p| match p.split_once('*') {
        Some((head, tail)) => {
            name.len() >= head.len() + tail.len() && name.starts_with(head) && name.ends_with(tail)
        }
        None => name.starts_with(p),
    })
}

pub use Threads::{All, Matching, Named};

/// What an [`expect`] asks of each thread it picks: a kernel mask and, where it says one, a role
/// (0 host, 1 worker).
#[derive(Clone, Copy, Debug)]
pub struct Want<'a> {
    pub mask: &'a str,
    pub role: Option<i32>,
}

/// On `mask`, whatever the role.
pub fn on(mask: &str) -> Want<'_> {
    Want { mask, role: None }
}

/// A host thread on `mask`.
pub fn host_on(mask: &str) -> Want<'_> {
    Want {
        mask,
        role: Some(0),
    }
}

/// A worker thread on `mask`.
pub fn worker_on(mask: &str) -> Want<'_> {
    Want {
        mask,
        role: Some(1),
    }
}

/// The thread-table assertion of every phase test: each thread `threads` picks in `phase` is as
/// `want` says; `why` and the whole table are in the message.
pub fn expect(phase: &Phase, threads: Threads, want: Want, why: &str) {
    let picked: Vec<(&String, &ThreadSeen)> = match threads {
        All => phase.threads.iter().collect(),
        Named(names) => names
            .iter()
            .map(|n| {
                phase
                    .threads
                    .get_key_value(*n)
                    .unwrap_or_else(|| panic!("{}: no thread {n}: {}", phase.name, describe(phase)))
            })
            .collect(),
        Matching(patterns) => {
            present(phase, patterns);
            phase
                .threads
                .iter()
                .filter(|(n, _)| matches(n, patterns))
                .collect()
        }
    };
    for (name, seen) in picked {
        assert_eq!(
            (seen.mask.to_list().as_str(), seen.role),
            (want.mask, want.role.unwrap_or(seen.role)),
            "{} {name} (tid {}): {why}\n{}",
            phase.name,
            seen.tid,
            describe(phase)
        );
    }
}

/// Each of `patterns` (see [`matches`]) names at least one thread of `phase`.
pub fn present(phase: &Phase, patterns: &[&str]) {
    for p in patterns {
        assert!(
            phase.threads.keys().any(|n| matches(n, &[p])),
            "{}: no thread {p}: {}",
            phase.name,
            describe(phase)
        );
    }
}

/// With the library: every thread `workers` matches (see [`matches`]) is a worker on `worker`,
/// every other thread a host on `host`.
pub fn placed(phase: &Phase, workers: &[&str], worker: &str, host: &str, why: &str) {
    for name in phase.threads.keys() {
        let want = if matches(name, workers) {
            worker_on(worker)
        } else {
            host_on(host)
        };
        expect(phase, Named(&[name]), want, why);
    }
}

/// One line per phase, `phase: thread=mask(role) ...`, for the tests' printed record (seen with
/// `--nocapture`, and on failure).
pub fn describe(phase: &Phase) -> String {
    let role = |r: i32| match r {
        0 => "host".to_string(),
        1 => "worker".to_string(),
        other => other.to_string(),
    };
    let threads: Vec<String> = phase
        .threads
        .iter()
        .map(|(n, t)| format!("{n}=[{}]({})", t.mask.to_list(), role(t.role)))
        .collect();
    format!("{}: {}", phase.name, threads.join(" "))
}
