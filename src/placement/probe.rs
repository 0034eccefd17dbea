//! `tllm-affinity probe`: what a thread handoff costs on this host, and whether pinning step
//! threads (`TLLM_AFFINITY_STEP_CORE`) is likely to pay.
//!
//! A decode step hands work between threads several times. When the woken thread's core sits in a
//! deep idle state, each handoff waits for the core to wake up (130-175 µs on a host with a
//! 170 µs C6, against 4-5 µs on a running core); on a host without deep idle states pinning gains
//! nothing and only adds queueing, and `auto`'s two cores make every step-to-result handoff cross
//! cores. So the probe measures one-way wake latency for each kind of CPU pair the process mask
//! offers, reads the cpuidle exit latencies, and recommends by [`recommend`]'s rule.
//!
//! The measuring threads pin themselves with the raw `sched_setaffinity` of
//! [`crate::sys`]; the CLI does not preload the library.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::host::topology::{CpuIdleState, Topology};
use crate::mask::CpuMask;
use crate::sys;

/// How long the woken thread has been blocked before each wake-up: long enough for its core to
/// go idle, as a step thread's core does between steps.
pub const IDLE_GAP: Duration = Duration::from_micros(200);
/// An enabled idle state whose exit latency exceeds this (µs) is deep: C1E-class states stay
/// under it, C6-class states are far above.
pub const DEEP_IDLE_US: u64 = 20;
/// A cross-core handoff is slow when its median is at least this many times the near (SMT
/// sibling, else same-CPU) median ...
pub const SLOW_FACTOR: f64 = 3.0;
/// ... and at least this many µs above it (so that 2 µs against 0.5 µs does not count).
pub const SLOW_EXTRA_US: f64 = 20.0;

/// The kinds of CPU pair a handoff can cross.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairKind {
    SameCpu,
    SmtSiblings,
    SameNode,
    CrossNode,
}

impl PairKind {
    pub const ALL: [PairKind; 4] = [
        PairKind::SameCpu,
        PairKind::SmtSiblings,
        PairKind::SameNode,
        PairKind::CrossNode,
    ];

    pub fn label(self) -> &'static str {
        match self {
            PairKind::SameCpu => "same CPU",
            PairKind::SmtSiblings => "SMT siblings",
            PairKind::SameNode => "two cores, one node",
            PairKind::CrossNode => "two NUMA nodes",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            PairKind::SameCpu => "same_cpu",
            PairKind::SmtSiblings => "smt_siblings",
            PairKind::SameNode => "same_node",
            PairKind::CrossNode => "cross_node",
        }
    }
}

/// One CPU pair of each kind within `allowed`, where the host has one.
pub fn find_pairs(
    topology: &Topology,
    allowed: &CpuMask,
) -> Vec<(PairKind, Option<(usize, usize)>)> {
    let allowed = allowed.intersection(&topology.online);
    let cores: Vec<CpuMask> = topology
        .cores()
        .iter()
        .map(|c| c.intersection(&allowed))
        .filter(|c| !c.is_empty())
        .collect();
    let first = |c: &CpuMask| c.first().unwrap_or_default();
    let same_cpu = allowed.last().map(|c| (c, c));
    let smt = cores.iter().find(|c| c.count() >= 2).map(|c| {
        let mut cpus = c.iter();
        (
            cpus.next().unwrap_or_default(),
            cpus.next().unwrap_or_default(),
        )
    });
    let node = |c: &CpuMask| topology.node_of_cpu(first(c));
    let same_node = cores.iter().enumerate().find_map(|(i, a)| {
        cores[i + 1..]
            .iter()
            .find(|b| node(b) == node(a))
            .map(|b| (first(a), first(b)))
    });
    let cross_node = cores.iter().enumerate().find_map(|(i, a)| {
        cores[i + 1..]
            .iter()
            .find(|b| node(a).is_some() && node(b).is_some() && node(b) != node(a))
            .map(|b| (first(a), first(b)))
    });
    vec![
        (PairKind::SameCpu, same_cpu),
        (PairKind::SmtSiblings, smt),
        (PairKind::SameNode, same_node),
        (PairKind::CrossNode, cross_node),
    ]
}

/// The measurement is cut into this many consecutive runs; the spread of their medians is the
/// probe's own run-to-run noise.
pub const RUNS: usize = 5;

/// One-way wake latency over many handoffs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    pub median_us: f64,
    pub p99_us: f64,
    pub samples: usize,
    /// The lowest and highest median of [`RUNS`] consecutive runs of the samples.
    pub runs_us: (f64, f64),
}

/// The `q` quantile of sorted samples in nanoseconds, in µs.
fn quantile_us(sorted: &[u64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

impl Latency {
    /// From samples in nanoseconds, in the order they were taken; `None` when there are none.
    pub fn from_ns(mut samples: Vec<u64>) -> Option<Latency> {
        if samples.is_empty() {
            return None;
        }
        let chunk = samples.len().div_ceil(RUNS);
        let run_medians: Vec<f64> = samples
            .chunks(chunk)
            .map(|run| {
                let mut run = run.to_vec();
                run.sort_unstable();
                quantile_us(&run, 0.5)
            })
            .collect();
        let lowest = run_medians.iter().copied().fold(f64::INFINITY, f64::min);
        let highest = run_medians.iter().copied().fold(0.0, f64::max);
        samples.sort_unstable();
        Some(Latency {
            median_us: quantile_us(&samples, 0.5),
            p99_us: quantile_us(&samples, 0.99),
            samples: samples.len(),
            runs_us: (lowest, highest),
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    NoPair,
    Measured(Latency),
    Failed(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub kind: PairKind,
    pub cpus: Option<(usize, usize)>,
    pub outcome: Outcome,
}

impl Case {
    fn median(&self) -> Option<f64> {
        match &self.outcome {
            Outcome::Measured(l) => Some(l.median_us),
            _ => None,
        }
    }
}

/// What the state of a ping-pong round is: the waker bumps `seq` after writing `stamp`.
#[derive(Default)]
struct Shared {
    seq: AtomicU64,
    /// When the last wake-up was sent, in ns since the start.
    stamp: AtomicU64,
    abort: AtomicBool,
}

fn pin_to(cpu: usize) -> Result<(), String> {
    sys::set_mask(0, &CpuMask::from_cpus([cpu])).map_err(|errno| {
        format!(
            "cannot pin a thread to CPU {cpu}: {}",
            std::io::Error::from_raw_os_error(errno)
        )
    })
}

/// Ping-pong between a thread on `a` and one on `b`: each round, one sleeps `gap`, stamps the
/// time and unparks the other (blocked in a futex wait); the other notes how long it took to run.
/// Both directions count, so `rounds` rounds give `2 × rounds` samples.
pub fn measure_handoff(
    a: usize,
    b: usize,
    rounds: usize,
    gap: Duration,
) -> Result<Latency, String> {
    let base = Instant::now();
    let now = || base.elapsed().as_nanos() as u64;
    let deadline = base + Duration::from_secs(10) + gap * 4 * rounds as u32;
    let shared = &Shared::default();
    let wait_for = |target: u64| -> Result<(), String> {
        loop {
            if shared.seq.load(Ordering::Acquire) >= target {
                return Ok(());
            }
            if shared.abort.load(Ordering::Acquire) {
                return Err("the other thread gave up".to_string());
            }
            if Instant::now() > deadline {
                shared.abort.store(true, Ordering::Release);
                return Err("timed out waiting for a wake-up".to_string());
            }
            thread::park_timeout(Duration::from_millis(50));
        }
    };
    let send = |seq: u64, to: &thread::Thread| {
        thread::sleep(gap);
        shared.stamp.store(now(), Ordering::Relaxed);
        shared.seq.store(seq, Ordering::Release);
        to.unpark();
    };
    let received = || now().saturating_sub(shared.stamp.load(Ordering::Relaxed));

    thread::scope(|s| {
        let pinger = s.spawn(|| -> Result<Vec<u64>, String> {
            pin_to(a)?;
            let me = thread::current();
            let ponger = s.spawn(move || -> Result<Vec<u64>, String> {
                let run = || -> Result<Vec<u64>, String> {
                    pin_to(b)?;
                    shared.seq.store(1, Ordering::Release);
                    me.unpark();
                    let mut samples = Vec::with_capacity(rounds);
                    for k in 0..rounds as u64 {
                        wait_for(2 * k + 2)?;
                        samples.push(received());
                        send(2 * k + 3, &me);
                    }
                    Ok(samples)
                };
                let out = run();
                if out.is_err() {
                    shared.abort.store(true, Ordering::Release);
                    me.unpark();
                }
                out
            });
            let other = ponger.thread().clone();
            let run = || -> Result<Vec<u64>, String> {
                wait_for(1)?;
                let mut samples = Vec::with_capacity(rounds);
                for k in 0..rounds as u64 {
                    send(2 * k + 2, &other);
                    wait_for(2 * k + 3)?;
                    samples.push(received());
                }
                Ok(samples)
            };
            let mine = run();
            if mine.is_err() {
                shared.abort.store(true, Ordering::Release);
                other.unpark();
            }
            let theirs = ponger
                .join()
                .map_err(|_| "the measuring thread panicked".to_string())?;
            // The ponger's error says why (a CPU it could not pin to) better than ours.
            // Interleaved, so that each run of [`Latency::from_ns`] holds both directions.
            let (theirs, mine) = (theirs?, mine?);
            Ok(theirs
                .iter()
                .zip(&mine)
                .flat_map(|(a, b)| [*a, *b])
                .collect::<Vec<u64>>())
        });
        pinger
            .join()
            .map_err(|_| "the measuring thread panicked".to_string())?
    })
    .and_then(|samples| Latency::from_ns(samples).ok_or_else(|| "no sample".to_string()))
}

/// The probe's advice for `TLLM_AFFINITY_STEP_CORE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recommendation {
    /// `auto` or `off`.
    pub step_core: &'static str,
    pub reason: String,
    /// The handoff figures sit so near the rule's threshold that the probe's own run-to-run
    /// spread could flip the answer: `off` (the default) stands, and the reason says so.
    pub too_close: bool,
}

/// The handoff half of the rule: `far` is slow against `near`.
fn slow_handoff(far_us: f64, near_us: f64) -> bool {
    far_us >= SLOW_FACTOR * near_us && far_us - near_us >= SLOW_EXTRA_US
}

/// The rule. `auto` pins the step thread to one core and the result thread to another, so every
/// step-to-result handoff crosses cores: the `far` handoff measured here is what `auto` pays on
/// each step, the `near` one (SMT siblings, else the same CPU) about what the scheduler gives
/// floating threads. Hence:
///
/// - a slow cross-core handoff (a median at least [`SLOW_FACTOR`] times and [`SLOW_EXTRA_US`] µs
///   above the near one) is a reason *against* `auto`: `off`. The project's own benchmark
///   (docs/server-benchmark.md, the step loop) ran on such a host, where this probe once said
///   `auto`, and measured `auto` slower than `off` on every figure;
/// - `auto` only where pinning can win and its handoff costs little: some enabled cpuidle state
///   takes more than [`DEEP_IDLE_US`] to exit (a busy pinned step core does not enter it, a
///   floating thread woken on an idle core waits for it) and the cross-core handoff is not slow;
/// - else `off`, the default: pinning three busy threads onto one core only adds queueing.
///
/// When the handoff rule gives another answer somewhere within the runs' spread of the two
/// medians and that decides (a deep idle state is enabled), the call is too close: `off`, saying
/// so.
pub fn recommend(cases: &[Case], idle_states: &[CpuIdleState]) -> Recommendation {
    let median = |kind| cases.iter().find(|c| c.kind == kind).and_then(Case::median);
    let runs = |kind| {
        cases
            .iter()
            .find(|c| c.kind == kind)
            .and_then(|c| match &c.outcome {
                Outcome::Measured(l) => Some(l.runs_us),
                _ => None,
            })
    };
    let near_runs = runs(PairKind::SmtSiblings).or_else(|| runs(PairKind::SameCpu));
    let far_runs = runs(PairKind::SameNode).or_else(|| runs(PairKind::CrossNode));
    let near = median(PairKind::SmtSiblings)
        .map(|m| (m, "on SMT siblings"))
        .or_else(|| median(PairKind::SameCpu).map(|m| (m, "on the same CPU")));
    let far = median(PairKind::SameNode)
        .map(|m| (m, "to another core"))
        .or_else(|| median(PairKind::CrossNode).map(|m| (m, "to another node")));
    let tail = "; auto also needs two allowed cores per GPU on its NUMA node (see `tllm-affinity \
                plan --gpu N`)";
    let off = |reason: String| Recommendation {
        step_core: "off",
        too_close: false,
        reason,
    };
    let deepest = idle_states
        .iter()
        .filter(|s| !s.disabled && s.latency_us > DEEP_IDLE_US)
        .max_by_key(|s| s.latency_us);
    let idle = match deepest {
        Some(state) => format!(
            "idle state {} is enabled and takes {} µs to exit",
            state.name, state.latency_us
        ),
        None => format!("no enabled idle state takes more than {DEEP_IDLE_US} µs to exit"),
    };
    let (Some((n, near_where)), Some((f, far_where))) = (near, far) else {
        return off(format!(
            "{idle}, and the mask has no two CPU pairs to compare: the cross-core handoff auto \
             would put on every step cannot be measured here, so the default off stands"
        ));
    };
    let (near_lo, near_hi) = near_runs.unwrap_or((n, n));
    let (far_lo, far_hi) = far_runs.unwrap_or((f, f));
    let slow = slow_handoff(f, n);
    let measured =
        format!("a handoff {far_where} takes {f:.1} µs (median) against {n:.1} µs {near_where}");
    // Only where the handoff decides (a deep idle state is enabled) can its spread flip the answer.
    let flips = slow_handoff(far_lo, near_hi) != slow || slow_handoff(far_hi, near_lo) != slow;
    if deepest.is_some() && flips {
        return Recommendation {
            step_core: "off",
            too_close: true,
            reason: format!(
                "too close to call: {measured} (runs {far_lo:.1}–{far_hi:.1} against \
                 {near_lo:.1}–{near_hi:.1}); a handoff {SLOW_FACTOR}× and {SLOW_EXTRA_US} µs \
                 slower would make auto cost on every step: the runs disagree, so the default \
                 off stands; measure again with more --rounds, or on the server's real load{tail}"
            ),
        };
    }
    if slow {
        return off(format!(
            "{measured}: auto pins the step and result threads to two cores, so every handoff \
             would take the slower path (docs/server-benchmark.md's step loop measured auto \
             slower than off on such a host); {idle}"
        ));
    }
    if deepest.is_none() {
        return off(format!(
            "{idle}, and {measured}: nothing for a pinned step core to win, and pinning the step \
             threads would only make them queue behind each other on one core"
        ));
    }
    Recommendation {
        step_core: "auto",
        too_close: false,
        reason: format!(
            "{idle}: a thread woken on an idle core waits for it, and a pinned step core stays \
             awake; {measured}, so the cross-core handoff auto puts on every step costs little \
             here; confirm on the server's load (scripts/bench --server's step loop compares \
             auto and off){tail}"
        ),
    }
}

/// Everything `tllm-affinity probe` prints.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    pub allowed: CpuMask,
    pub rounds: usize,
    pub gap: Duration,
    pub cases: Vec<Case>,
    pub idle_states: Vec<CpuIdleState>,
    pub recommendation: Recommendation,
}

/// Measures every kind of pair `allowed` offers on `topology` and recommends.
pub fn run(topology: &Topology, allowed: &CpuMask, rounds: usize) -> ProbeReport {
    let cases: Vec<Case> = find_pairs(topology, allowed)
        .into_iter()
        .map(|(kind, cpus)| Case {
            kind,
            cpus,
            outcome: match cpus {
                None => Outcome::NoPair,
                Some((a, b)) => match measure_handoff(a, b, rounds, IDLE_GAP) {
                    Ok(latency) => Outcome::Measured(latency),
                    Err(e) => Outcome::Failed(e),
                },
            },
        })
        .collect();
    let recommendation = recommend(&cases, &topology.idle_states);
    ProbeReport {
        allowed: allowed.intersection(&topology.online),
        rounds,
        gap: IDLE_GAP,
        cases,
        idle_states: topology.idle_states.clone(),
        recommendation,
    }
}

pub const NO_PAIR: &str = "n/a (no such CPU pair)";

impl ProbeReport {
    pub fn to_json(&self) -> Value {
        let cases: Vec<Value> = self
            .cases
            .iter()
            .map(|c| {
                let mut v = json!({
                    "case": c.kind.key(),
                    "cpus": c.cpus.map(|(a, b)| vec![a, b]),
                });
                match &c.outcome {
                    Outcome::NoPair => v["status"] = json!(NO_PAIR),
                    Outcome::Failed(e) => v["status"] = json!(format!("failed: {e}")),
                    Outcome::Measured(l) => {
                        v["status"] = json!("measured");
                        v["median_us"] = json!(round1(l.median_us));
                        v["p99_us"] = json!(round1(l.p99_us));
                        v["samples"] = json!(l.samples);
                    }
                }
                v
            })
            .collect();
        let idle: Vec<Value> = self
            .idle_states
            .iter()
            .map(|s| json!({"name": s.name, "exit_latency_us": s.latency_us, "disabled": s.disabled}))
            .collect();
        json!({
            "allowed_cpus": self.allowed.to_list(),
            "rounds": self.rounds,
            "idle_gap_us": self.gap.as_micros() as u64,
            "cases": cases,
            "idle_states": idle,
            "recommendation": {
                "step_core": self.recommendation.step_core,
                "too_close": self.recommendation.too_close,
                "reason": self.recommendation.reason,
            },
        })
    }

    pub fn to_text(&self) -> String {
        let mut out = format!(
            "thread handoff latency: one thread wakes another blocked in a futex wait, {} rounds \
             each way, the woken thread idle ~{} µs before each wake-up\nallowed CPUs: {}\n\n",
            self.rounds,
            self.gap.as_micros(),
            self.allowed
        );
        out.push_str(&format!(
            "  {:<20} {:<9} {:>11} {:>11}\n",
            "case", "CPUs", "median", "p99"
        ));
        for c in &self.cases {
            let cpus = c.cpus.map_or("-".to_string(), |(a, b)| format!("{a},{b}"));
            let row = match &c.outcome {
                Outcome::NoPair => NO_PAIR.to_string(),
                Outcome::Failed(e) => format!("failed: {e}"),
                Outcome::Measured(l) => format!("{:>8.1} µs {:>8.1} µs", l.median_us, l.p99_us),
            };
            out.push_str(&format!("  {:<20} {:<9} {row}\n", c.kind.label(), cpus));
        }
        out.push_str("\ncpuidle states (exit latency):\n");
        if self.idle_states.is_empty() {
            out.push_str("  none listed (no cpuidle driver, as in many VMs)\n");
        }
        for s in &self.idle_states {
            let off = if s.disabled { " (disabled)" } else { "" };
            out.push_str(&format!("  {:<12} {:>6} µs{off}\n", s.name, s.latency_us));
        }
        out.push_str(&format!(
            "\nrecommendation: TLLM_AFFINITY_STEP_CORE={}\n  {}\n",
            self.recommendation.step_core, self.recommendation.reason
        ));
        out
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::simulated::{dgx_h100_like, single_node_vm, two_node_one_gpu};

    use crate::mask::mask;

    fn pairs(t: &Topology, allowed: &str) -> Vec<Option<(usize, usize)>> {
        find_pairs(t, &mask(allowed))
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    }

    #[test]
    fn pairs_of_every_kind_where_the_mask_has_them() {
        let t = dgx_h100_like().topology();
        assert_eq!(
            pairs(&t, "0-223"),
            vec![
                Some((223, 223)),
                Some((0, 112)),
                Some((0, 1)),
                Some((0, 56))
            ]
        );
        // One sibling per core on node 0 only: no SMT pair, no second node.
        assert_eq!(
            pairs(&t, "0-3"),
            vec![Some((3, 3)), None, Some((0, 1)), None]
        );
        // One core on each node: siblings and a cross-node pair, no two cores on one node.
        assert_eq!(
            pairs(&t, "0,112,56"),
            vec![Some((112, 112)), Some((0, 112)), None, Some((0, 56))]
        );
        // This machine's shape in the tests: two CPUs, one node each.
        let t = two_node_one_gpu(&mask("0-1")).topology();
        assert_eq!(
            pairs(&t, "0-1"),
            vec![Some((1, 1)), None, None, Some((0, 1))]
        );
        let t = single_node_vm(2, 0).topology();
        assert_eq!(
            pairs(&t, "0-1"),
            vec![Some((1, 1)), None, Some((0, 1)), None]
        );
        assert_eq!(pairs(&t, "1"), vec![Some((1, 1)), None, None, None]);
    }

    #[test]
    fn percentiles() {
        let l = Latency::from_ns((1..=100).map(|x| x * 1000).collect()).unwrap();
        assert_eq!((l.median_us, l.p99_us, l.samples), (50.0, 99.0, 100));
        let l = Latency::from_ns(vec![7000]).unwrap();
        assert_eq!((l.median_us, l.p99_us), (7.0, 7.0));
        assert!(Latency::from_ns(Vec::new()).is_none());
    }

    fn measured(kind: PairKind, median_us: f64) -> Case {
        Case {
            kind,
            cpus: Some((0, 1)),
            outcome: Outcome::Measured(Latency {
                median_us,
                p99_us: median_us * 2.0,
                samples: 10,
                runs_us: (median_us, median_us),
            }),
        }
    }

    fn measured_with_runs(kind: PairKind, median_us: f64, runs_us: (f64, f64)) -> Case {
        let mut case = measured(kind, median_us);
        if let Outcome::Measured(l) = &mut case.outcome {
            l.runs_us = runs_us;
        }
        case
    }

    #[test]
    fn a_measurement_within_its_own_spread_of_the_threshold_is_too_close_to_call() {
        let deep = [idle("C6", 170, false)];
        // 6× slower across cores, but a run put it at 2.5×: whether auto costs flips run to run.
        let near = measured_with_runs(PairKind::SameCpu, 5.0, (4.0, 12.0));
        let far = measured_with_runs(PairKind::SameNode, 30.0, (28.0, 33.0));
        let r = recommend(&[near, far], &deep);
        assert_eq!(r.step_core, "off");
        assert!(r.too_close);
        assert!(r.reason.starts_with("too close to call"), "{}", r.reason);
        // The same medians with tight runs are a clear call: slow across cores, so off.
        let near = measured_with_runs(PairKind::SameCpu, 5.0, (4.8, 5.2));
        let far = measured_with_runs(PairKind::SameNode, 30.0, (29.0, 31.0));
        let r = recommend(&[near, far], &deep);
        assert_eq!((r.step_core, r.too_close), ("off", false));
        assert!(r.reason.contains("slower path"), "{}", r.reason);
        // A handoff clearly not slow, with a deep idle state: auto.
        let near = measured_with_runs(PairKind::SameCpu, 3.0, (2.9, 3.1));
        let far = measured_with_runs(PairKind::SameNode, 8.0, (7.5, 8.5));
        let r = recommend(&[near, far], &deep);
        assert_eq!((r.step_core, r.too_close), ("auto", false));
        // Without one, the spread never matters: both answers are off.
        let near = measured_with_runs(PairKind::SameCpu, 5.0, (4.0, 12.0));
        let far = measured_with_runs(PairKind::SameNode, 30.0, (28.0, 33.0));
        let r = recommend(&[near, far], &[]);
        assert_eq!((r.step_core, r.too_close), ("off", false));
    }

    #[test]
    fn runs_spread_comes_from_consecutive_runs() {
        let mut samples = vec![1000; 50];
        samples.extend(vec![9000; 50]);
        let l = Latency::from_ns(samples).unwrap();
        assert_eq!(l.runs_us, (1.0, 9.0));
    }

    fn idle(name: &str, latency_us: u64, disabled: bool) -> CpuIdleState {
        CpuIdleState {
            name: name.into(),
            latency_us,
            disabled,
        }
    }

    #[test]
    fn recommendation_rule() {
        let shallow = [
            idle("POLL", 0, false),
            idle("C1", 2, false),
            idle("C1E", 10, false),
        ];
        // The review's B300 host: C6 at 170 µs. Without a cross-core handoff measured, what auto
        // would cost is unknown: off, naming the idle state.
        let deep = [idle("POLL", 0, false), idle("C6", 170, false)];
        let r = recommend(&[], &deep);
        assert_eq!(r.step_core, "off");
        assert!(
            r.reason.contains("C6") && r.reason.contains("170 µs"),
            "{}",
            r.reason
        );
        // C6, and a cross-core handoff not slow: auto.
        let cheap = [
            measured(PairKind::SameCpu, 4.0),
            measured(PairKind::SameNode, 9.0),
        ];
        let r = recommend(&cheap, &deep);
        assert_eq!(r.step_core, "auto");
        assert!(
            r.reason.contains("C6") && r.reason.contains("9.0 µs"),
            "{}",
            r.reason
        );
        // The same state disabled does not count.
        let r = recommend(&cheap, &[idle("C6", 170, true)]);
        assert_eq!(r.step_core, "off");
        // The review's H100 VM: 22 µs to another core, 11 µs on one CPU.
        let vm = [
            measured(PairKind::SameCpu, 11.0),
            measured(PairKind::SameNode, 22.0),
        ];
        let r = recommend(&vm, &shallow);
        assert_eq!(r.step_core, "off");
        assert!(r.reason.contains("22.0 µs"), "{}", r.reason);
        // The project's benchmark host (docs/server-benchmark.md, run D): 51.7 µs across two
        // cores, 7.9 µs on one CPU, shallow idle states; auto measured slower there. Off.
        let bench = [
            measured(PairKind::SameCpu, 7.9),
            measured(PairKind::SameNode, 51.7),
        ];
        let r = recommend(
            &bench,
            &[idle("POLL", 0, false), idle("haltpoll", 1, false)],
        );
        assert_eq!(r.step_core, "off");
        assert!(
            r.reason.contains("51.7 µs") && r.reason.contains("7.9 µs"),
            "{}",
            r.reason
        );
        // 150 µs to another core against 5 µs on SMT siblings: the path auto forces is slow,
        // with or without a deep idle state.
        let slow = [
            measured(PairKind::SameCpu, 4.0),
            measured(PairKind::SmtSiblings, 5.0),
            measured(PairKind::SameNode, 150.0),
        ];
        for states in [&[][..], &deep[..]] {
            let r = recommend(&slow, states);
            assert_eq!(r.step_core, "off", "{states:?}");
            assert!(r.reason.contains("on SMT siblings"), "{}", r.reason);
            assert!(r.reason.contains("two cores"), "{}", r.reason);
        }
        // Three times slower but only a few µs apart is not slow.
        let tiny = [
            measured(PairKind::SameCpu, 1.0),
            measured(PairKind::CrossNode, 6.0),
        ];
        assert_eq!(recommend(&tiny, &deep).step_core, "auto");
        assert_eq!(recommend(&tiny, &[]).step_core, "off");
        // Nothing to compare.
        let one = [measured(PairKind::SameCpu, 3.0)];
        let r = recommend(&one, &deep);
        assert_eq!(r.step_core, "off");
        assert!(r.reason.contains("no two CPU pairs"), "{}", r.reason);
    }

    #[test]
    fn measures_a_real_handoff_on_this_machine() {
        let mine = sys::get_mask(0).unwrap();
        let cpu = mine.first().unwrap();
        let l = measure_handoff(cpu, cpu, 20, Duration::from_micros(50)).unwrap();
        assert_eq!(l.samples, 40);
        assert!(l.median_us > 0.0 && l.p99_us >= l.median_us, "{l:?}");
        let other = mine.iter().nth(1);
        if let Some(other) = other {
            let l = measure_handoff(cpu, other, 20, Duration::from_micros(50)).unwrap();
            assert_eq!(l.samples, 40);
        }
    }

    #[test]
    fn a_cpu_outside_the_mask_fails_the_case_without_hanging() {
        let mine = sys::get_mask(0).unwrap();
        let outside = (0..).find(|c| !mine.contains(*c)).unwrap();
        let e = measure_handoff(mine.first().unwrap(), outside, 5, Duration::ZERO).unwrap_err();
        assert!(e.contains(&format!("CPU {outside}")), "{e}");
        let e = measure_handoff(outside, mine.first().unwrap(), 5, Duration::ZERO).unwrap_err();
        assert!(e.contains(&format!("CPU {outside}")), "{e}");
    }

    #[test]
    fn report_shapes() {
        let t = two_node_one_gpu(&mask("0-1"))
            .idle_state("POLL", 0)
            .topology();
        let report = ProbeReport {
            allowed: mask("0-1"),
            rounds: 10,
            gap: IDLE_GAP,
            cases: vec![
                measured(PairKind::SameCpu, 3.0),
                Case {
                    kind: PairKind::SmtSiblings,
                    cpus: None,
                    outcome: Outcome::NoPair,
                },
            ],
            idle_states: t.idle_states.clone(),
            recommendation: recommend(&[], &t.idle_states),
        };
        let text = report.to_text();
        assert!(text.contains("SMT siblings"), "{text}");
        assert!(text.contains(NO_PAIR), "{text}");
        assert!(
            text.contains("recommendation: TLLM_AFFINITY_STEP_CORE=off"),
            "{text}"
        );
        let json = report.to_json();
        assert_eq!(json["cases"][0]["median_us"], 3.0);
        assert_eq!(json["cases"][1]["status"], NO_PAIR);
        assert_eq!(json["idle_states"][0]["name"], "POLL");
        assert_eq!(json["recommendation"]["step_core"], "off");
    }
}
