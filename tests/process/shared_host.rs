//! On a shared host (issue 44): `tllm-affinity ps` run by root and the library's own table
//! handling hold against a hostile local user, a real unprivileged user this test creates
//! (`useradd`), whose processes swap what lies at their table's name in `/dev/shm` while root
//! reads: nothing but a regular file of the process's owner is ever opened (watched with
//! inotify: an `O_PATH` look opens nothing), every run ends within its limit, and no table
//! that is not the owner's is believed.

use crate::common;
use crate::hostile_files;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use hostile_files::*;
use tllm_affinity_core::table::threadtable;

const LIMIT: Duration = Duration::from_secs(60);
/// The most one `ps` may take here, swaps and all.
const PS_LIMIT: Duration = Duration::from_secs(20);
/// How long the user swaps.
const SWAP_SECONDS: &str = "6";

const HOSTILE_USER: &str = "tllm-hostile";

/// The uid and gid of a real unprivileged user, created the first time (`useradd`, as root).
fn hostile_user() -> Result<(u32, u32), String> {
    if !root() {
        return Err("root, to create a user (useradd)".into());
    }
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id")
            .args([flag, HOSTILE_USER])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    if id("-u").is_none() {
        let made = Command::new("useradd")
            .args(["--system", "--no-create-home", "--shell", "/bin/sh"])
            .arg(HOSTILE_USER)
            .output()
            .map_err(|e| format!("useradd: {e}"))?;
        // 9: another test made it meanwhile.
        if !made.status.success() && made.status.code() != Some(9) {
            return Err(format!(
                "useradd {HOSTILE_USER}: {}",
                String::from_utf8_lossy(&made.stderr)
            ));
        }
    }
    match (id("-u"), id("-g")) {
        (Some(uid), Some(gid)) if uid != 0 => Ok((uid, gid)),
        other => Err(format!(
            "user {HOSTILE_USER} not found after useradd: {other:?}"
        )),
    }
}

/// `program` run as `uid`/`gid` (setpriv execs it: the pid is the program's).
fn as_user(uid: u32, gid: u32, program: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"))
        .arg("--clear-groups")
        .arg(program);
    cmd
}

/// Root's `ps` (one process, or the host view), within [`PS_LIMIT`]: its JSON.
fn ps(args: &[&str]) -> serde_json::Value {
    let mut cmd = clean(cli());
    cmd.arg("ps").args(args).arg("--json");
    let started = Instant::now();
    let out = run_bounded(cmd, PS_LIMIT);
    assert!(
        out.status.success(),
        "ps {args:?} failed after {:?}: {}",
        started.elapsed(),
        out.stderr
    );
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

/// What both swap tests need: `/dev/shm`, `setpriv` and the hostile user (its uid and gid), a
/// two-node host the user may read, and the `calls` and `table_swapper` programs.
fn swap_ready() -> Result<(u32, u32, Sysfs, PathBuf, PathBuf), String> {
    if !Path::new("/dev/shm").is_dir() {
        return Err("/dev/shm".into());
    }
    if !on_path("setpriv") {
        return Err("`setpriv` on PATH".into());
    }
    let (uid, gid) = hostile_user()?;
    let sysfs = Sysfs::two_nodes();
    std::fs::set_permissions(sysfs.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let calls = Program::c("calls").build();
    let swapper = Program::c("table_swapper").build();
    Ok((uid, gid, sysfs, calls, swapper))
}

/// The placements `ps PID --json` shows.
fn placements(ps: &serde_json::Value) -> Vec<String> {
    ps_column(ps, "placement")
}

/// The user's process (preloaded, a worker) and root's `ps` and host view in a loop while the
/// user swaps the name of its table (see `tests/programs/table_swapper.c`): every run ends in
/// time, the FIFOs, the device and the sparse file are never opened, the forged root-owned
/// table is never believed, and once the swaps end `ps` shows the process's own roles.
#[test]
fn root_ps_holds_while_another_user_swaps_their_table() {
    let (uid, gid, sysfs, calls, swapper) = require!(swap_ready());
    let mut victim_cmd = as_user(uid, gid, &calls);
    victim_cmd.args(["thread", "configure", "0", "wait"]);
    preload(&mut victim_cmd, &sysfs);
    let mut victim = Driver::spawn(victim_cmd, LIMIT);
    victim.line("WAIT");
    let pid = victim.pid();
    assert_eq!(placements(&ps(&[&pid.to_string()])), ["worker"], "before");

    // What the user plants, and what root holds for the user to aim at.
    let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap();
    let table = Path::new("/dev/shm").join(threadtable::file_name(pid, namespace));
    let _left = RemoveAtEnd::swapped(&table);
    let t = SwapTargets::plant(&table, Some((uid, gid)));
    let forged = t.held_dir.path().join("forged-table");
    forge(&forged, pid);
    let watch = OpenWatch::new(&t.never_opened());

    let swap_cmd = t.swapper(as_user(uid, gid, &swapper), &forged, SWAP_SECONDS);
    let mut swapping = Driver::spawn(swap_cmd, LIMIT);
    let runs = ps_while_swapping(&mut swapping, pid, ps);
    let pid_arg = pid.to_string();
    let swapped = swapping.finish();
    assert!(swapped.status.success(), "{}", swapped.stderr);
    let opens = watch.opens();
    assert_eq!(
        opens,
        0,
        "{opens} opens of {:?} ({} runs of ps, {})",
        watch.what,
        runs,
        swapped.stdout.trim()
    );
    assert!(runs >= 2, "ps ran {runs} times");
    assert_eq!(placements(&ps(&[&pid_arg])), ["worker"], "after the swaps");
    let _ = std::fs::remove_file(&t.fifo);
    let _ = std::fs::remove_file(&t.sparse);
    victim.succeed();
}

/// The user's own preloaded processes start (their first thread publishes the table, after
/// removing the stale tables of the user) while the same user swaps the name of a stale table
/// of theirs: no start ever hangs, and the FIFO and the sparse file are never opened.
#[test]
fn publishing_never_hangs_while_the_users_own_stale_table_is_swapped() {
    let (uid, gid, sysfs, calls, swapper) = require!(swap_ready());
    let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap();
    // A pid no process has: its table is stale to every process of the user.
    let table = Path::new("/dev/shm").join(threadtable::file_name(u32::MAX - 7, namespace));
    let _left = RemoveAtEnd::swapped(&table);
    // No header, fresh: kept by every process (it may be a table being written), so the swaps
    // go on for the whole run.
    std::fs::write(&table, b"").unwrap();
    chown(&table, uid, gid);
    let t = SwapTargets::plant(&table, Some((uid, gid)));
    let watch = OpenWatch::new(&t.never_opened());

    let swap_cmd = t.swapper(
        as_user(uid, gid, &swapper),
        Path::new("/etc/passwd"),
        SWAP_SECONDS,
    );
    let mut swapping = Driver::spawn(swap_cmd, LIMIT);
    let mut starts = 0;
    while !swapping.exited_within(Duration::ZERO) {
        let mut cmd = as_user(uid, gid, &calls);
        cmd.arg("thread");
        preload(&mut cmd, &sysfs);
        cmd.env("TLLM_AFFINITY_LOG", "warn");
        let out = run_bounded(cmd, Duration::from_secs(10));
        assert!(out.status.success(), "start {starts}: {}", out.stderr);
        assert!(out.stdout.contains("THREAD 0"), "{}", out.stdout);
        starts += 1;
    }
    let swapped = swapping.finish();
    assert!(swapped.status.success(), "{}", swapped.stderr);
    let opens = watch.opens();
    let _ = std::fs::remove_file(&table);
    let _ = std::fs::remove_file(&t.fifo);
    let _ = std::fs::remove_file(&t.sparse);
    assert_eq!(
        opens, 0,
        "{opens} opens of {:?} over {starts} starts",
        watch.what
    );
    assert!(starts >= 10, "{starts} starts");
}

/// The comm `escape_names.c` gives itself.
const ESCAPES: &str = "\x1b]0;pwned\x07\x1b[2J";
/// The name of its third thread: bidi controls (an override, an isolate, a mark, Arabic's mark).
const BIDI: &str = "\u{202e}ev\u{2066}\u{200f}\u{61c}";

/// Root's `ps` with `args`, within [`PS_LIMIT`], under a pseudo-terminal when `terminal` (so
/// that it paints: `script` runs it), its stdout as bytes.
fn ps_output(args: &[&str], terminal: bool) -> Vec<u8> {
    let mut cmd = if terminal {
        let line = std::iter::once(cli().display().to_string())
            .chain(std::iter::once("ps".to_string()))
            .chain(args.iter().map(|a| a.to_string()))
            .collect::<Vec<_>>()
            .join(" ");
        let mut cmd = clean("script");
        cmd.args(["-qec", &line, "/dev/null"]);
        cmd
    } else {
        let mut cmd = clean(cli());
        cmd.arg("ps").args(args);
        cmd
    };
    cmd.env_remove("NO_COLOR");
    let out = run_bounded(cmd, PS_LIMIT);
    assert!(out.status.success(), "ps {args:?}: {}", out.stderr);
    out.stdout.into_bytes()
}

/// `text` without the colour codes `ps` itself writes (`ESC [ <digits;> m`).
fn without_colour(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        if text[i] == 0x1b && text.get(i + 1) == Some(&b'[') {
            let end = text[i + 2..]
                .iter()
                .position(|b| !(b.is_ascii_digit() || *b == b';'))
                .map(|at| i + 2 + at);
            if let Some(end) = end.filter(|&e| text[e] == b'm') {
                i = end + 1;
                continue;
            }
        }
        out.push(text[i]);
        i += 1;
    }
    out
}

/// A process named with terminal escapes: `ps PID` and the host view print them escaped
/// (`\x1b`, `\x07`, `\x9b`, `\x7f`, `?` for the byte that is no UTF-8), with and without colour;
/// their JSON carries the names exactly.
#[test]
fn names_carrying_terminal_escapes_are_printed_escaped_and_kept_exact_in_json() {
    require!(on_path("script"), "`script` on PATH (a pseudo-terminal)");
    let sysfs = Sysfs::two_nodes();
    let mut run = Driver::spawn(preloaded(Program::c("escape_names").build(), &sysfs), LIMIT);
    run.line("WAIT");
    let pid = run.pid().to_string();
    for (args, terminal) in [
        (vec![pid.as_str()], false),
        (vec![pid.as_str(), "--no-color"], false),
        (vec![pid.as_str()], true),
        (vec![pid.as_str(), "--no-color"], true),
        (vec![], false),
        (vec!["--no-color"], true),
        (vec![], true),
    ] {
        let out = ps_output(&args, terminal);
        let plain = without_colour(&out);
        let raw: Vec<String> = plain
            .iter()
            .filter(|&&b| (b < 0x20 && b != b'\n' && b != b'\r') || b == 0x7f || b == 0xff)
            .map(|b| format!("{b:#04x}"))
            .collect();
        let shown = String::from_utf8_lossy(&out);
        assert!(
            raw.is_empty(),
            "ps {args:?} (terminal: {terminal}) printed raw {raw:?}:\n{shown}"
        );
        assert!(!shown.contains('\u{9b}'), "a raw C1 CSI: {shown}");
        assert!(
            shown.contains(r"\x1b]0;pwned\x07\x1b[2J"),
            "ps {args:?} (terminal: {terminal}): {shown}"
        );
        if !args.is_empty() && args[0] == pid {
            assert!(shown.contains(r"\x9b31m\x7f?x"), "{shown}");
        }
    }
    let one = ps(&[&pid]);
    assert_eq!(one["name"], ESCAPES, "{one}");
    let names: Vec<&str> = one["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [ESCAPES, "\u{9b}31m\u{7f}\u{fffd}x", BIDI], "{one}");
    let host = ps(&[]);
    let row = host["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == run.pid())
        .unwrap_or_else(|| panic!("{pid} not in {host}"))
        .clone();
    assert_eq!(row["command"], ESCAPES, "{row}");
    run.succeed();
}

/// The characters JSON may carry raw but a terminal or an editor acts on, found in `bytes` (UTF-8
/// text): DEL, the C1 controls (U+0080 to U+009F) and the bidi controls that reorder what is
/// shown (U+061C, U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069).
fn raw_controls(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .chars()
        .filter(|&c| {
            matches!(c, '\u{7f}'..='\u{9f}' | '\u{61c}' | '\u{200e}' | '\u{200f}')
                || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        })
        .map(|c| format!("U+{:04X}", c as u32))
        .collect()
}

/// `ps PID --json` and the host view's `--json` write DEL, C1 and bidi controls of thread names
/// as `\uXXXX` escapes, never raw (serde_json escapes only what is below 0x20), and the JSON
/// parses back to the very names.
#[test]
fn json_escapes_del_c1_and_bidi_controls_and_parses_to_the_same_names() {
    let sysfs = Sysfs::two_nodes();
    let mut run = Driver::spawn(preloaded(Program::c("escape_names").build(), &sysfs), LIMIT);
    run.line("WAIT");
    let pid = run.pid().to_string();
    for args in [vec![pid.as_str(), "--json"], vec!["--json"]] {
        let out = ps_output(&args, false);
        let raw = raw_controls(&out);
        assert!(
            raw.is_empty(),
            "ps {args:?} wrote {raw:?} raw:\n{}",
            String::from_utf8_lossy(&out)
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        if args.len() == 2 {
            let text = String::from_utf8_lossy(&out);
            for escape in [
                r"\u007f", r"\u009b", r"\u202e", r"\u2066", r"\u200f", r"\u061c",
            ] {
                assert!(text.contains(escape), "no {escape} in {text}");
            }
            let names: Vec<&str> = v["threads"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["name"].as_str().unwrap())
                .collect();
            assert_eq!(names, [ESCAPES, "\u{9b}31m\u{7f}\u{fffd}x", BIDI], "{v}");
        }
    }
    run.succeed();
}

/// The usual names of this process's tables, and the alternatives, of process `pid` in `/dev/shm`.
fn tables_of(pid: u32) -> Vec<PathBuf> {
    let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap();
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(threadtable::parse_file_name)
                == Some((pid, namespace))
        })
        .map(|e| e.path())
        .collect()
}

/// Another user takes the name a process will publish its table under before the process
/// starts (a shell holds the pid until the name is taken, then execs the program): as a file,
/// and as a symbolic link. The process still publishes (under a name nobody could have
/// planted), `ps` and the host view show its roles, the squatter's file is untouched, and the
/// table is gone at the process's exit.
#[test]
fn a_table_name_squatted_by_another_user_still_publishes_and_ps_shows_the_roles() {
    require!(Path::new("/dev/shm").is_dir(), "/dev/shm");
    require!(on_path("setpriv"), "`setpriv` on PATH");
    require!(two_cpus("a worker role that ps can tell from a host"));
    let (uid, gid) = require!(hostile_user());
    let sysfs = Sysfs::two_nodes();
    let calls = Program::c("calls").build();
    for squat in ["file", "link"] {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(r#"read go; export LD_PRELOAD="$LC_PRELOAD"; exec "$@""#)
            .arg("sh")
            .arg(&calls)
            .args(["thread", "configure", "0", "wait"])
            .env("LC_PRELOAD", library())
            .env("TLLM_AFFINITY_SYSFS_ROOT", sysfs.path())
            .env("TLLM_AFFINITY_LOG", "warn")
            .env_remove("LD_PRELOAD")
            .env_remove("TLLM_AFFINITY_PROCESS_ROLE");
        let mut run = Driver::spawn(cmd, LIMIT);
        let pid = run.pid();
        let namespace = threadtable::pid_namespace(Path::new("/proc/self")).unwrap();
        let usual = Path::new("/dev/shm").join(threadtable::file_name(pid, namespace));
        let _left = RemoveAtEnd(vec![usual.clone()]);
        let plant = match squat {
            "file" => format!("echo squatted > {}", usual.display()),
            _ => format!("ln -s /etc/passwd {}", usual.display()),
        };
        let mut squatter = Command::new("setpriv");
        squatter
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={gid}"))
            .args(["--clear-groups", "sh", "-c", &plant]);
        let planted = run_bounded(squatter, LIMIT);
        assert!(planted.status.success(), "{squat}: {}", planted.stderr);
        run.proceed();
        run.line("WAIT");
        let one = ps(&[&pid.to_string()]);
        assert_eq!(placements(&one), ["worker"], "{squat}: {one}");
        let host = ps(&[]);
        let row = host["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap_or_else(|| panic!("{squat}: {pid} not in {host}"))
            .clone();
        assert_eq!(row["threads"]["worker"], 1, "{squat}: {row}");
        let tables = tables_of(pid);
        assert_eq!(
            tables.len(),
            2,
            "{squat}: the squatted name and the table: {tables:?}"
        );
        let meta = std::fs::symlink_metadata(&usual).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid, "{squat}");
        if squat == "file" {
            assert_eq!(std::fs::read_to_string(&usual).unwrap(), "squatted\n");
        }
        run.succeed();
        assert_eq!(
            tables_of(pid),
            vec![usual.clone()],
            "{squat}: removed at exit"
        );
        std::fs::remove_file(&usual).unwrap();
    }
}
