//! The environment variables of SPEC §3, §4, §6 and §8, parsed once at load.
//!
//! A malformed value never stops the parse: it yields one [`SettingError`] naming the variable,
//! the value and what was expected, and the setting falls back to its default. The engine then
//! decides (under `TLLM_AFFINITY_STRICT`) whether to stop the process or stay passive.

use std::ffi::OsStr;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::log::LogLevel;
use crate::mask::CpuMask;

/// `TLLM_AFFINITY_POLICY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyChoice {
    Auto,
    Numa,
    Clear,
    Keep,
}

/// `TLLM_NUMA_AWARE_WORKER_AFFINITY`, with the inference server's three meanings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NumaAwareFlag {
    Unset,
    One,
    /// Any other value: the server leaves masks alone.
    Other(String),
}

/// `TLLM_AFFINITY_STEP_CORE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepCore {
    Off,
    Auto,
    Cpu(usize),
}

/// `TLLM_AFFINITY_SLICE`: whether the GPUs sharing a node divide its CPUs (SPEC §18).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SliceMode {
    /// Every worker of a GPU gets the GPU's whole node (upstream's behaviour).
    Off,
    /// Each GPU's workers get its own slice of the node ([`crate::placement::slice`]).
    Gpu,
}

/// `TLLM_AFFINITY_PROCESS_ROLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessRole {
    Host,
    Worker,
}

/// `TLLM_AFFINITY_GPU`: the GPU `configure(-1)` and a dedicated worker mean (SPEC §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuChoice {
    /// A CUDA device number, mapped through `CUDA_VISIBLE_DEVICES`.
    Index(usize),
    /// A PCI address, normalised (`0000:3b:00.0`); it bypasses visibility.
    Address(String),
}

/// What a malformed `TLLM_AFFINITY_GPU` is told it should have been.
pub const GPU_EXPECTED: &str =
    "a CUDA device number (0, 1, ...) or a PCI address like 0000:3b:00.0";

/// The one parser of `TLLM_AFFINITY_GPU`, used at load (to refuse a malformed value) and at
/// configure (which reads the variable as it is then). `Ok(None)`: blank, which means unset.
pub fn parse_gpu(value: &str) -> Result<Option<GpuChoice>, &'static str> {
    let text = value.trim();
    if text.is_empty() {
        return Ok(None);
    }
    if let Some(index) = parse_index(text) {
        return Ok(Some(GpuChoice::Index(index)));
    }
    crate::host::topology::normalize_pci_address(text)
        .map(|address| Some(GpuChoice::Address(address)))
        .ok_or(GPU_EXPECTED)
}

/// A plain non-negative decimal number (no sign, no spaces), as CUDA reads an index.
pub fn parse_index(text: &str) -> Option<usize> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// The sonames whose threads are workers when `TLLM_AFFINITY_WORKER_LIBS` is unset: the progress
/// threads of NCCL, UCX, MPI (Open MPI's PAL/RTE, MPICH, Intel MPI) and libfabric.
pub const DEFAULT_WORKER_LIBS: &str = "libnccl*.so*,libucp*.so*,libuct*.so*,libucs*.so*,\
libmpi*.so*,libopen-pal*.so*,libopen-rte*.so*,libpmix*.so*,libfabric*.so*";

#[derive(Debug, Clone)]
pub struct Settings {
    pub policy: Option<PolicyChoice>,
    pub numa_aware: NumaAwareFlag,
    pub cpus_override: Option<CpuMask>,
    pub sysfs_root: PathBuf,
    pub worker_libs: Vec<glob::Pattern>,
    pub log: LogLevel,
    pub report_path: Option<PathBuf>,
    pub strict: bool,
    pub process_role: ProcessRole,
    pub step_core: StepCore,
    pub slice: SliceMode,
    pub lock_dir: PathBuf,
    /// `TLLM_AFFINITY_MOVE_MEMORY`: the most bytes of a dedicated worker's memory one configure
    /// moves to its node (`0`: never moved; `1`: [`DEFAULT_MOVE_MEMORY_CAP`]).
    pub move_memory: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            policy: None,
            numa_aware: NumaAwareFlag::Unset,
            cpus_override: None,
            sysfs_root: PathBuf::from("/"),
            worker_libs: parse_worker_libs(DEFAULT_WORKER_LIBS).unwrap_or_default(),
            log: LogLevel::Warn,
            report_path: None,
            strict: false,
            process_role: ProcessRole::Host,
            step_core: StepCore::Off,
            slice: SliceMode::Off,
            lock_dir: PathBuf::from("/tmp"),
            move_memory: DEFAULT_MOVE_MEMORY_CAP,
        }
    }
}

/// The off switch (SPEC §8): `1` leaves the library loaded and inert.
pub const DISABLE: &str = "TLLM_AFFINITY_DISABLE";

/// What `TLLM_AFFINITY_DISABLE` may be, said in the line a malformed value gives.
pub const DISABLE_EXPECTED: &str = "1 (the library stays loaded and changes nothing) or 0";

/// Whether the off switch's value disables the library: `1`, spaces aside. `0`, empty and unset do
/// not, nor does a malformed value (one line at load says so): a typo must not silently take
/// placement away from a fleet, and an operator who wants it off sees the line.
pub fn disabled_by(value: Option<&OsStr>) -> bool {
    value.is_some_and(|v| v.as_bytes().trim_ascii() == b"1")
}

/// The variables whose malformed value falls back to its default with one line while the library
/// stays active: those that only change what the library says, not where threads go, and the off
/// switch (a malformed one is "not disabled").
pub const COSMETIC_VARIABLES: [&str; 4] = [
    "TLLM_AFFINITY_LOG",
    "TLLM_AFFINITY_STRICT",
    "TLLM_AFFINITY_REPORT",
    DISABLE,
];

/// One malformed variable: rendered as the single line a user sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingError {
    pub variable: &'static str,
    pub value: String,
    pub expected: String,
}

impl SettingError {
    /// True for a variable of [`COSMETIC_VARIABLES`].
    pub fn is_cosmetic(&self) -> bool {
        COSMETIC_VARIABLES.contains(&self.variable)
    }

    /// What follows from a cosmetic variable's malformed value, for its line.
    pub fn fallback(&self) -> &'static str {
        if self.variable == DISABLE {
            "treated as not disabled: the library runs as usual"
        } else {
            "using its default"
        }
    }
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}='{}' is not valid: expected {}",
            self.variable,
            self.value.escape_debug(),
            self.expected
        )
    }
}

/// What `TLLM_AFFINITY_MOVE_MEMORY=1` (and unset) moves at most at one configure: 16 GiB, a few
/// seconds of copying on a current host, so that a retarget after a large model is loaded does
/// not stall its configure for long.
pub const DEFAULT_MOVE_MEMORY_CAP: u64 = 16 << 30;

/// `TLLM_AFFINITY_MOVE_MEMORY`: `0`, `1` (or empty: the default cap) or a size with a unit of
/// powers of 1024 (`64G`, `512M`, `1T`, `4096K`); `None` for anything else.
fn parse_move_memory(value: &str) -> Option<u64> {
    let value = value.trim();
    match value {
        "0" => return Some(0),
        "1" | "" => return Some(DEFAULT_MOVE_MEMORY_CAP),
        _ => {}
    }
    // The last character (a multibyte one is no unit: split where it starts).
    let (at, _) = value.char_indices().last()?;
    let (digits, unit) = value.split_at(at);
    let shift = match unit.to_ascii_uppercase().as_str() {
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return None,
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(1u64 << shift).filter(|&bytes| bytes > 0)
}

impl Settings {
    /// Reads the process environment.
    pub fn from_env() -> (Settings, Vec<SettingError>) {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Parses every variable through `lookup`; malformed ones keep their default.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> (Settings, Vec<SettingError>) {
        let mut s = Settings::default();
        let mut errors = Vec::new();
        let mut fail = |variable: &'static str, value: &str, expected: &str| {
            errors.push(SettingError {
                variable,
                value: value.to_string(),
                expected: expected.to_string(),
            })
        };
        // One step a concern, each in the variables' order, which the error lines keep.
        Self::read_log_and_strictness(&mut s, &lookup, &mut fail);
        Self::read_worker_mask(&mut s, &lookup, &mut fail);
        Self::read_worker_libs(&mut s, &lookup, &mut fail);
        Self::read_report(&mut s, &lookup, &mut fail);
        Self::read_dedicated_worker_and_step(&mut s, &lookup, &mut fail);
        (s, errors)
    }

    /// `TLLM_AFFINITY_LOG` and `TLLM_AFFINITY_STRICT`: what the library says, and whether a
    /// malformed setting stops it.
    fn read_log_and_strictness(
        s: &mut Self,
        lookup: &impl Fn(&str) -> Option<String>,
        mut fail: impl FnMut(&'static str, &str, &str),
    ) {
        if let Some(v) = lookup("TLLM_AFFINITY_LOG") {
            match v.trim().to_ascii_lowercase().as_str() {
                "off" => s.log = LogLevel::Off,
                "error" => s.log = LogLevel::Error,
                "warn" | "" => s.log = LogLevel::Warn,
                "info" => s.log = LogLevel::Info,
                "debug" => s.log = LogLevel::Debug,
                _ => fail(
                    "TLLM_AFFINITY_LOG",
                    &v,
                    "one of off, error, warn, info, debug",
                ),
            }
        }
        if let Some(v) = lookup("TLLM_AFFINITY_STRICT") {
            match v.trim() {
                "1" => s.strict = true,
                "0" | "" => s.strict = false,
                _ => fail("TLLM_AFFINITY_STRICT", &v, "1 or 0"),
            }
        }
        // `1` never reaches here (the library is off before settings are read); checked so a
        // malformed value gives its line, and `run` refuses one.
        if let Some(v) = lookup(DISABLE) {
            if !matches!(v.trim_ascii(), "1" | "0" | "") {
                fail(DISABLE, &v, DISABLE_EXPECTED);
            }
        }
    }

    /// What the worker mask is made of: the policy, the inference server's own flag, an explicit
    /// CPU list and the tree the topology is read from.
    fn read_worker_mask(
        s: &mut Self,
        lookup: &impl Fn(&str) -> Option<String>,
        mut fail: impl FnMut(&'static str, &str, &str),
    ) {
        if let Some(v) = lookup("TLLM_AFFINITY_POLICY") {
            match v.trim().to_ascii_lowercase().as_str() {
                "auto" => s.policy = Some(PolicyChoice::Auto),
                "numa" => s.policy = Some(PolicyChoice::Numa),
                "clear" => s.policy = Some(PolicyChoice::Clear),
                "keep" => s.policy = Some(PolicyChoice::Keep),
                _ => fail("TLLM_AFFINITY_POLICY", &v, "one of auto, numa, clear, keep"),
            }
        }
        // Every value is legal here, as in the inference server: anything but "1" means "leave
        // the masks alone".
        if let Some(v) = lookup("TLLM_NUMA_AWARE_WORKER_AFFINITY") {
            s.numa_aware = if v == "1" {
                NumaAwareFlag::One
            } else {
                NumaAwareFlag::Other(v)
            };
        }
        if let Some(v) = lookup("TLLM_AFFINITY_CPUS") {
            match CpuMask::parse_list(&v) {
                Ok(m) if !m.is_empty() => s.cpus_override = Some(m),
                Ok(_) => fail(
                    "TLLM_AFFINITY_CPUS",
                    &v,
                    "a non-empty cpulist such as 0-3,8",
                ),
                Err(e) => fail(
                    "TLLM_AFFINITY_CPUS",
                    &v,
                    &format!("a cpulist such as 0-3,8 ({})", e.reason),
                ),
            }
        }
        if let Some(v) = lookup("TLLM_AFFINITY_SLICE") {
            match v.trim().to_ascii_lowercase().as_str() {
                "off" | "" => s.slice = SliceMode::Off,
                "gpu" => s.slice = SliceMode::Gpu,
                _ => fail("TLLM_AFFINITY_SLICE", &v, "off or gpu"),
            }
        }
        if let Some(v) = lookup("TLLM_AFFINITY_SYSFS_ROOT") {
            let path = PathBuf::from(&v);
            if v.is_empty() || !path.join("sys").is_dir() {
                fail(
                    "TLLM_AFFINITY_SYSFS_ROOT",
                    &v,
                    "an existing directory holding sys/",
                );
            } else {
                s.sysfs_root = path;
            }
        }
    }

    /// `TLLM_AFFINITY_WORKER_LIBS`: the libraries whose threads are workers.
    fn read_worker_libs(
        s: &mut Self,
        lookup: &impl Fn(&str) -> Option<String>,
        mut fail: impl FnMut(&'static str, &str, &str),
    ) {
        if let Some(v) = lookup("TLLM_AFFINITY_WORKER_LIBS") {
            // A leading `+` adds to the default list; a plain list replaces it.
            let parsed = match v.trim_start().strip_prefix('+') {
                Some(extra) => parse_worker_libs(&format!("{DEFAULT_WORKER_LIBS},{extra}")),
                None => parse_worker_libs(&v),
            };
            match parsed {
                Ok(p) => s.worker_libs = p,
                Err(bad) => fail(
                    "TLLM_AFFINITY_WORKER_LIBS",
                    &v,
                    &format!(
                        "comma-separated soname globs such as libnccl*.so* ('{bad}' is not a glob)"
                    ),
                ),
            }
        }
    }

    /// `TLLM_AFFINITY_REPORT`: where the report goes at exit.
    fn read_report(
        s: &mut Self,
        lookup: &impl Fn(&str) -> Option<String>,
        mut fail: impl FnMut(&'static str, &str, &str),
    ) {
        if let Some(v) = lookup("TLLM_AFFINITY_REPORT") {
            let path = PathBuf::from(&v);
            // Checked now rather than at exit, where nothing can be done about it any more.
            let dir_exists = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.is_dir(),
                _ => true,
            };
            if v.is_empty() || path.is_dir() || !dir_exists {
                fail(
                    "TLLM_AFFINITY_REPORT",
                    &v,
                    "a file path in an existing directory",
                );
            } else {
                s.report_path = Some(path);
            }
        }
    }

    /// The process as a whole: a dedicated worker, the GPU it and `configure(-1)` mean, its memory
    /// moved, and the step thread's core and lock directory.
    fn read_dedicated_worker_and_step(
        s: &mut Self,
        lookup: &impl Fn(&str) -> Option<String>,
        mut fail: impl FnMut(&'static str, &str, &str),
    ) {
        if let Some(v) = lookup("TLLM_AFFINITY_PROCESS_ROLE") {
            match v.trim().to_ascii_lowercase().as_str() {
                "host" | "" => s.process_role = ProcessRole::Host,
                "worker" => s.process_role = ProcessRole::Worker,
                _ => fail("TLLM_AFFINITY_PROCESS_ROLE", &v, "host or worker"),
            }
        }
        if let Some(v) = lookup("TLLM_AFFINITY_STEP_CORE") {
            match v.trim().to_ascii_lowercase().as_str() {
                "off" | "" => s.step_core = StepCore::Off,
                "auto" => s.step_core = StepCore::Auto,
                t => match t.parse::<usize>() {
                    Ok(cpu) if cpu <= crate::mask::MAX_CPU => s.step_core = StepCore::Cpu(cpu),
                    _ => fail("TLLM_AFFINITY_STEP_CORE", &v, "off, auto, or a CPU number"),
                },
            }
        }
        // Validated here so a typo shows at load (SPEC §9); configure re-reads the variable,
        // which the program may set after load (SPEC §4).
        if let Some(v) = lookup("TLLM_AFFINITY_GPU") {
            if let Err(expected) = parse_gpu(&v) {
                fail("TLLM_AFFINITY_GPU", &v, expected);
            }
        }
        if let Some(v) = lookup("TLLM_AFFINITY_LOCK_DIR") {
            let path = PathBuf::from(&v);
            if v.is_empty() || !path.is_dir() {
                fail("TLLM_AFFINITY_LOCK_DIR", &v, "an existing directory");
            } else {
                s.lock_dir = path;
            }
        }
        if let Some(v) = lookup("TLLM_AFFINITY_MOVE_MEMORY") {
            match parse_move_memory(&v) {
                Some(cap) => s.move_memory = cap,
                None => fail(
                    "TLLM_AFFINITY_MOVE_MEMORY",
                    &v,
                    "0, 1 or a size such as 64G or 512M (K, M, G, T: powers of 1024)",
                ),
            }
        }
    }

    /// True when `soname` (a file name, no directory) matches `TLLM_AFFINITY_WORKER_LIBS`.
    pub fn is_worker_lib(&self, soname: &str) -> bool {
        self.worker_libs.iter().any(|p| p.matches(soname))
    }
}

/// Splits a comma-separated glob list; returns the first bad glob on error.
fn parse_worker_libs(text: &str) -> Result<Vec<glob::Pattern>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| glob::Pattern::new(p).map_err(|_| p.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> (Settings, Vec<SettingError>) {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let (s, errors) = parse(&[]);
        assert!(errors.is_empty());
        assert_eq!(s.log, LogLevel::Warn);
        assert_eq!(s.step_core, StepCore::Off);
        assert_eq!(s.numa_aware, NumaAwareFlag::Unset);
        assert_eq!(s.move_memory, DEFAULT_MOVE_MEMORY_CAP);
        assert!(s.is_worker_lib("libnccl.so.2"));
        assert!(s.is_worker_lib("libopen-pal.so.40"));
        assert!(!s.is_worker_lib("libpython3.11.so.1.0"));
    }

    #[test]
    fn numa_flag_keeps_the_servers_three_meanings() {
        assert_eq!(
            parse(&[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "1")])
                .0
                .numa_aware,
            NumaAwareFlag::One
        );
        assert_eq!(
            parse(&[("TLLM_NUMA_AWARE_WORKER_AFFINITY", "0")])
                .0
                .numa_aware,
            NumaAwareFlag::Other("0".into())
        );
    }

    #[test]
    fn every_malformed_variable_gives_one_line_naming_it() {
        let cases = [
            ("TLLM_AFFINITY_LOG", "loud"),
            ("TLLM_AFFINITY_STRICT", "yes"),
            ("TLLM_AFFINITY_POLICY", "fast"),
            ("TLLM_AFFINITY_CPUS", "0-"),
            ("TLLM_AFFINITY_CPUS", ""),
            ("TLLM_AFFINITY_SYSFS_ROOT", "/nonexistent/root"),
            ("TLLM_AFFINITY_WORKER_LIBS", "libnccl[.so"),
            ("TLLM_AFFINITY_REPORT", ""),
            ("TLLM_AFFINITY_PROCESS_ROLE", "boss"),
            ("TLLM_AFFINITY_STEP_CORE", "-3"),
            ("TLLM_AFFINITY_LOCK_DIR", "/nonexistent/dir"),
            ("TLLM_AFFINITY_GPU", "zz:qq:00.0"),
            ("TLLM_AFFINITY_GPU", "-1"),
            ("TLLM_AFFINITY_MOVE_MEMORY", "no"),
            ("TLLM_AFFINITY_MOVE_MEMORY", "64"),
            ("TLLM_AFFINITY_MOVE_MEMORY", "64GB"),
            ("TLLM_AFFINITY_MOVE_MEMORY", "-1G"),
            ("TLLM_AFFINITY_MOVE_MEMORY", "0G"),
            ("TLLM_AFFINITY_MOVE_MEMORY", "99999999999T"),
            ("TLLM_AFFINITY_MOVE_MEMORY", "64é"),
            ("TLLM_AFFINITY_DISABLE", "yes"),
            ("TLLM_AFFINITY_DISABLE", "true"),
            ("TLLM_AFFINITY_DISABLE", "2"),
            ("TLLM_AFFINITY_SLICE", "node"),
            ("TLLM_AFFINITY_SLICE", "1"),
        ];
        for (var, value) in cases {
            let (_, errors) = parse(&[(var, value)]);
            assert_eq!(errors.len(), 1, "{var}={value}");
            let line = errors[0].to_string();
            assert!(line.starts_with(&format!("{var}='{value}'")), "{line}");
            assert!(line.contains("expected"), "{line}");
            assert!(!line.contains('\n'));
        }
    }

    #[test]
    fn empty_worker_libs_disables_classification() {
        let (s, errors) = parse(&[("TLLM_AFFINITY_WORKER_LIBS", "")]);
        assert!(errors.is_empty());
        assert!(!s.is_worker_lib("libnccl.so.2"));
    }

    #[test]
    fn a_leading_plus_adds_to_the_default_worker_libs() {
        let (s, errors) = parse(&[("TLLM_AFFINITY_WORKER_LIBS", "+libfoo*.so*")]);
        assert!(errors.is_empty());
        assert!(s.is_worker_lib("libfoo.so.1"));
        assert!(s.is_worker_lib("libnccl.so.2"), "the default list stays");
        let (s, _) = parse(&[("TLLM_AFFINITY_WORKER_LIBS", "libfoo*.so*")]);
        assert!(s.is_worker_lib("libfoo.so.1"));
        assert!(!s.is_worker_lib("libnccl.so.2"), "a plain list replaces");
    }

    #[test]
    fn only_log_strict_report_and_the_off_switch_are_cosmetic() {
        let (_, errors) = parse(&[
            ("TLLM_AFFINITY_LOG", "verbose"),
            ("TLLM_AFFINITY_STRICT", "yes"),
            ("TLLM_AFFINITY_DISABLE", "yes"),
            ("TLLM_AFFINITY_REPORT", ""),
            ("TLLM_AFFINITY_POLICY", "fast"),
        ]);
        let cosmetic: Vec<_> = errors.iter().map(SettingError::is_cosmetic).collect();
        assert_eq!(cosmetic, [true, true, true, false, true], "{errors:?}");
        assert!(errors[2].fallback().contains("not disabled"));
    }

    #[test]
    fn only_1_disables() {
        for (value, off) in [("1", true), (" 1 ", true), ("0", false), ("", false)] {
            assert_eq!(disabled_by(Some(OsStr::new(value))), off, "{value:?}");
            assert!(parse(&[(DISABLE, value)]).1.is_empty(), "{value:?}");
        }
        assert!(!disabled_by(None));
        assert!(
            !disabled_by(Some(OsStr::new("yes"))),
            "malformed: not disabled"
        );
    }

    #[test]
    fn gpu_forms() {
        assert_eq!(parse_gpu("2"), Ok(Some(GpuChoice::Index(2))));
        for text in ["0000:3b:00.0", "3B:00.0", " 3b:00.0 "] {
            assert_eq!(
                parse_gpu(text),
                Ok(Some(GpuChoice::Address("0000:3b:00.0".into()))),
                "{text}"
            );
        }
        assert_eq!(parse_gpu(" "), Ok(None));
        for text in ["zz:qq:00.0", "zz:zz", "first", "+1", "3b:00", "1.5"] {
            assert_eq!(parse_gpu(text), Err(GPU_EXPECTED), "{text}");
        }
        let (_, errors) = parse(&[("TLLM_AFFINITY_GPU", "0000:3b:00.0")]);
        assert!(errors.is_empty(), "{errors:?}");
    }

    #[test]
    fn move_memory_is_0_1_or_a_size() {
        let cap = |v: &str| parse(&[("TLLM_AFFINITY_MOVE_MEMORY", v)]).0.move_memory;
        assert_eq!(cap("0"), 0);
        assert_eq!(cap("1"), DEFAULT_MOVE_MEMORY_CAP);
        assert_eq!(cap(""), DEFAULT_MOVE_MEMORY_CAP);
        assert_eq!(cap("64G"), 64 << 30);
        assert_eq!(cap("512m"), 512 << 20);
        assert_eq!(cap(" 2T "), 2 << 40);
        assert_eq!(cap("4096K"), 4 << 20);
    }

    #[test]
    fn step_core_forms() {
        assert_eq!(
            parse(&[("TLLM_AFFINITY_STEP_CORE", "auto")]).0.step_core,
            StepCore::Auto
        );
        assert_eq!(
            parse(&[("TLLM_AFFINITY_STEP_CORE", "7")]).0.step_core,
            StepCore::Cpu(7)
        );
    }

    #[test]
    fn slice_forms() {
        let slice = |v: &str| parse(&[("TLLM_AFFINITY_SLICE", v)]).0.slice;
        assert_eq!(parse(&[]).0.slice, SliceMode::Off);
        assert_eq!(slice("gpu"), SliceMode::Gpu);
        assert_eq!(slice(" GPU "), SliceMode::Gpu);
        assert_eq!(slice("off"), SliceMode::Off);
        assert_eq!(slice(""), SliceMode::Off);
        let (s, errors) = parse(&[("TLLM_AFFINITY_SLICE", "node")]);
        assert_eq!(s.slice, SliceMode::Off);
        assert_eq!(
            errors[0].to_string(),
            "TLLM_AFFINITY_SLICE='node' is not valid: expected off or gpu"
        );
    }
}
