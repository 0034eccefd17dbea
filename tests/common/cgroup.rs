//! A cpuset cgroup of the test's own, removed when dropped.

use super::*;

/// True when the kernel lets this process make cpuset cgroups (v1 here, v2 elsewhere).
pub fn cpuset_cgroup_root() -> Option<PathBuf> {
    let v1 = Path::new("/sys/fs/cgroup/cpuset");
    if v1.join("cpuset.cpus").exists() {
        return Some(v1.to_path_buf());
    }
    None
}

/// A cpuset cgroup allowing `cpus`, removed on drop.
pub struct CpusetCgroup {
    pub path: PathBuf,
}

impl CpusetCgroup {
    /// The error (for [`require!`]) says why there is none.
    pub fn create(cpus: &str) -> Result<CpusetCgroup, String> {
        Self::make(cpus).map_err(|why| format!("a cpuset cgroup ({why})"))
    }

    fn make(cpus: &str) -> Result<CpusetCgroup, String> {
        let root = cpuset_cgroup_root().ok_or("no cgroup v1 cpuset hierarchy mounted")?;
        let path = root.join(format!(
            "tllm-affinity-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir(&path).map_err(|e| format!("mkdir {}: {e}", path.display()))?;
        let group = CpusetCgroup { path };
        let mems = std::fs::read_to_string(root.join("cpuset.mems")).unwrap_or("0".into());
        std::fs::write(group.path.join("cpuset.cpus"), cpus)
            .map_err(|e| format!("cpuset.cpus: {e}"))?;
        std::fs::write(group.path.join("cpuset.mems"), mems.trim())
            .map_err(|e| format!("cpuset.mems: {e}"))?;
        Ok(group)
    }

    /// `cmd` run inside the cgroup: a shell joins it, then execs the program.
    pub fn wrap(&self, program: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(r#"echo $$ > "$0/tasks" && shift && exec "$@""#)
            .arg(&self.path)
            .arg("--")
            .arg(program)
            .args(args);
        cmd
    }
}

impl Drop for CpusetCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0)
}
