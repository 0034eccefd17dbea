//! `tllm-affinity metrics`: the host view (`ps` without a PID) in Prometheus' text exposition
//! format, for a fleet that watches Prometheus rather than logging in to each host.
//!
//! The numbers are the host view's own ([`host::gather`], bounded in time and bytes as `ps`
//! is), turned into one metric family per fact with Prometheus' conventions: the
//! `tllm_affinity_` prefix, base units in the name (`_bytes`, `_seconds`, `_ratio`), gauges
//! throughout (every figure is a state at the scan's time, none a counter, so no `_total`), and
//! `_info` families whose value is 1 and whose facts are labels. Three ways out: printed once,
//! written atomically into node_exporter's textfile directory (`--textfile`, with `--every`),
//! or served on `/metrics` (`--listen`, loopback unless `--allow-remote`).
//!
//! Neither way out lets one local user cost another anything (SPEC §9, §17): the textfile's
//! temporary name is unpredictable and created exclusively, so a link planted in a shared
//! directory is never written through; the server scans at most once per interval whatever the
//! requests, answers one request per connection within time limits, and holds at most
//! [`CONNECTIONS_AT_MOST`] connections, so a client that never reads delays no other scrape.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tllm_affinity_core::host::topology::SysfsRoot;
use tllm_affinity_core::mask::CpuMask;
use tllm_affinity_core::table::untrusted::{self, Dir};

use crate::host::{self, Entry, HostView, Kind};

/// The file node_exporter's textfile collector reads (any `*.prom` file in its directory).
pub const TEXTFILE_NAME: &str = "tllm_affinity.prom";

/// The Content-Type of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The flags the host view raises, each always exported (0 when none), so that an alert on a
/// kind sees 0 on a clean host rather than no series.
pub const FLAG_KINDS: [&str; 3] = [
    "workers-share-cpus",
    "step-threads-share-a-core",
    "memory-off-node",
];

/// `--listen`'s least time between two scans without `--every`: below any usual scrape
/// interval (15 s and up), so each scrape of one Prometheus gets a scan of its own, while a
/// flood of requests costs one scan per 5 s.
pub const LISTEN_EVERY: Duration = Duration::from_secs(5);
/// The most connections `--listen` holds at once; one more is refused at once.
pub const CONNECTIONS_AT_MOST: usize = 64;
/// The most time a client has to send its request's head.
pub const REQUEST_LIMIT: Duration = Duration::from_secs(5);
/// The most time a client has to take the whole answer.
pub const ANSWER_LIMIT: Duration = Duration::from_secs(10);
/// The longest request head read: a longer one is answered 431.
const HEAD_BYTES: usize = 8 * 1024;

#[derive(clap::Args, Debug)]
pub struct MetricsArgs {
    /// Write DIR/tllm_affinity.prom for node_exporter's textfile collector
    /// (--collector.textfile.directory=DIR), atomically: a temporary file of an unpredictable
    /// name created in DIR (no link followed, mode 0644), synced, then renamed into place.
    #[arg(long, value_name = "DIR")]
    pub textfile: Option<PathBuf>,
    /// With --textfile: scan and write again every SECONDS (e.g. 15), until stopped. With
    /// --listen: the least time between two scans (default 5); requests in between get the
    /// last scan.
    #[arg(long, value_name = "SECONDS")]
    pub every: Option<String>,
    /// Serve /metrics over HTTP on ADDR:PORT (or PORT alone: 127.0.0.1:PORT), at most one scan
    /// per --every, one request per connection, at most 64 connections. Loopback addresses
    /// only, unless --allow-remote.
    #[arg(long, value_name = "ADDR:PORT", conflicts_with = "textfile")]
    pub listen: Option<String>,
    /// Let --listen bind an address other hosts can reach. The metrics name every process under
    /// the library and its command, and the server has neither TLS nor authentication.
    #[arg(long, requires = "listen")]
    pub allow_remote: bool,
    /// Read the host's CPUs and nodes from this sysfs tree (a simulated host) instead of /.
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<PathBuf>,
    /// Errors as JSON (the metrics are Prometheus' text format either way).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &MetricsArgs) -> Result<(), String> {
    let every = args.every.as_deref().map(parse_every).transpose()?;
    if every.is_some() && args.textfile.is_none() && args.listen.is_none() {
        return Err(
            "--every needs --textfile DIR (where to write each scan) or --listen ADDR:PORT (the \
             least time between two scans)"
                .into(),
        );
    }
    let root = crate::sysfs_root(args.sysfs_root.as_deref());
    if let Some(listen) = &args.listen {
        let address = listen_address(listen, args.allow_remote)?;
        return serve(address, Scans::new(root, every.unwrap_or(LISTEN_EVERY)));
    }
    let Some(dir) = &args.textfile else {
        print!("{}", scan(&root));
        return Ok(());
    };
    remove_abandoned_temporaries(dir);
    // A directory that cannot be written is a bad argument: said once, at the start.
    write_textfile(dir, &scan(&root))?;
    let Some(every) = every else {
        return Ok(());
    };
    loop {
        let started = Instant::now();
        // Later failures (a full disk, a directory removed meanwhile) are one line each; the
        // next round tries again, as a collector that is not to be restarted by hand should.
        if let Err(why) = write_textfile(dir, &scan(&root)) {
            eprintln!("tllm-affinity metrics: {why}");
        }
        std::thread::sleep(every.saturating_sub(started.elapsed()));
    }
}

/// `--every`'s value: seconds above 0 (fractions allowed), below a day.
fn parse_every(text: &str) -> Result<Duration, String> {
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            format!("--every {text:?}: expected a number of seconds above 0 and at most 86400")
        })
}

/// `--listen`'s value as an address to bind: `PORT` is 127.0.0.1:PORT; `ADDR:PORT` (IPv6 as
/// `[ADDR]:PORT`, or a host name) must be a loopback address unless `allow_remote`.
pub fn listen_address(text: &str, allow_remote: bool) -> Result<SocketAddr, String> {
    let expected = "expected ADDR:PORT (e.g. 127.0.0.1:9477, [::1]:9477) or a PORT";
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    let address = match text.parse::<SocketAddr>() {
        Ok(address) => address,
        Err(_) => text
            .to_socket_addrs()
            .ok()
            .and_then(|mut found| found.next())
            .ok_or_else(|| format!("--listen {text:?}: {expected}"))?,
    };
    if !allow_remote && !address.ip().is_loopback() {
        return Err(format!(
            "--listen {text:?}: {} is not a loopback address; the metrics name every process \
             under the library and the server has no TLS or authentication, so give \
             --allow-remote to serve them beyond this host",
            address.ip()
        ));
    }
    Ok(address)
}

/// The start of the temporary files' names: `.` so that node_exporter (which reads `*.prom`)
/// and `ls` leave them alone.
fn temporary_prefix() -> String {
    format!(".{TEXTFILE_NAME}.")
}

/// A temporary name nobody can predict, so none can be planted: the writer's pid (to remove
/// what a stopped writer left, [`remove_abandoned_temporaries`]) and 64 random bits.
fn temporary_name() -> String {
    let bits = untrusted::unpredictable().unwrap_or_else(|| {
        // No random bits from the kernel yet (early at boot): the standard library's hash
        // keys, seeded from the kernel too, mixed with the time. The name is only ever created
        // exclusively, so a guessed one costs a retry, never a write elsewhere.
        use std::hash::{BuildHasher, Hasher};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        hasher.finish()
    });
    format!(
        "{}{}.{bits:016x}.tmp",
        temporary_prefix(),
        std::process::id()
    )
}

/// Writes `text` to `dir`/[`TEXTFILE_NAME`] so that a reader sees the old file or the new one,
/// never half of one, and so that nothing another user planted in `dir` (a shared, sticky
/// directory) is written through: a temporary file of an unpredictable name, created only if
/// nothing is there (`O_CREAT | O_EXCL | O_NOFOLLOW`, relative to `dir` held open), mode 0644
/// whatever the umask (node_exporter runs as its own user), synced, renamed over the old one,
/// then `dir` synced so that the rename survives a crash.
pub fn write_textfile(dir: &Path, text: &str) -> Result<(), String> {
    let failed = |e: std::io::Error| {
        format!(
            "--textfile {}: cannot write {}: {e}",
            dir.display(),
            dir.join(TEXTFILE_NAME).display()
        )
    };
    let opened = Dir::open(dir).map_err(failed)?;
    // A name taken (one chance in 2^64 unless guessed from the bits) is tried again, twice.
    let mut attempts = 0;
    let (temporary, mut file) = loop {
        let name = temporary_name();
        match opened.create_new(&name, 0o644) {
            Ok(file) => break (name, file),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempts < 2 => {
                attempts += 1;
            }
            Err(e) => return Err(failed(e)),
        }
    };
    let written = (|| {
        use std::os::unix::fs::PermissionsExt;
        // The umask took bits off the mode asked at creation: put back on the descriptor.
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        opened.rename(&temporary, TEXTFILE_NAME)
    })();
    if let Err(e) = written {
        let _ = opened.remove(&temporary);
        return Err(failed(e));
    }
    opened.sync().map_err(failed)
}

/// Removes the temporary files of writers that were stopped mid-write (`--every` ends by a
/// signal): ours (owned by this user: never another user's, in a shared directory) whose
/// process is gone. node_exporter never reads them, but nothing else would remove them.
fn remove_abandoned_temporaries(dir: &Path) {
    let Ok(opened) = Dir::open(dir) else {
        return;
    };
    let me = tllm_affinity_core::sys::effective_uid();
    let prefix = temporary_prefix();
    for name in opened.names().unwrap_or_default() {
        // `.<file>.<pid>.<bits>.tmp`, or `.<file>.<pid>.tmp` of writers before the random bits.
        let Some(pid) = name
            .strip_prefix(&prefix)
            .and_then(|n| n.strip_suffix(".tmp"))
            .and_then(|n| n.split('.').next())
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if opened.owner_of(&name) == Some(me) && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = opened.remove(&name);
        }
    }
}

/// The scans `--listen` serves: at most one at a time, a new one only once the last started
/// `every` ago; every request in between gets the last one, and requests that arrive during a
/// scan wait for it. So the number of requests never drives the number of scans.
struct Scans {
    root: SysfsRoot,
    every: Duration,
    latest: Mutex<Latest>,
    scanned: Condvar,
}

#[derive(Default)]
struct Latest {
    /// The last scan's exposition and when that scan started.
    scan: Option<(Instant, Arc<String>)>,
    scanning: bool,
}

/// Clears `scanning` however the scan ends (a panic included), so that waiters never wait on a
/// scan nobody makes.
struct ScanningFlag<'a>(&'a Scans);

impl Drop for ScanningFlag<'_> {
    fn drop(&mut self) {
        self.0.lock().scanning = false;
        self.0.scanned.notify_all();
    }
}

impl Scans {
    fn new(root: SysfsRoot, every: Duration) -> Scans {
        Scans {
            root,
            every,
            latest: Mutex::new(Latest::default()),
            scanned: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Latest> {
        // Nothing inside the lock can panic halfway; a poisoned lock holds whole values.
        self.latest.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The exposition to answer with now.
    fn latest(&self) -> Arc<String> {
        let mut latest = self.lock();
        loop {
            if let Some((started, text)) = &latest.scan {
                if started.elapsed() < self.every {
                    return text.clone();
                }
            }
            if !latest.scanning {
                latest.scanning = true;
                drop(latest);
                let flag = ScanningFlag(self);
                let started = Instant::now();
                let text = Arc::new(scan(&self.root));
                self.lock().scan = Some((started, text.clone()));
                drop(flag);
                return text;
            }
            latest = self
                .scanned
                .wait(latest)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Gives a connection's place back when its thread ends (or never starts).
struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves `/metrics` on `address` until the process is stopped: each connection on a thread of
/// its own, at most [`CONNECTIONS_AT_MOST`] at once (one more is refused at once; so is one
/// whose thread cannot start), one request each within [`REQUEST_LIMIT`] and its answer within
/// [`ANSWER_LIMIT`], the answer from [`Scans`].
fn serve(address: SocketAddr, scans: Scans) -> Result<(), String> {
    let listener = TcpListener::bind(address)
        .map_err(|e| format!("--listen {address}: cannot listen: {e}"))?;
    eprintln!("tllm-affinity metrics: serving http://{address}/metrics");
    let scans = Arc::new(scans);
    let open = Arc::new(AtomicUsize::new(0));
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(_) => {
                // Out of descriptors or memory, or a connection reset before it was taken:
                // the server goes on; a pause so that a full descriptor table is no busy loop.
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        if open.fetch_add(1, Ordering::SeqCst) >= CONNECTIONS_AT_MOST {
            open.fetch_sub(1, Ordering::SeqCst);
            refuse(stream);
            continue;
        }
        let place = Place(open.clone());
        let scans = scans.clone();
        // A thread that cannot start drops the closure, and with it the connection (refused)
        // and its place: the server goes on.
        let _ = std::thread::Builder::new()
            .name("metrics-client".into())
            .spawn(move || {
                let _place = place;
                answer(stream, &scans);
            });
    }
}

/// A connection beyond the cap: a 503 if the socket takes it without waiting, then closed.
fn refuse(stream: TcpStream) {
    let _ = stream.set_nonblocking(true);
    let _ = (&stream).write(
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\
          Connection: close\r\n\r\n",
    );
}

/// Reads one request's head (up to the blank line) within [`REQUEST_LIMIT`], at most
/// [`HEAD_BYTES`]: `Ok(None)` when it is longer.
fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let deadline = Instant::now() + REQUEST_LIMIT;
    let mut head = Vec::with_capacity(1024);
    let mut buffer = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buffer)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let searched_from = head.len().saturating_sub(3);
        head.extend_from_slice(&buffer[..n]);
        if let Some(at) = head[searched_from..]
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
        {
            head.truncate(searched_from + at);
            return Ok(Some(head));
        }
        if head.len() > HEAD_BYTES {
            return Ok(None);
        }
    }
}

/// One response: status line, headers, body (left out for `HEAD`).
struct Response {
    status: &'static str,
    headers: Vec<(&'static str, &'static str)>,
    body: Arc<String>,
}

impl Response {
    fn text(status: &'static str, body: &str) -> Response {
        Response {
            status,
            headers: vec![("Content-Type", "text/plain; charset=utf-8")],
            body: Arc::new(body.to_string()),
        }
    }
}

/// What the request line `head` asks for: `/metrics` from `scans`, `/` a pointer to it, other
/// paths 404, methods other than `GET` and `HEAD` 405. Also whether the body is left out.
fn route(head: &[u8], scans: &Scans) -> (Response, bool) {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (Some(method), Some(target), Some(version)) = (words.next(), words.next(), words.next())
    else {
        return (Response::text("400 Bad Request", "bad request\n"), false);
    };
    if !version.starts_with("HTTP/1.") {
        return (Response::text("400 Bad Request", "bad request\n"), false);
    }
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        let mut refused = Response::text("405 Method Not Allowed", "only GET and HEAD\n");
        refused.headers.push(("Allow", "GET, HEAD"));
        return (refused, false);
    }
    let path = target.split('?').next().unwrap_or_default();
    let response = match path {
        "/metrics" => Response {
            status: "200 OK",
            headers: vec![("Content-Type", CONTENT_TYPE)],
            body: scans.latest(),
        },
        "/" => Response::text("200 OK", "tllm-affinity metrics: see /metrics\n"),
        _ => Response::text("404 Not Found", "not found: the metrics are at /metrics\n"),
    };
    (response, head_only)
}

/// Answers one connection: one request, then closed (`Connection: close`, so pipelined
/// requests are never read, let alone answered), every step within its limit.
fn answer(mut stream: TcpStream, scans: &Scans) {
    let (response, head_only) = match read_head(&mut stream) {
        Ok(Some(head)) => route(&head, scans),
        Ok(None) => (
            Response::text(
                "431 Request Header Fields Too Large",
                "request head too long\n",
            ),
            false,
        ),
        // Silent, gone or too slow: nothing to answer.
        Err(_) => return,
    };
    let mut head = format!("HTTP/1.1 {}\r\n", response.status);
    for (name, value) in &response.headers {
        let _ = write!(head, "{name}: {value}\r\n");
    }
    let _ = write!(
        head,
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        response.body.len()
    );
    let body: &[u8] = if head_only {
        &[]
    } else {
        response.body.as_bytes()
    };
    let deadline = Instant::now() + ANSWER_LIMIT;
    for part in [head.as_bytes(), body] {
        if write_within(&mut stream, part, deadline).is_err() {
            return;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Writes `bytes` whole by `deadline`, whatever pace the client reads at.
fn write_within(
    stream: &mut TcpStream,
    mut bytes: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Scans the host as `ps` does and renders the metrics, the scan's duration included.
pub fn scan(root: &SysfsRoot) -> String {
    let started = Instant::now();
    let view = host::gather(root);
    render(&view, started.elapsed())
}

/// One metric family: its name, HELP text, type and samples.
struct Family {
    name: &'static str,
    help: &'static str,
    samples: Vec<(Vec<(&'static str, String)>, f64)>,
}

impl Family {
    fn new(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            help,
            samples: Vec::new(),
        }
    }

    fn add(&mut self, labels: Vec<(&'static str, String)>, value: f64) {
        self.samples.push((labels, value));
    }
}

/// The `pid` and `command` labels of a process.
fn process_labels(pid: u32, command: &str) -> Vec<(&'static str, String)> {
    vec![("pid", pid.to_string()), ("command", command.to_string())]
}

fn with(
    mut labels: Vec<(&'static str, String)>,
    more: &[(&'static str, String)],
) -> Vec<(&'static str, String)> {
    labels.extend_from_slice(more);
    labels
}

/// The families the exposition writes, in its order: each name and HELP text.
const FAMILIES: [(&str, &str); 15] = [
    (
        "tllm_affinity_build_info",
        "The tllm-affinity version that scanned the host (value 1).",
    ),
    (
        "tllm_affinity_scan_duration_seconds",
        "How long the scan of the host's thread tables took.",
    ),
    (
        "tllm_affinity_processes",
        "Processes whose thread table was read.",
    ),
    (
        "tllm_affinity_tables_unreadable",
        "Processes with a thread table that could not be read (not believed, or the process \
         ended while it was read).",
    ),
    (
        "tllm_affinity_processes_unreachable",
        "Processes in other PID namespaces whose root could not be looked into.",
    ),
    (
        "tllm_affinity_scan_readers_stuck",
        "Reader threads of earlier scans still stuck in a process's /proc files (at most 32 \
         alive; a process whose reader cannot start counts as unreadable).",
    ),
    (
        "tllm_affinity_threads",
        "Threads of a process by role (worker, step, result, host, unknown).",
    ),
    (
        "tllm_affinity_worker_cpus",
        "CPUs the workers of a process may run on, per NUMA node.",
    ),
    (
        "tllm_affinity_worker_cpus_info",
        "The CPU list the workers of a process may run on (value 1).",
    ),
    (
        "tllm_affinity_leases",
        "Open leases of a process per GPU (sum by gpu for the leases of each GPU).",
    ),
    (
        "tllm_affinity_lease_slice_cpus",
        "CPUs of the GPU slice a process's open leases put its workers on \
         (TLLM_AFFINITY_SLICE=gpu), per GPU; the cpus label lists them.",
    ),
    (
        "tllm_affinity_memory_resident_bytes",
        "Resident memory of a process per NUMA node.",
    ),
    (
        "tllm_affinity_memory_off_workers_node_ratio",
        "Share of a worker process's resident memory (on nodes with CPUs) that lies off its \
         workers' node, the node label.",
    ),
    (
        "tllm_affinity_flags",
        "What the host view flags, counted by kind.",
    ),
    (
        "tllm_affinity_process_flags",
        "Flags naming a process, by kind.",
    ),
];

/// The metrics of `view`, scanned in `took`.
pub fn render(view: &HostView, took: Duration) -> String {
    let [mut build, mut duration, mut processes, mut unreadable, mut unreachable, mut stuck, mut threads, mut worker_cpus, mut worker_cpus_info, mut leases, mut lease_slices, mut memory, mut off_node, mut flags, mut process_flags] =
        FAMILIES.map(|(name, help)| Family::new(name, help));
    build.add(vec![("version", env!("CARGO_PKG_VERSION").into())], 1.0);
    duration.add(Vec::new(), took.as_secs_f64());

    let node_of: BTreeMap<usize, Option<usize>> = view
        .groups
        .iter()
        .flat_map(|g| g.cpus.iter().map(move |&c| (c, g.node)))
        .collect();
    let mut shown = 0;
    let mut commands = BTreeMap::new();
    for entry in &view.entries {
        let r = match entry {
            Entry::Row(r) => r,
            Entry::Line(_) => continue,
        };
        shown += 1;
        commands.insert(r.pid, r.command.as_str());
        let labels = process_labels(r.pid, &r.command);
        for (kind, n) in &r.threads {
            threads.add(
                with(labels.clone(), &[("role", kind.name().into())]),
                *n as f64,
            );
        }
        let workers = r.on(Kind::Worker);
        if !workers.is_empty() {
            let mut per_node: BTreeMap<Option<usize>, usize> = BTreeMap::new();
            for cpu in workers.iter() {
                *per_node
                    .entry(node_of.get(&cpu).copied().flatten())
                    .or_default() += 1;
            }
            for (node, n) in per_node {
                let node: Vec<(&'static str, String)> =
                    node.map(|n| ("node", n.to_string())).into_iter().collect();
                worker_cpus.add(with(labels.clone(), &node), n as f64);
            }
            worker_cpus_info.add(with(labels.clone(), &[("cpus", workers.to_list())]), 1.0);
        }
        if let Ok(open) = &r.leases {
            let mut per_device: BTreeMap<(Option<usize>, &str), usize> = BTreeMap::new();
            // The leases of one GPU share its slice (it follows from the topology alone).
            let mut slice_of: BTreeMap<(Option<usize>, &str), &CpuMask> = BTreeMap::new();
            for lease in open {
                let key = (lease.gpu_index, lease.device.as_str());
                *per_device.entry(key).or_default() += 1;
                if let Some(slice) = &lease.slice {
                    slice_of.insert(key, slice);
                }
            }
            let device_labels = |gpu: Option<usize>, device: &str| match gpu {
                Some(gpu) => vec![("gpu", gpu.to_string()), ("pci_bus_id", device.into())],
                // A lease whose CPUs TLLM_AFFINITY_CPUS chose names no GPU.
                None => vec![("device", device.into())],
            };
            for ((gpu, device), n) in per_device {
                leases.add(with(labels.clone(), &device_labels(gpu, device)), n as f64);
            }
            for ((gpu, device), slice) in slice_of {
                let mut slice_labels = device_labels(gpu, device);
                slice_labels.push(("cpus", slice.to_list()));
                lease_slices.add(with(labels.clone(), &slice_labels), slice.count() as f64);
            }
        }
        if let Ok(m) = &r.memory {
            for (node, bytes) in &m.bytes {
                memory.add(
                    with(labels.clone(), &[("node", node.to_string())]),
                    *bytes as f64,
                );
            }
        }
        if let Some(o) = host::off_node(r, &view.kernel_nodes) {
            if o.total > 0 {
                let off: u64 = o.off.values().sum();
                off_node.add(
                    with(labels.clone(), &[("node", o.node.to_string())]),
                    off as f64 / o.total as f64,
                );
            }
        }
    }
    processes.add(Vec::new(), shown as f64);
    let lines = view
        .entries
        .iter()
        .filter(|e| matches!(e, Entry::Line(_)))
        .count();
    unreadable.add(Vec::new(), lines as f64);
    unreachable.add(Vec::new(), view.unreachable as f64);
    stuck.add(Vec::new(), view.readers_stuck as f64);
    for kind in FLAG_KINDS {
        let n = view.flags.iter().filter(|f| f.kind == kind).count();
        flags.add(vec![("kind", kind.into())], n as f64);
    }
    let mut named: BTreeMap<(u32, &str), usize> = BTreeMap::new();
    for f in &view.flags {
        for pid in &f.pids {
            *named.entry((*pid, f.kind)).or_default() += 1;
        }
    }
    for ((pid, kind), n) in named {
        let command = commands.get(&pid).copied().unwrap_or_default();
        process_flags.add(
            with(process_labels(pid, command), &[("kind", kind.into())]),
            n as f64,
        );
    }

    let families = [
        build,
        duration,
        processes,
        unreadable,
        unreachable,
        stuck,
        threads,
        worker_cpus,
        worker_cpus_info,
        leases,
        lease_slices,
        memory,
        off_node,
        flags,
        process_flags,
    ];
    let mut out = String::new();
    for family in &families {
        // A family without samples is left out: parsers drop it anyway.
        if family.samples.is_empty() {
            continue;
        }
        let _ = writeln!(out, "# HELP {} {}", family.name, family.help);
        let _ = writeln!(out, "# TYPE {} gauge", family.name);
        for (labels, value) in &family.samples {
            out.push_str(family.name);
            if !labels.is_empty() {
                let inner: Vec<String> = labels
                    .iter()
                    .map(|(name, value)| format!("{name}=\"{}\"", escape_label(value)))
                    .collect();
                let _ = write!(out, "{{{}}}", inner.join(","));
            }
            let _ = writeln!(out, " {value}");
        }
    }
    out
}

/// A label value as the text format requires: `\` as `\\`, `"` as `\"`, a newline as `\n`
/// (every other character, control characters included, stands for itself).
pub fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{CpuGroup, Flag, ProcessLine, ProcessRow};
    use crate::memory_reading::NodeMemory;
    use tllm_affinity_core::mask::CpuMask;
    use tllm_affinity_core::table::threadtable::LeaseLine;

    fn m(list: &str) -> CpuMask {
        CpuMask::parse_list(list).unwrap()
    }

    fn view() -> HostView {
        let gib = 1u64 << 30;
        let row = ProcessRow {
            pid: 42,
            namespace_pid: None,
            command: "a\"b\\c\nd".into(),
            leases: Ok(vec![
                LeaseLine {
                    id: 1,
                    gpu_index: Some(0),
                    device: "0000:3b:00.0".into(),
                    slice: None,
                },
                LeaseLine {
                    id: 2,
                    gpu_index: Some(0),
                    device: "0000:3b:00.0".into(),
                    slice: Some(m("4-7")),
                },
            ]),
            cpus: [(Kind::Worker, m("4-7")), (Kind::Host, m("0-7"))]
                .into_iter()
                .collect(),
            threads: [(Kind::Worker, 2), (Kind::Host, 3)].into_iter().collect(),
            explicit: CpuMask::default(),
            external: CpuMask::default(),
            memory: Ok(NodeMemory {
                bytes: [(0, 3 * gib), (1, gib), (2, 5 * gib)].into_iter().collect(),
                source: "test".into(),
                partial: None,
            }),
        };
        HostView {
            entries: vec![
                Entry::Row(row),
                Entry::Line(ProcessLine {
                    pid: 43,
                    command: None,
                    why: "exited while it was read".into(),
                }),
            ],
            unreachable: 0,
            readers_stuck: 2,
            groups: vec![
                CpuGroup {
                    node: Some(0),
                    cpus: (0..4).collect(),
                },
                CpuGroup {
                    node: Some(1),
                    cpus: (4..8).collect(),
                },
            ],
            cores: Vec::new(),
            flags: vec![Flag {
                kind: "memory-off-node",
                pids: vec![42],
                cpus: m("4-7"),
                text: String::new(),
            }],
            kernel_nodes: vec![(0, m("0-3")), (1, m("4-7"))],
        }
    }

    #[test]
    fn every_fact_is_one_family_with_help_type_and_escaped_labels() {
        let text = render(&view(), Duration::from_millis(250));
        let p = r#"pid="42",command="a\"b\\c\nd""#;
        for line in [
            "# TYPE tllm_affinity_threads gauge".to_string(),
            format!("tllm_affinity_threads{{{p},role=\"worker\"}} 2"),
            format!("tllm_affinity_threads{{{p},role=\"host\"}} 3"),
            format!("tllm_affinity_worker_cpus{{{p},node=\"1\"}} 4"),
            format!("tllm_affinity_worker_cpus_info{{{p},cpus=\"4-7\"}} 1"),
            format!("tllm_affinity_leases{{{p},gpu=\"0\",pci_bus_id=\"0000:3b:00.0\"}} 2"),
            format!(
                "tllm_affinity_lease_slice_cpus{{{p},gpu=\"0\",pci_bus_id=\"0000:3b:00.0\",\
                 cpus=\"4-7\"}} 4"
            ),
            format!("tllm_affinity_memory_resident_bytes{{{p},node=\"2\"}} 5368709120"),
            // Node 2 has no CPU (a GPU's memory): 3 GiB of 4 GiB off node 1.
            format!("tllm_affinity_memory_off_workers_node_ratio{{{p},node=\"1\"}} 0.75"),
            "tllm_affinity_flags{kind=\"memory-off-node\"} 1".into(),
            "tllm_affinity_flags{kind=\"workers-share-cpus\"} 0".into(),
            format!("tllm_affinity_process_flags{{{p},kind=\"memory-off-node\"}} 1"),
            "tllm_affinity_processes 1".into(),
            "tllm_affinity_tables_unreadable 1".into(),
            "tllm_affinity_scan_readers_stuck 2".into(),
            "# TYPE tllm_affinity_scan_readers_stuck gauge".into(),
            "tllm_affinity_scan_duration_seconds 0.25".into(),
            format!(
                "tllm_affinity_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
        // One HELP and one TYPE per family, before its samples.
        let mut seen = Vec::new();
        for l in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let name = l.split_whitespace().nth(2).unwrap();
            assert!(!seen.contains(&name), "{name} twice\n{text}");
            seen.push(name);
        }
        assert_eq!(
            text.lines().filter(|l| l.starts_with("# HELP ")).count(),
            seen.len()
        );
    }

    #[test]
    fn label_values_escape_backslash_quote_and_newline_only() {
        assert_eq!(escape_label(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(escape_label("x\ny\tz"), "x\\ny\tz");
    }

    #[test]
    fn listen_takes_loopback_unless_told_and_says_why_not() {
        assert_eq!(
            listen_address("9477", false).unwrap(),
            "127.0.0.1:9477".parse().unwrap()
        );
        assert!(listen_address("[::1]:9477", false).is_ok());
        let refused = listen_address("0.0.0.0:9477", false).unwrap_err();
        assert!(refused.contains("--allow-remote"), "{refused}");
        assert!(listen_address("0.0.0.0:9477", true).is_ok());
        let bad = listen_address("nowhere:port", false).unwrap_err();
        assert!(
            bad.starts_with("--listen \"nowhere:port\": expected"),
            "{bad}"
        );
    }

    #[test]
    fn every_takes_positive_seconds() {
        assert_eq!(parse_every("15").unwrap(), Duration::from_secs(15));
        assert_eq!(parse_every("0.5").unwrap(), Duration::from_millis(500));
        for bad in ["0", "-1", "nan", "inf", "soon", "100000"] {
            assert!(parse_every(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_textfile_is_replaced_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        write_textfile(dir.path(), "a 1\n").unwrap();
        write_textfile(dir.path(), "a 2\n").unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [TEXTFILE_NAME]);
        assert_eq!(
            std::fs::read_to_string(dir.path().join(TEXTFILE_NAME)).unwrap(),
            "a 2\n"
        );
        // A writer stopped mid-write left its temporary: removed once its process is gone; a
        // live writer's is left alone.
        let gone = dir.path().join(format!(".{TEXTFILE_NAME}.999999999.tmp"));
        let live = dir
            .path()
            .join(format!(".{TEXTFILE_NAME}.{}.tmp", std::process::id()));
        std::fs::write(&gone, "a 1\n").unwrap();
        std::fs::write(&live, "a 1\n").unwrap();
        remove_abandoned_temporaries(dir.path());
        assert!(!gone.exists());
        assert!(live.exists());
        let missing = dir.path().join("nonexistent");
        let why = write_textfile(&missing, "a 1\n").unwrap_err();
        assert!(why.starts_with("--textfile "), "{why}");
    }

    /// The `tllm_affinity_*` names in `text`.
    fn metric_names(text: &str) -> Vec<String> {
        let mut names = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find("tllm_affinity_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            names.push(name);
        }
        names
    }

    /// Every string under a key `key` in `v`.
    fn strings_under(v: &serde_json::Value, key: &str, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, value) in map {
                    match value {
                        serde_json::Value::String(s) if k == key => out.push(s.clone()),
                        _ => strings_under(value, key, out),
                    }
                }
            }
            serde_json::Value::Array(items) => {
                for item in items {
                    strings_under(item, key, out);
                }
            }
            _ => {}
        }
    }

    /// The dashboard and the alert rules in docs/monitoring ask only for metrics the exporter
    /// writes: every query of every panel names one, and every name is a family of the output.
    #[test]
    fn the_dashboard_and_the_rules_name_only_metrics_the_exporter_writes() {
        let text = render(&view(), Duration::from_millis(1));
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/monitoring");
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(docs.join("dashboard.json")).unwrap())
                .expect("dashboard.json is JSON");
        let mut exprs = Vec::new();
        strings_under(&dashboard["panels"], "expr", &mut exprs);
        let panels = dashboard["panels"].as_array().unwrap();
        assert!(exprs.len() >= panels.len(), "a panel without a query");
        let mut variables = Vec::new();
        strings_under(&dashboard["templating"], "definition", &mut variables);
        for expr in exprs.iter().chain(&variables) {
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{expr:?} names no tllm_affinity metric");
            for name in names {
                assert!(
                    families.contains(&name.as_str()),
                    "{expr:?}: no family {name}\n{text}"
                );
            }
        }
        let rules = std::fs::read_to_string(docs.join("rules.yml")).unwrap();
        let named = metric_names(&rules);
        assert!(named.len() >= 5, "{named:?}");
        for name in named {
            assert!(
                families.contains(&name.as_str()),
                "rules.yml: no family {name}"
            );
        }
    }
}
