//! The cgroup limits of the process: the cpuset it may run on and its CPU bandwidth quota, from
//! cgroup v1, v2 or a hybrid of both.
//!
//! [`parse_limits`] is pure over the texts of `/proc/self/cgroup` and `/proc/self/mountinfo` plus
//! reads under a root directory, so tests feed it texts and temp trees. Nothing here fails: a
//! limit that cannot be found or parsed is reported as absent, and the policy then treats the
//! process as unconfined by its cgroup.

#![forbid(unsafe_code)]

use crate::mask::CpuMask;
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq)]
pub struct CgroupLimits {
    /// The CPUs the cpuset allows; `None` when no cpuset is found.
    pub cpuset: Option<CpuMask>,
    /// The tightest CFS bandwidth limit from the process's cgroup up to the hierarchy root.
    pub quota: Option<CpuQuota>,
    pub version: CgroupVersion,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuQuota {
    pub quota_us: u64,
    pub period_us: u64,
}

impl CpuQuota {
    /// The number of CPUs' worth of time the quota grants per period (`2.0` for 200000/100000).
    pub fn cpus(&self) -> f64 {
        self.quota_us as f64 / self.period_us as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
    /// v1 controller hierarchies and a v2 (unified) hierarchy are both mounted.
    Hybrid,
    None,
}

/// One line of `/proc/self/mountinfo` that mounts a cgroup hierarchy.
#[derive(Debug)]
struct Mount {
    /// Field 4: the cgroup the mount shows as its root (`/docker/<id>` in many containers).
    root: String,
    mount_point: String,
    v2: bool,
    super_options: Vec<String>,
}

/// One line of `/proc/self/cgroup`.
#[derive(Debug)]
struct Membership {
    hierarchy: String,
    controllers: Vec<String>,
    path: String,
}

/// Reads the limits of the calling process from `/proc/self` and the real filesystem.
pub fn read_limits() -> CgroupLimits {
    let cgroup = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    parse_limits(&cgroup, &mountinfo, Path::new("/"))
}

impl CgroupLimits {
    /// The CPUs a process here may be given: the cpuset within `online`, or `online` itself where
    /// no cpuset is readable or it names no online CPU. The library judges "constrained" and
    /// clears masks against this, and `plan` shows the same set.
    pub fn cpuset_within(&self, online: &CpuMask) -> CpuMask {
        self.cpuset
            .as_ref()
            .map(|c| c.intersection(online))
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| online.clone())
    }
}

/// Finds the process's cpuset and CPU quota. Mount points in `proc_self_mountinfo` are taken
/// relative to `fs_root`. A controller mounted as v1 is read there; otherwise the v2 hierarchy is
/// read (a controller lives in one hierarchy only, so in hybrid mode v1 wins where it is mounted).
pub fn parse_limits(
    proc_self_cgroup: &str,
    proc_self_mountinfo: &str,
    fs_root: &Path,
) -> CgroupLimits {
    let mounts: Vec<Mount> = proc_self_mountinfo
        .lines()
        .filter_map(parse_mount)
        .collect();
    let members: Vec<Membership> = proc_self_cgroup
        .lines()
        .filter_map(parse_membership)
        .collect();

    let v1_mounted = mounts.iter().any(|m| !m.v2)
        && members
            .iter()
            .any(|m| m.hierarchy != "0" || !m.controllers.is_empty());
    let v2_dirs = v2_dirs(&mounts, &members, fs_root);
    let version = match (v1_mounted, v2_dirs.is_some()) {
        (true, true) => CgroupVersion::Hybrid,
        (true, false) => CgroupVersion::V1,
        (false, true) => CgroupVersion::V2,
        (false, false) => CgroupVersion::None,
    };

    let v2 = v2_dirs.as_deref().unwrap_or(&[]);
    let cpuset = match v1_dirs("cpuset", &mounts, &members, fs_root) {
        Some((dirs, mount)) => {
            // Hierarchies mounted with `noprefix` (old Android, some appliances) drop "cpuset.".
            let prefix = if mount.super_options.iter().any(|o| o == "noprefix") {
                ""
            } else {
                "cpuset."
            };
            let files = [format!("{prefix}effective_cpus"), format!("{prefix}cpus")];
            first_cpuset(&dirs, &files)
        }
        None => None,
    }
    .or_else(|| first_cpuset(v2, &["cpuset.cpus.effective".to_string()]));

    let quota = match v1_dirs("cpu", &mounts, &members, fs_root) {
        Some((dirs, _)) => tightest(dirs.iter().filter_map(|d| v1_quota(d))),
        None => None,
    }
    .or_else(|| tightest(v2.iter().filter_map(|d| v2_quota(d))));

    CgroupLimits {
        cpuset,
        quota,
        version,
    }
}

/// Parses `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS`,
/// keeping cgroup mounts only.
fn parse_mount(line: &str) -> Option<Mount> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let dash = fields.iter().skip(6).position(|f| *f == "-")? + 6;
    let fstype = *fields.get(dash + 1)?;
    let v2 = match fstype {
        "cgroup2" => true,
        "cgroup" => false,
        _ => return None,
    };
    Some(Mount {
        root: unescape(fields.get(3)?),
        mount_point: unescape(fields.get(4)?),
        v2,
        super_options: fields
            .get(dash + 3)
            .map(|o| o.split(',').map(str::to_string).collect())
            .unwrap_or_default(),
    })
}

/// Undoes the kernel's octal escaping of space, tab, newline and backslash in mountinfo paths.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match octal {
            Some(d) => {
                let value = d.iter().fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `HIERARCHY:CONTROLLERS:PATH` (the path itself may contain colons).
fn parse_membership(line: &str) -> Option<Membership> {
    let mut parts = line.splitn(3, ':');
    let hierarchy = parts.next()?.trim().to_string();
    let controllers = parts
        .next()?
        .split(',')
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect();
    let path = parts.next()?.trim_end().to_string();
    Some(Membership {
        hierarchy,
        controllers,
        path,
    })
}

/// The directories of the process's v1 cgroup for `controller`, leaf first, up to the mount root.
fn v1_dirs<'m>(
    controller: &str,
    mounts: &'m [Mount],
    members: &[Membership],
    fs_root: &Path,
) -> Option<(Vec<PathBuf>, &'m Mount)> {
    let member = members
        .iter()
        .find(|m| m.controllers.iter().any(|c| c == controller))?;
    let candidates = mounts
        .iter()
        .filter(|m| !m.v2 && m.super_options.iter().any(|o| o == controller));
    let mount = pick_mount(candidates, &member.path)?;
    Some((dirs_up(fs_root, mount, &member.path), mount))
}

/// The directories of the process's v2 cgroup, leaf first, up to the mount root.
fn v2_dirs(mounts: &[Mount], members: &[Membership], fs_root: &Path) -> Option<Vec<PathBuf>> {
    let member = members
        .iter()
        .find(|m| m.hierarchy == "0" && m.controllers.is_empty())?;
    let mount = pick_mount(mounts.iter().filter(|m| m.v2), &member.path)?;
    Some(dirs_up(fs_root, mount, &member.path))
}

/// Of several mounts of one hierarchy, the one whose root contains the process's cgroup.
fn pick_mount<'m>(
    mut candidates: impl Iterator<Item = &'m Mount> + Clone,
    path: &str,
) -> Option<&'m Mount> {
    candidates
        .clone()
        .find(|m| strip_mount_root(path, &m.root).is_some())
        .or_else(|| candidates.next())
}

/// `path` relative to a mount showing cgroup `root`, or `None` when `path` lies outside it.
fn strip_mount_root<'p>(path: &'p str, root: &str) -> Option<&'p str> {
    let root = root.trim_end_matches('/');
    if root.is_empty() {
        return Some(path);
    }
    let rest = path.strip_prefix(root)?;
    (rest.is_empty() || rest.starts_with('/')).then_some(rest)
}

/// The directory of cgroup `path` under `mount` and each parent up to the mount point, leaf first.
fn dirs_up(fs_root: &Path, mount: &Mount, path: &str) -> Vec<PathBuf> {
    let mount_dir = fs_root.join(mount.mount_point.trim_start_matches('/'));
    // A path outside the mount's root (a cgroup namespace shows `/..` paths for cgroups above
    // it) cannot be mapped; the mount root is then the closest view the process has.
    let rel = strip_mount_root(path, &mount.root).unwrap_or("");
    let components: Vec<&str> = rel
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if components.contains(&"..") {
        return vec![mount_dir];
    }
    (0..=components.len())
        .rev()
        .map(|depth| {
            let mut dir = mount_dir.clone();
            dir.extend(&components[..depth]);
            dir
        })
        .collect()
}

/// The first non-empty cpulist found walking up, trying `files` in order in each directory.
fn first_cpuset(dirs: &[PathBuf], files: &[String]) -> Option<CpuMask> {
    dirs.iter()
        .flat_map(|dir| files.iter().map(move |f| dir.join(f)))
        .filter_map(|path| fs::read_to_string(path).ok())
        .filter_map(|text| CpuMask::parse_list(&text).ok())
        .find(|mask| !mask.is_empty())
}

fn tightest(quotas: impl Iterator<Item = CpuQuota>) -> Option<CpuQuota> {
    quotas.min_by(|a, b| a.cpus().total_cmp(&b.cpus()))
}

/// `cpu.max`: `max 100000` (no limit) or `200000 100000`.
fn v2_quota(dir: &Path) -> Option<CpuQuota> {
    let text = fs::read_to_string(dir.join("cpu.max")).ok()?;
    let mut fields = text.split_whitespace();
    let quota = fields.next()?;
    let period = fields.next().map_or(Some(100_000), |p| p.parse().ok())?;
    quota_of(quota.parse().ok()?, period)
}

/// `cpu.cfs_quota_us` (`-1` = no limit) over `cpu.cfs_period_us`.
fn v1_quota(dir: &Path) -> Option<CpuQuota> {
    let read = |name: &str| -> Option<i64> {
        fs::read_to_string(dir.join(name)).ok()?.trim().parse().ok()
    };
    let quota = u64::try_from(read("cpu.cfs_quota_us")?).ok()?;
    let period = u64::try_from(read("cpu.cfs_period_us")?).ok()?;
    quota_of(quota, period)
}

fn quota_of(quota_us: u64, period_us: u64) -> Option<CpuQuota> {
    (quota_us > 0 && period_us > 0).then_some(CpuQuota {
        quota_us,
        period_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::host::simulated::{tree_of, write_tree_file as put};
    use crate::mask::mask;

    const V1_CONTAINER_MOUNTINFO: &str = "\
1185 1084 0:251 / / rw,relatime master:403 - overlay overlay rw,lowerdir=/a,upperdir=/b
1195 1194 0:26 /docker/abc /sys/fs/cgroup/cpuset ro,nosuid,nodev,noexec,relatime master:12 - cgroup cgroup rw,cpuset
1196 1194 0:27 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid,nodev,noexec,relatime master:13 - cgroup cgroup rw,cpu,cpuacct
1197 1194 0:28 /docker/abc /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:14 - cgroup cgroup rw,memory
";

    #[test]
    fn the_cpuset_is_taken_within_the_online_cpus_else_they_serve() {
        let limits = |cpuset: Option<&str>| CgroupLimits {
            cpuset: cpuset.map(mask),
            ..parse_limits("", "", Path::new("/"))
        };
        let online = mask("0-7");
        assert_eq!(limits(Some("4-11")).cpuset_within(&online), mask("4-7"));
        assert_eq!(limits(None).cpuset_within(&online), online);
        assert_eq!(limits(Some("8-11")).cpuset_within(&online), online);
    }

    #[test]
    fn v1_container_with_mount_root_prefix() {
        let root = tree_of(&[
            ("sys/fs/cgroup/cpuset/cpuset.effective_cpus", "2-5\n"),
            ("sys/fs/cgroup/cpuset/cpuset.cpus", "0-63\n"),
            ("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "200000\n"),
            ("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n"),
        ]);
        let cgroup = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n";
        let limits = parse_limits(cgroup, V1_CONTAINER_MOUNTINFO, root.path());
        assert_eq!(limits.version, CgroupVersion::V1);
        assert_eq!(limits.cpuset, Some(mask("2-5")));
        let quota = limits.quota.unwrap();
        assert_eq!((quota.quota_us, quota.period_us), (200_000, 100_000));
        assert_eq!(quota.cpus(), 2.0);
    }

    #[test]
    fn v1_child_cgroup_walks_up_and_falls_back_to_cpuset_cpus() {
        let root = tree_of(&[
            // The leaf exists but says nothing; its parent only has the older file name.
            ("sys/fs/cgroup/cpuset/job/step/tasks", "1\n"),
            ("sys/fs/cgroup/cpuset/job/step/cpuset.effective_cpus", "\n"),
            ("sys/fs/cgroup/cpuset/job/cpuset.cpus", "4-7\n"),
            ("sys/fs/cgroup/cpuset/cpuset.effective_cpus", "0-15\n"),
            ("sys/fs/cgroup/cpu/job/cpu.cfs_quota_us", "-1\n"),
            ("sys/fs/cgroup/cpu/job/cpu.cfs_period_us", "100000\n"),
            ("sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n"),
            ("sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n"),
        ]);
        let mountinfo = "\
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
";
        let cgroup = "3:cpuset:/job/step\n1:cpu:/job/step\n";
        let limits = parse_limits(cgroup, mountinfo, root.path());
        assert_eq!(limits.cpuset, Some(mask("4-7")));
        assert_eq!(limits.quota, None);
    }

    #[test]
    fn v2_cpuset_and_tightest_quota() {
        let root = tree_of(&[
            ("sys/fs/cgroup/cpuset.cpus.effective", "0-31\n"),
            ("sys/fs/cgroup/a/cpu.max", "400000 100000\n"),
            ("sys/fs/cgroup/a/b/cpu.max", "150000 100000\n"),
            ("sys/fs/cgroup/a/b/c/cpu.max", "max 100000\n"),
            ("sys/fs/cgroup/a/b/c/cpuset.cpus.effective", "8-11\n"),
        ]);
        let mountinfo = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        let limits = parse_limits("0::/a/b/c\n", mountinfo, root.path());
        assert_eq!(limits.version, CgroupVersion::V2);
        assert_eq!(limits.cpuset, Some(mask("8-11")));
        let quota = limits.quota.unwrap();
        assert_eq!(quota.cpus(), 1.5);

        // An unlimited cgroup with an empty leaf cpuset reads the parent's.
        for (rel, text) in [
            ("a/b/c/cpuset.cpus.effective", ""),
            ("a/cpu.max", "max 100000\n"),
            ("a/b/cpu.max", "max 100000\n"),
        ] {
            put(root.path(), &format!("sys/fs/cgroup/{rel}"), text);
        }
        let limits = parse_limits("0::/a/b/c\n", mountinfo, root.path());
        assert_eq!((limits.cpuset, limits.quota), (Some(mask("0-31")), None));
    }

    #[test]
    fn v2_in_a_cgroup_namespace() {
        let root = tree_of(&[
            ("sys/fs/cgroup/cpuset.cpus.effective", "1-2\n"),
            ("sys/fs/cgroup/cpu.max", "50000 100000\n"),
        ]);
        let mountinfo = "700 690 0:30 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n";
        let limits = parse_limits("0::/\n", mountinfo, root.path());
        assert_eq!(limits.cpuset, Some(mask("1-2")));
        assert_eq!(limits.quota.unwrap().cpus(), 0.5);
        // A process moved above the namespace root: the mount root is the best view.
        let limits = parse_limits("0::/../other\n", mountinfo, root.path());
        assert_eq!(limits.cpuset, Some(mask("1-2")));
    }

    #[test]
    fn hybrid_reads_v1_controllers() {
        let root = tree_of(&[
            ("sys/fs/cgroup/cpuset/cpuset.effective_cpus", "0-1\n"),
            ("sys/fs/cgroup/cpuset/cpuset.cpus", "0-1\n"),
        ]);
        // This machine's layout: cpu and cpuacct as separate v1 hierarchies, cgroup2 unified.
        let mountinfo = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        let cgroup = "9:name=systemd:/\n3:cpuset:/\n2:cpuacct:/\n1:cpu:/\n0::/\n";
        let limits = parse_limits(cgroup, mountinfo, root.path());
        assert_eq!(limits.version, CgroupVersion::Hybrid);
        assert_eq!(limits.cpuset, Some(mask("0-1")));
        assert_eq!(limits.quota, None);
    }

    #[test]
    fn nothing_mounted() {
        let limits = parse_limits("", "", Path::new("/nonexistent"));
        assert_eq!(
            limits,
            CgroupLimits {
                cpuset: None,
                quota: None,
                version: CgroupVersion::None
            }
        );
        // Garbage lines are skipped, not fatal.
        let limits = parse_limits("garbage\n", "1 2 3\n- -\n", Path::new("/nonexistent"));
        assert_eq!(limits.version, CgroupVersion::None);
    }

    #[test]
    fn escaped_mount_points() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        put(root, "cg roups/cpuset/cpuset.effective_cpus", "3\n");
        let mountinfo = "34 31 0:31 / /cg\\040roups/cpuset rw - cgroup cgroup rw,cpuset\n";
        let limits = parse_limits("3:cpuset:/\n", mountinfo, root);
        assert_eq!(limits.cpuset, Some(mask("3")));
        assert_eq!(unescape("a\\134b\\011"), "a\\b\t");
        assert_eq!(unescape("trailing\\"), "trailing\\");
    }

    #[test]
    fn real_machine_limits_do_not_panic() {
        let limits = read_limits();
        if let Some(cpuset) = &limits.cpuset {
            assert!(!cpuset.is_empty());
        }
        if let Some(quota) = limits.quota {
            assert!(quota.cpus() > 0.0);
        }
    }
}
