//! Running a program under a deadline, answering its phases, and what to show when it hangs.

use super::*;

/// What a finished program left: its status, everything it printed on stdout, its stderr.
pub struct Finished {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// The deadline of a run whose test names none.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// A program driven line by line with a deadline: its stdout read by a thread, its stderr
/// collected in a file (a pipe nobody reads could fill and block it), in a process group of its
/// own. Every wait for output fails the test when the deadline passes, killing the process group,
/// so a hang is a failure, never a stuck test; dropping it kills the group too (what a failed
/// assertion or the program left running).
///
/// Programs with phases print `PHASE <name> <thread>=<tid>:<role> ...` and wait for a line on
/// stdin before going on.
pub struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr_path: PathBuf,
    _dir: tempfile::TempDir,
    deadline: Instant,
    /// Every stdout line read so far.
    pub out: Vec<String>,
    /// Lines read by [`Driver::line_in_any_order`] that no call has taken yet.
    unclaimed: Vec<String>,
}

impl Driver {
    pub fn spawn(mut cmd: Command, limit: Duration) -> Driver {
        let dir = tempfile::tempdir().unwrap();
        let stderr_path = dir.path().join("stderr");
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Driver {
            child,
            stdin,
            lines: rx,
            stderr_path,
            _dir: dir,
            deadline: Instant::now() + limit,
            out: Vec::new(),
            unclaimed: Vec::new(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Kills the program's process group (the program and whatever it started that stayed in
    /// it) and reaps the program.
    fn kill(&mut self) {
        // SAFETY: a signal to the process group this Driver made (its id is the program's pid).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn fail(&mut self, why: &str) -> ! {
        let states = thread_states(self.pid());
        // Before the kill: a hang is usually in a child, so every process of the group.
        let stacks = group_stacks(self.pid());
        self.kill();
        panic!(
            "{why}\nthreads (tid:state:wchan): {states}\n{stacks}\nstdout so far:\n{}\nstderr:\n{}",
            self.out.join("\n"),
            self.stderr()
        );
    }

    /// The next stdout line (kept in `out`), `None` once stdout is closed; past the deadline
    /// the test fails, saying it was `waiting_for` that.
    fn next_line(&mut self, waiting_for: &str) -> Option<String> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(left) {
            Ok(line) => {
                self.out.push(line.clone());
                Some(line)
            }
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => self.fail(&format!(
                "deadline passed waiting for {waiting_for}: killed"
            )),
        }
    }

    /// The next stdout line that starts with `prefix` (lines before it are kept in `out`).
    pub fn line(&mut self, prefix: &str) -> String {
        loop {
            match self.next_line(&format!("{prefix:?}")) {
                Some(line) if line.starts_with(prefix) => return line,
                Some(_) => {}
                None => {
                    let status = self.child.wait().ok();
                    self.fail(&format!(
                        "the program ended ({status:?}) before printing {prefix:?}"
                    ))
                }
            }
        }
    }

    /// The first line starting with `prefix` that no call of this kind took yet, whatever
    /// printed before it: for processes that print at once (MPI ranks), in any order.
    pub fn line_in_any_order(&mut self, prefix: &str) -> String {
        if let Some(i) = self.unclaimed.iter().position(|l| l.starts_with(prefix)) {
            return self.unclaimed.remove(i);
        }
        loop {
            match self.next_line(&format!("{prefix:?}")) {
                Some(line) if line.starts_with(prefix) => return line,
                Some(line) => self.unclaimed.push(line),
                None => {
                    let status = self.child.wait().ok();
                    self.fail(&format!(
                        "the program ended ({status:?}) before printing {prefix:?}"
                    ))
                }
            }
        }
    }

    /// Whether the program has exited, after waiting at most `limit` for it.
    pub fn exited_within(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What follows `prefix` on the next line that starts with it, trimmed (`PORT 8000` → `8000`).
    pub fn after(&mut self, prefix: &str) -> String {
        self.line(prefix)[prefix.len()..].trim().to_string()
    }

    /// The next PHASE line, with every named thread's mask read from `/proc`.
    pub fn phase(&mut self) -> Phase {
        let words = self.after("PHASE ");
        parse_phase(&words, self.pid(), Some)
    }

    /// The next `REPORT <tag> <json>` line, parsed.
    pub fn report(&mut self, tag: &str) -> serde_json::Value {
        let json = self.after(&format!("REPORT {tag} "));
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"))
    }

    /// Lets the program go on past its current phase (a program that has ended is fine).
    pub fn proceed(&mut self) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.write_all(b"\n").and_then(|_| stdin.flush());
        }
    }

    /// Answers the current phase, closes stdin, reads the rest of stdout and waits for the end,
    /// all before the deadline; `stdout` is everything the program printed.
    pub fn finish(mut self) -> Finished {
        self.proceed();
        drop(self.stdin.take());
        while self.next_line("the end").is_some() {}
        self.wait()
    }

    /// [`Driver::finish`], and the program exited 0 (its stderr in the message).
    pub fn succeed(self) -> Finished {
        let end = self.finish();
        assert!(end.status.success(), "{}\n{}", end.status, end.stderr);
        end
    }

    /// At the program's next phase, the thread ids the kernel lists; answered, the program prints
    /// `REPORT <tag> <json>`, whose threads must be exactly those (the library's registry equals
    /// the live threads). The phase, the tids and the report.
    pub fn phase_and_registry(&mut self, tag: &str) -> (Phase, BTreeSet<i32>, serde_json::Value) {
        let phase = self.phase();
        let live = task_tids(self.pid());
        self.proceed();
        let report = self.report(tag);
        assert_eq!(report_tids(&report), live, "{report}");
        (phase, live, report)
    }

    /// `N` phases, answered in turn, then the end.
    pub fn all_phases<const N: usize>(self) -> ([Phase; N], Finished) {
        self.phases_with(Driver::phase)
    }

    /// [`Driver::all_phases`], each phase read by `read` (a containerised program's, one
    /// settled after its exiting threads are gone).
    pub fn phases_with<const N: usize>(
        mut self,
        mut read: impl FnMut(&mut Driver) -> Phase,
    ) -> ([Phase; N], Finished) {
        let phases = std::array::from_fn(|i| {
            if i > 0 {
                self.proceed();
            }
            read(&mut self)
        });
        (phases, self.finish())
    }

    /// Runs the program to its end, answering every PHASE line as it comes; `stdout` is
    /// everything it printed.
    pub fn answer_all(mut self) -> Finished {
        while let Some(line) = self.next_line("the end") {
            if line.starts_with("PHASE ") {
                self.proceed();
            }
        }
        self.finish()
    }

    /// The exit, once stdout is closed, before the deadline.
    fn wait(&mut self) -> Finished {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Finished {
                    status,
                    stdout: self.out.join("\n"),
                    stderr: self.stderr(),
                };
            }
            if Instant::now() > self.deadline {
                self.fail("deadline passed waiting for the exit: killed");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs a command to its end with stdin closed, failing (and killing it) past `limit`.
pub fn run_bounded(cmd: Command, limit: Duration) -> Finished {
    Driver::spawn(cmd, limit).finish()
}

/// `GET <path>` on 127.0.0.1:`port` from a new thread; the handle gives the whole response.
/// Bounded: a server that never answers fails the request after 30 s.
pub fn http_get(port: u16, path: &str) -> std::thread::JoinHandle<String> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    std::thread::spawn(move || {
        use std::io::Read;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("response");
        response
    })
}

/// Runs `cmd` to its end, which must be a success (the command, its status and its output in
/// the message).
pub fn succeeded(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", output_text(&out));
    out
}

/// A finished command's status and output, for a message.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The processes of process group `pgid` (a [`Driver`]'s program and what it started that
/// stayed in its group), from `/proc/<pid>/stat`.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid: &u32| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // After the command's closing parenthesis: state, ppid, pgrp.
            stat.rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().nth(2)?.parse().ok())
                == Some(pgid)
        })
        .collect();
    pids.sort();
    pids
}

/// Every thread's stack of every process in the group, from `gdb -batch` (at most 8
/// processes, 30 s each), for the message of a test that found a hang.
pub fn group_stacks(pgid: u32) -> String {
    if !on_path("gdb") {
        return "stacks: gdb is not installed (scripts/setup installs it)".to_string();
    }
    let members = group_members(pgid);
    let mut out = format!("stacks of the {} processes of group {pgid}:", members.len());
    for pid in members.iter().take(8) {
        let stacks = Command::new("timeout")
            .args(["30", "gdb", "-batch", "-nx", "-p", &pid.to_string()])
            .args(["-ex", "thread apply all bt"])
            .stdin(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("gdb: {e}"));
        let frames: Vec<&str> = stacks
            .lines()
            .filter(|l| l.starts_with('#') || l.starts_with("Thread "))
            .collect();
        out.push_str(&format!("\n--- pid {pid}\n{}", frames.join("\n")));
    }
    out
}

/// What each thread of a live process is blocked in, for a watchdog's message.
pub fn thread_states(pid: u32) -> String {
    task_tids(pid)
        .iter()
        .map(|tid| {
            let wchan = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/wchan"))
                .unwrap_or_default();
            let stat =
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap_or_default();
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next())
                .unwrap_or("?")
                .to_string();
            format!("{tid}:{state}:{wchan}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}
