//! A server-shaped process for the host view's tests (tests/programs/host_view_target.py under
//! the library): its threads' calls made and checked, its process named as a test needs.

use serde_json::Value;

use super::*;

/// `tests/programs/host_view_target.py` under the library on a simulated host, its first JSON
/// line read and each thread's call checked. Killed when dropped.
pub struct HostViewTarget {
    driver: Driver,
}

impl HostViewTarget {
    /// Started with `args` and `env`.
    pub fn start(host: &Sysfs, args: &[&str], env: &[(&str, &str)]) -> HostViewTarget {
        HostViewTarget::started(host, args, env, None)
    }

    /// [`HostViewTarget::start`], the process renamed `name` first (prctl PR_SET_NAME, the name
    /// /proc/PID/comm gives), passed through the environment, which holds what a command line may
    /// mangle.
    pub fn named(host: &Sysfs, args: &[&str], env: &[(&str, &str)], name: &str) -> HostViewTarget {
        HostViewTarget::started(host, args, env, Some(name))
    }

    fn started(
        host: &Sysfs,
        args: &[&str],
        env: &[(&str, &str)],
        name: Option<&str>,
    ) -> HostViewTarget {
        let mut cmd = clean(python());
        preload(&mut cmd, host).env("TLLM_AFFINITY_LOG", "warn");
        if let Some(name) = name {
            cmd.env("HOST_VIEW_TARGET_NAME", name).args([
                "-c",
                "import ctypes, os, runpy, sys\n\
                 ctypes.CDLL(None).prctl(15, os.environ['HOST_VIEW_TARGET_NAME'].encode(), 0, 0, 0)\n\
                 sys.argv = sys.argv[1:]\n\
                 runpy.run_path(sys.argv[0], run_name='__main__')",
            ]);
        }
        cmd.arg(program("host_view_target.py")).args(args);
        for (name, value) in env {
            cmd.env(name, value);
        }
        let mut driver = Driver::spawn(cmd, DEADLINE);
        let line = driver.line("{");
        let info: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        for (thread, rc) in info["rc"].as_object().unwrap() {
            assert!(
                rc.as_i64().unwrap() >= 0,
                "{thread} failed: {info}\n{}",
                driver.stderr()
            );
        }
        HostViewTarget { driver }
    }

    pub fn pid(&self) -> u32 {
        self.driver.pid()
    }

    /// Closes stdin: the program ends as a server does, removing its table.
    pub fn finish(self) {
        self.driver.succeed();
    }
}
