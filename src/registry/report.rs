//! The JSON report (`tllm_affinity_report`, `TLLM_AFFINITY_REPORT`). Schema version 1:
//!
//! ```json
//! { "schema": 1, "library": "0.1.0", "pid": 1234, "state": "active",
//!   "mask_at_load": "0-1", "cpuset": "0-1", "constrained": false,
//!   "worker_mask": "1", "worker_device": "0000:3b:00.0",
//!   "leases": [{"id": 1, "device": "0000:3b:00.0", "gpu": 0}],
//!   "threads": [{"tid": 1234, "role": "host", "placement": "inherited",
//!                "mask": "0-1", "natural": "0-1", "kernel_mask": "0-1"}],
//!   "adapters": {"trtllm": "engaged"},
//!   "peak_workers": 7, "leases_opened": 1, "leases_released": 1,
//!   "threads_restored": 7, "threads_preserved": 0, "threads_created": 9,
//!   "launch": "1200-88172",
//!   "memory_moved": {"node": 1, "moves": 1, "bytes_moved": 67108864,
//!                    "bytes_not_moved": 0, "millis": 41.5} }
//! ```
//! `mask` is what the library believes the thread holds, `kernel_mask` what the kernel said when
//! the report was made (absent if the thread was gone), `natural` what restoration puts back.
//! The history fields count over the process's life, so a report written at exit, after the last
//! release restored everything, still says what happened. `launch` names the launch the process
//! belongs to (its first process's pid and start time, see [`crate::handoff::launch`]). `memory_moved`
//! (absent until a move ran) says what moving a dedicated worker's memory did.

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::mask::CpuMask;
use crate::placement::load_facts::LoadFacts;
use crate::registry::{History, LeaseInfo, Registry, Role, ThreadView, Tid};

#[derive(Debug, Serialize)]
pub struct ThreadReport {
    #[serde(flatten)]
    pub view: ThreadView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_mask: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub schema: u32,
    pub library: &'static str,
    pub pid: u32,
    pub state: &'static str,
    pub mask_at_load: Option<String>,
    pub cpuset: Option<String>,
    pub constrained: Option<bool>,
    pub worker_mask: Option<String>,
    pub worker_device: Option<String>,
    pub leases: Vec<LeaseInfo>,
    pub hosts: usize,
    pub workers: usize,
    pub threads: Vec<ThreadReport>,
    /// What language adapters said of themselves, by adapter: `{"trtllm": "engaged"}`.
    pub adapters: std::collections::BTreeMap<String, String>,
    /// Each adapter's line of what engaged, where it gave one: `{"trtllm": "tensorrt_llm 1.2.0;
    /// base_worker found 1/1"}`.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub adapter_details: std::collections::BTreeMap<String, String>,
    #[serde(flatten)]
    pub history: History,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launch: Option<String>,
    /// What moving a dedicated worker's memory to its node did; absent when nothing moved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_moved: Option<MemoryMoved>,
}

/// A dedicated worker's memory moved to its node (summed over the moves of the process's life).
#[derive(Debug, Clone, Serialize)]
pub struct MemoryMoved {
    /// The node the last move went to.
    pub node: usize,
    pub moves: u64,
    pub bytes_moved: u64,
    /// Pages on the other nodes with CPUs that stayed: locked (`mlock`), shared with another
    /// process, busy.
    pub bytes_not_moved: u64,
    /// Transparent huge pages moved whole.
    pub huge_pages_moved: u64,
    pub millis: f64,
}

impl Report {
    pub fn build(
        state: &'static str,
        facts: Option<&LoadFacts>,
        registry: &Registry,
        kernel_mask: impl Fn(Tid) -> Option<CpuMask>,
    ) -> Report {
        let threads: Vec<ThreadReport> = registry
            .snapshot()
            .into_iter()
            .map(|view| ThreadReport {
                kernel_mask: kernel_mask(view.tid).map(|m| m.to_list()),
                view,
            })
            .collect();
        let count = |role| threads.iter().filter(|t| t.view.role == role).count();
        Report {
            schema: 1,
            library: env!("CARGO_PKG_VERSION"),
            pid: std::process::id(),
            state,
            mask_at_load: facts.map(|f| f.mask_at_load.to_list()),
            cpuset: facts.map(|f| f.cpuset.to_list()),
            constrained: facts.map(|f| f.constrained),
            worker_mask: registry.target().map(|t| t.mask.to_list()),
            worker_device: registry.target().map(|t| t.device.clone()),
            leases: registry.leases().to_vec(),
            hosts: count(Role::Host),
            workers: count(Role::Worker),
            threads,
            adapters: Default::default(),
            adapter_details: Default::default(),
            history: registry.history(),
            launch: None,
            memory_moved: None,
        }
    }
}

/// Whether a process did anything with the library: opened a lease or saw a thread born. A
/// wrapper (`bash -c`, `timeout`, `env`) does neither.
pub fn used_the_library(history: &History) -> bool {
    history.leases_opened > 0 || history.threads_created > 0
}

/// The largest report read back at exit; a bigger file is not one of ours to keep.
const MOST_REPORT_BYTES: u64 = 64 << 20;

/// Whether `path` holds the report of a process of `launch` that used the library: a wrapper
/// of the same launch exiting after it must not overwrite it (SPEC §12).
pub fn a_user_of_the_launch_wrote(path: &Path, launch: Option<&str>) -> bool {
    use std::io::Read;
    let Some(launch) = launch else {
        return false;
    };
    let mut text = String::new();
    let read =
        std::fs::File::open(path).and_then(|f| f.take(MOST_REPORT_BYTES).read_to_string(&mut text));
    let Ok(json) = read
        .map_err(drop)
        .and_then(|_| serde_json::from_str::<serde_json::Value>(&text).map_err(drop))
    else {
        return false;
    };
    let count = |field: &str| json[field].as_u64().unwrap_or(0);
    json["launch"].as_str() == Some(launch)
        && (count("leases_opened") > 0 || count("threads_created") > 0)
}

/// Writes the report without following a symlink at `path`, mode 0644 whatever the umask. What
/// is planted at the path cannot redirect or stop the write: a FIFO does not block the open
/// (`O_NONBLOCK`), and anything but a regular file with a single link (a FIFO, a device, a hard
/// link to another file) is refused before a byte of it changes.
pub fn write_file(path: &Path, json: &str) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .mode(0o644)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENXIO) => std::io::Error::other("a FIFO; nothing written"),
            _ => e,
        })?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file; nothing written"));
    }
    if meta.nlink() != 1 {
        return Err(std::io::Error::other(
            "a file with other hard links; nothing written",
        ));
    }
    file.set_len(0)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    file.write_all(json.as_bytes())?;
    file.write_all(b"\n")
}
