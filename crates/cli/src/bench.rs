//! `kiln bench`: a fio-like load generator on the native client API.
//!
//! Each job owns one connection and keeps `iodepth` requests in flight with the callback API:
//! a completion records its latency and submits the next request from the receive thread, so
//! requests that become due together leave in one `sendmsg`.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kiln_client::{block_on, Fd, PageBuf, RawIov, Volume};
use kiln_fuse::Switch;
use kiln_layer::faults::DelayGenConfig;
use kiln_layer::layers::posix::PosixConfig;
use kiln_layer::replicate::ReplicateConfig;
use kiln_layer::trace::{TraceLog, Waterfall};
use kiln_layer::volfile::{LayerKind, ProtocolClientConfig, Volfile};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// Access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Rw {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Uniformly random reads.
    Randread,
    /// Uniformly random writes.
    Randwrite,
    /// Random, half reads and half writes.
    Randrw,
}

/// Transport to the brick server that `kiln bench` starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// TCP over loopback.
    Tcp,
    /// A Unix socket.
    Unix,
}

/// Runs a timed I/O load against one file on a brick and reports throughput, latency
/// percentiles and the CPU time of client and server.
///
/// Without --connect it starts its own brick server (`kiln server`) on --brick (default: a new
/// temporary directory) and measures that server's CPU time too.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Access pattern.
    #[arg(long, value_enum, default_value = "randread")]
    pub rw: Rw,
    /// Block size of each request (e.g. 4k, 128k, 1m).
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    pub bs: u64,
    /// Requests kept in flight per job.
    #[arg(long, default_value_t = 1)]
    pub iodepth: usize,
    /// Size of the file the load runs over (it is written first if shorter).
    #[arg(long, default_value = "1g", value_parser = parse_size)]
    pub size: u64,
    /// Parallel jobs, each with its own connection.
    #[arg(long, default_value_t = 1)]
    pub numjobs: usize,
    /// Seconds to run the timed phase (at most a day).
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = kiln_proto::seconds::up_to_a_day)]
    pub runtime: f64,
    /// Transport to the server this command starts.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: Transport,
    /// Brick directory for the server this command starts (default: a temporary directory);
    /// with --replica, the directory the bricks brick0, brick1, … are made in.
    #[arg(long)]
    pub brick: Option<PathBuf>,
    /// Use a running server instead (tcp:HOST:PORT or unix:PATH).
    #[arg(long, value_name = "ADDR")]
    pub connect: Option<String>,
    /// With --connect: the server's PID, to report its CPU time.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// File to run against, relative to the volume root.
    #[arg(long, default_value = "kiln-bench.img")]
    pub file: String,
    /// Print one JSON object instead of the table: {"ok": true, "mb_s", "iops", "lat_us", …}.
    #[arg(long)]
    pub json: bool,
    /// Put io-stats at six points: client top, above protocol-client, and in the brick below
    /// the protocol server, above and below dispatch, and above posix (needs the server this
    /// command starts).
    #[arg(long)]
    pub profile_points: bool,
    /// Trace every Nth request and print the waterfall: where each request's time went, per
    /// stage, from the client's layers through the wire and the brick back to the completion.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub trace_every: u64,
    /// Add a delay-gen above posix that holds every read back this many µs (fault injection,
    /// to check what the waterfall attributes; needs the server this command starts).
    #[arg(long, value_name = "US")]
    pub delay_read_us: Option<u64>,
    /// No io-stats anywhere: the client is only its protocol-client and the brick only dispatch
    /// over posix (the baseline for what observability costs).
    #[arg(long, conflicts_with = "profile_points")]
    pub bare: bool,
    /// Put the graph switch on top of the client stack, as a mount or export of a managed
    /// volume has it (to measure what following the volume's graph versions costs).
    #[arg(long)]
    pub switch: bool,
    /// Start this many brick servers (each with the replica brick stack: marks over posix) and
    /// run over a replicate volume of them: every write goes to all, reads to one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub replica: u32,
    /// TLS: the servers this command starts get `--tls DIR` and the client uses DIR as its
    /// identity too (a directory from `kiln tls issue` with --san 127.0.0.1). With --connect,
    /// set KILN_TLS_DIR instead.
    #[arg(long, value_name = "DIR", conflicts_with = "connect")]
    pub tls: Option<PathBuf>,
    /// Local short-circuit reads: over a Unix socket, read straight from the brick's file
    /// while the brick's grant holds (on), or always through the brick (off).
    #[arg(long, value_enum, default_value = "on")]
    pub short_circuit: Switch,
}

impl BenchArgs {
    /// The brick stack the started server runs, when not the default.
    fn server_volfile(&self, dir: &std::path::Path) -> Option<Volfile> {
        if !self.profile_points && !self.bare && self.delay_read_us.is_none() {
            return None;
        }
        let stats = |n: &str| (n.to_owned(), LayerKind::IoStats {});
        let mut layers = Vec::new();
        if self.profile_points {
            layers.extend([stats("below-protocol-server"), stats("above-dispatch")]);
        }
        layers.push(("dispatch".into(), LayerKind::Dispatch {}));
        if self.profile_points {
            layers.extend([stats("below-dispatch"), stats("above-posix")]);
        }
        if let Some(us) = self.delay_read_us {
            layers.push((
                "slow-reads".into(),
                LayerKind::DelayGen(DelayGenConfig {
                    fops: vec!["read".into()],
                    delay_us: us,
                    probability: 1.0,
                    seed: 1,
                }),
            ));
        }
        layers.push(("posix".into(), LayerKind::Posix(PosixConfig::at(dir))));
        Some(Volfile::linear(layers))
    }

    /// `volfile` with --short-circuit applied to its protocol-clients.
    fn short_circuit(&self, mut volfile: Volfile) -> Volfile {
        for l in &mut volfile.layers {
            if let LayerKind::ProtocolClient(p) = &mut l.kind {
                p.short_circuit = Some(self.short_circuit == Switch::On);
            }
        }
        volfile
    }

    /// The client stack for the brick at `addr`.
    fn client_volfile(&self, addr: &str) -> Volfile {
        if self.bare {
            return Volfile::linear(vec![(
                "brick".into(),
                LayerKind::ProtocolClient(ProtocolClientConfig::to(addr)),
            )]);
        }
        if !self.profile_points {
            return Volume::default_volfile(addr);
        }
        Volfile::linear(vec![
            ("client-top".into(), LayerKind::IoStats {}),
            ("above-protocol-client".into(), LayerKind::IoStats {}),
            (
                "brick".into(),
                LayerKind::ProtocolClient(ProtocolClientConfig::to(addr)),
            ),
        ])
    }
}

/// Parses `4096`, `4k`, `128K`, `1m`, `1g` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, Error> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_lowercase()) {
        Some('k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        Some('t') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| Error::invalid(format!("bad size {s:?}: want e.g. 4096, 4k, 1m, 1g")))?;
    n.checked_mul(mult)
        .ok_or_else(|| Error::invalid(format!("size {s:?} is too large")))
}

/// A brick server child process started for a benchmark or demo.
pub struct ChildServer {
    child: Child,
    /// Address a client connects to.
    pub addr: String,
    _tmp: Option<tempfile::TempDir>,
}

impl ChildServer {
    /// Starts `kiln server` on `brick` (or a temporary directory) listening on `transport`,
    /// with the default stack or the one `stack` makes for the directory.
    pub fn start(
        brick: Option<PathBuf>,
        transport: Transport,
        tls: Option<&std::path::Path>,
        stack: impl FnOnce(&std::path::Path) -> Option<Volfile>,
    ) -> std::io::Result<ChildServer> {
        let tmp = match &brick {
            Some(_) => None,
            None => Some(tempfile::Builder::new().prefix("kiln-bench-").tempdir()?),
        };
        let dir = brick
            .clone()
            .unwrap_or_else(|| tmp.as_ref().expect("tempdir").path().to_owned());
        std::fs::create_dir_all(&dir)?;
        let sock_dir = tempfile::Builder::new()
            .prefix("kiln-sock-")
            .tempdir()?
            .keep();
        let listen = match transport {
            Transport::Tcp => "tcp:127.0.0.1:0".to_owned(),
            Transport::Unix => format!("unix:{}", sock_dir.join("kilnd.sock").display()),
        };
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("server");
        match stack(&dir) {
            Some(v) => {
                let f = sock_dir.join("brick.vol");
                std::fs::write(&f, v.to_toml())?;
                cmd.arg("--volfile").arg(f);
            }
            None => {
                cmd.arg("--brick").arg(&dir);
            }
        }
        if let Some(t) = tls {
            cmd.arg("--tls").arg(t);
        }
        let mut child = cmd
            .args(["--listen", &listen, "--metrics", "off"])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()?;
        let out = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("kilnd: listening on ") else {
            let _ = child.kill();
            return Err(std::io::Error::other(format!(
                "server did not start: {line:?}"
            )));
        };
        Ok(ChildServer {
            addr: addr.to_owned(),
            child,
            _tmp: tmp,
        })
    }

    /// The server's PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU seconds (user + system) a process has used, from /proc.
pub fn proc_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

/// CPU seconds this process has used.
pub fn self_cpu_seconds() -> f64 {
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we pass, which lives for the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Result of a run.
#[derive(Debug, Clone)]
pub struct BenchResult {
    /// Bytes moved in the timed phase.
    pub bytes: u64,
    /// Requests completed in the timed phase.
    pub ios: u64,
    /// Length of the timed phase.
    pub runtime_s: f64,
    /// Latency histogram in nanoseconds.
    pub lat_ns: Histogram<u64>,
    /// Client CPU seconds in the timed phase.
    pub cpu_client_s: f64,
    /// Server CPU seconds in the timed phase, when known.
    pub cpu_server_s: Option<f64>,
    /// Errors seen.
    pub errors: u64,
    /// Payload bytes the client copied in user space.
    pub bytes_copied: u64,
    /// Frames per `sendmsg` on the first job's connection.
    pub frames_per_send: f64,
    /// Per-stage times of the traced requests, when tracing was on.
    pub waterfall: Option<Waterfall>,
}

impl BenchResult {
    /// Throughput in MB/s (10^6 bytes).
    pub fn mb_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.runtime_s
    }
    /// Requests per second.
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.runtime_s
    }
    /// Latency quantile in microseconds.
    pub fn lat_us(&self, q: f64) -> f64 {
        self.lat_ns.value_at_quantile(q) as f64 / 1000.0
    }
}

/// Job `j`'s request buffers, one per request in flight, page-aligned as fio's and QEMU's are.
fn slots(args: &BenchArgs, j: usize) -> Vec<Mutex<PageBuf>> {
    (0..args.iodepth)
        .map(|i| Mutex::new(PageBuf::filled(args.bs as usize, (i + j) as u8)))
        .collect()
}

/// Requests whose completion came inside a submission, to be issued by the outer one.
type Queued = Vec<(Arc<Job>, usize)>;

struct Job {
    vol: Arc<Volume>,
    fd: Fd,
    rw: Rw,
    bs: u64,
    blocks: u64,
    deadline: Instant,
    next_seq: AtomicU64,
    rng: AtomicU64,
    bufs: Vec<Mutex<PageBuf>>,
    hist: Mutex<Histogram<u64>>,
    ios: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    inflight: AtomicUsize,
    stop: AtomicBool,
    idle: (Mutex<()>, Condvar),
}

impl Job {
    fn next_offset(&self) -> (u64, bool) {
        let write = match self.rw {
            Rw::Read | Rw::Randread => false,
            Rw::Write | Rw::Randwrite => true,
            Rw::Randrw => self.rand() & 1 == 1,
        };
        let block = match self.rw {
            Rw::Read | Rw::Write => self.next_seq.fetch_add(1, Ordering::Relaxed) % self.blocks,
            _ => self.rand() % self.blocks,
        };
        (block * self.bs, write)
    }

    fn rand(&self) -> u64 {
        // xorshift64*, shared by the job's completions; a lost update only repeats a number.
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.store(x, Ordering::Relaxed);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11
    }

    /// Submits the next request on buffer `slot`; its completion submits the one after. A
    /// completion that runs inside the submission (a local short-circuit read completes at
    /// once) queues its next request for the outer call instead of nesting a call per request.
    fn issue(self: &Arc<Self>, slot: usize) {
        thread_local! {
            static QUEUED: std::cell::RefCell<Option<Queued>> =
                const { std::cell::RefCell::new(None) };
        }
        let nested = QUEUED.with(|q| {
            let mut q = q.borrow_mut();
            match q.as_mut() {
                Some(v) => {
                    v.push((self.clone(), slot));
                    true
                }
                None => {
                    *q = Some(Vec::new());
                    false
                }
            }
        });
        if nested {
            return;
        }
        let mut next = Some((self.clone(), slot));
        while let Some((job, slot)) = next {
            job.issue_one(slot);
            next = QUEUED.with(|q| q.borrow_mut().as_mut().and_then(Vec::pop));
        }
        QUEUED.with(|q| *q.borrow_mut() = None);
    }

    fn issue_one(self: &Arc<Self>, slot: usize) {
        if self.stop.load(Ordering::Relaxed) || Instant::now() >= self.deadline {
            self.retire();
            return;
        }
        let (offset, write) = self.next_offset();
        let iov = {
            let mut b = self.bufs[slot].lock().expect("buffer lock");
            [RawIov {
                base: b.as_mut_ptr() as usize,
                len: b.len(),
            }]
        };
        let me = self.clone();
        let start = Instant::now();
        let cb = Box::new(move |r: Result<usize, u32>| {
            let ns = start.elapsed().as_nanos() as u64;
            match r {
                Ok(n) => {
                    me.ios.fetch_add(1, Ordering::Relaxed);
                    me.bytes.fetch_add(n as u64, Ordering::Relaxed);
                    let _ = me.hist.lock().expect("hist lock").record(ns.max(1));
                }
                Err(_) => {
                    me.errors.fetch_add(1, Ordering::Relaxed);
                    me.stop.store(true, Ordering::Relaxed);
                }
            }
            me.issue(slot);
        });
        // SAFETY: buffer `slot` lives in `self.bufs` (kept alive by the Arc the callback holds)
        // and only this request uses it until the callback runs.
        unsafe {
            if write {
                self.vol.pwritev_raw(&self.fd, &iov, offset, cb)
            } else {
                self.vol.preadv_raw(&self.fd, &iov, offset, cb)
            }
        }
    }

    fn retire(&self) {
        if self.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _g = self.idle.0.lock().expect("idle lock");
            self.idle.1.notify_all();
        }
    }

    fn wait_idle(&self) {
        let mut g = self.idle.0.lock().expect("idle lock");
        while self.inflight.load(Ordering::Acquire) > 0 {
            g = self
                .idle
                .1
                .wait_timeout(g, Duration::from_millis(100))
                .expect("idle wait")
                .0;
        }
    }
}

/// Writes the file up to `size` with 1 MiB writes, 8 in flight, if it is shorter.
pub fn layout(vol: &Volume, path: &str, size: u64) -> std::io::Result<kiln_layer::Fd> {
    let (fd, attr) = block_on(vol.create(path, libc::O_RDWR | libc::O_CREAT, 0o644))?;
    if attr.size >= size {
        return Ok(fd);
    }
    let chunk = 1u64 << 20;
    let mut off = attr.size / chunk * chunk;
    let mut pattern = vec![0u8; chunk as usize];
    for (i, b) in pattern.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    while off < size {
        let futs: Vec<_> = (0..8)
            .map(|k| off + k * chunk)
            .filter(|o| *o < size)
            .map(|o| {
                let len = chunk.min(size - o) as usize;
                Some(Box::pin(vol.pwritev(&fd, vec![pattern[..len].to_vec()], o)))
            })
            .collect();
        let n = futs.len() as u64;
        for (r, _) in block_on(kiln_layer::exec::join_all(futs))
            .into_iter()
            .flatten()
        {
            r?;
        }
        off += n * chunk;
    }
    Ok(fd)
}

/// Runs the timed phase against `addr`.
/// One job's client stack: under the graph switch with `--switch`.
fn job_volume(args: &BenchArgs, volfile: &Volfile) -> std::io::Result<Volume> {
    match args.switch {
        true => Volume::from_volfile_switched(volfile),
        false => Volume::from_volfile(volfile),
    }
}

pub fn run(args: &BenchArgs, addr: &str, server_pid: Option<u32>) -> std::io::Result<BenchResult> {
    run_volfile(
        args,
        &args.short_circuit(args.client_volfile(addr)),
        server_pid.into_iter().collect(),
    )
}

/// The client stack of a replicate volume over bricks at `addrs`.
fn replica_volfile(addrs: &[String]) -> Volfile {
    use kiln_layer::volfile::LayerDef;
    let mut layers = vec![
        LayerDef {
            name: "client".into(),
            subvolumes: Vec::new(),
            kind: LayerKind::IoStats {},
        },
        LayerDef {
            name: "replicate".into(),
            subvolumes: (0..addrs.len()).map(|i| format!("brick{i}")).collect(),
            kind: LayerKind::Replicate(ReplicateConfig::default()),
        },
    ];
    for (i, a) in addrs.iter().enumerate() {
        layers.push(LayerDef {
            name: format!("brick{i}"),
            subvolumes: Vec::new(),
            kind: LayerKind::ProtocolClient(ProtocolClientConfig::to(a)),
        });
    }
    Volfile { layers }
}

/// Requests per `sendmsg` on a connection.
fn frames_per_send(c: &kiln_client::Client) -> f64 {
    let s = c.stats();
    s.requests.load(Ordering::Relaxed) as f64 / s.send_calls.load(Ordering::Relaxed).max(1) as f64
}

/// Runs the timed phase over the client stack `volfile`; `server_pids` are the bricks whose
/// CPU time is reported.
pub fn run_volfile(
    args: &BenchArgs,
    volfile: &Volfile,
    server_pids: Vec<u32>,
) -> std::io::Result<BenchResult> {
    if args.bs == 0 || args.bs > kiln_proto::MAX_PAYLOAD_LEN as u64 {
        return Err(std::io::Error::other(format!(
            "--bs must be between 1 and {} bytes",
            kiln_proto::MAX_PAYLOAD_LEN
        )));
    }
    if args.size < args.bs {
        return Err(std::io::Error::other("--size must be at least --bs"));
    }
    if args.iodepth == 0 || args.numjobs == 0 {
        return Err(std::io::Error::other(
            "--iodepth and --numjobs must be at least 1",
        ));
    }
    let setup = Volume::from_volfile(volfile)?;
    let reads = matches!(args.rw, Rw::Read | Rw::Randread | Rw::Randrw);
    let fd = if reads {
        layout(&setup, &args.file, args.size)?
    } else {
        block_on(setup.create(&args.file, libc::O_RDWR | libc::O_CREAT, 0o644))?.0
    };
    block_on(setup.close(fd))?;
    drop(setup);

    let mut jobs = Vec::new();
    TraceLog::global().drain();
    for j in 0..args.numjobs {
        let vol = Arc::new(job_volume(args, volfile)?);
        vol.set_trace_every(args.trace_every);
        let fd = block_on(vol.open(&args.file, libc::O_RDWR))?;
        jobs.push((vol, fd, slots(args, j)));
    }
    let cpu0 = self_cpu_seconds();
    let srv_cpu = || -> Option<f64> {
        let v: Option<Vec<f64>> = server_pids.iter().map(|p| proc_cpu_seconds(*p)).collect();
        v.filter(|v| !v.is_empty()).map(|v| v.iter().sum())
    };
    let srv0 = srv_cpu();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(args.runtime);
    let jobs: Vec<Arc<Job>> = jobs
        .into_iter()
        .enumerate()
        .map(|(j, (vol, fd, bufs))| {
            Arc::new(Job {
                vol,
                fd,
                rw: args.rw,
                bs: args.bs,
                blocks: args.size / args.bs,
                deadline,
                next_seq: AtomicU64::new(j as u64 * (args.size / args.bs) / args.numjobs as u64),
                rng: AtomicU64::new(
                    0x9e37_79b9_7f4a_7c15 ^ ((j as u64 + 1) * 0x1234_5678_9abc_def1),
                ),
                bufs,
                hist: Mutex::new(Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("bounds")),
                ios: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                inflight: AtomicUsize::new(args.iodepth),
                stop: AtomicBool::new(false),
                idle: (Mutex::new(()), Condvar::new()),
            })
        })
        .collect();
    for job in &jobs {
        for slot in 0..args.iodepth {
            job.issue(slot);
        }
    }
    let progress = args.runtime > 3.0;
    let tty = std::io::stderr().is_terminal();
    let mut last = (t0, 0u64);
    while Instant::now() < deadline && !jobs.iter().any(|j| j.stop.load(Ordering::Relaxed)) {
        std::thread::sleep(
            Duration::from_millis(200).min(deadline.saturating_duration_since(Instant::now())),
        );
        if progress && last.0.elapsed() >= Duration::from_secs(1) {
            let bytes: u64 = jobs.iter().map(|j| j.bytes.load(Ordering::Relaxed)).sum();
            let ios: u64 = jobs.iter().map(|j| j.ios.load(Ordering::Relaxed)).sum();
            let dt = last.0.elapsed().as_secs_f64();
            let line = format!(
                "[{:>4.0}s/{:.0}s] {:>9.1} MB/s {:>9.0} IOPS",
                t0.elapsed().as_secs_f64(),
                args.runtime,
                (bytes - last.1) as f64 / 1e6 / dt,
                ios as f64 / t0.elapsed().as_secs_f64(),
            );
            if tty {
                eprint!("\r{line}");
            } else {
                eprintln!("{line}");
            }
            last = (Instant::now(), bytes);
        }
    }
    for j in &jobs {
        j.wait_idle();
    }
    if progress && tty {
        eprintln!();
    }
    let runtime_s = t0.elapsed().as_secs_f64();
    let cpu_client_s = self_cpu_seconds() - cpu0;
    let cpu_server_s = match (srv0, srv_cpu()) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let mut lat_ns = Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    for j in &jobs {
        let _ = lat_ns.add(&*j.hist.lock().expect("hist lock"));
    }
    let frames_per_send = frames_per_send(&jobs[0].vol.clients()[0]);
    let result = BenchResult {
        bytes: jobs.iter().map(|j| j.bytes.load(Ordering::Relaxed)).sum(),
        ios: jobs.iter().map(|j| j.ios.load(Ordering::Relaxed)).sum(),
        errors: jobs.iter().map(|j| j.errors.load(Ordering::Relaxed)).sum(),
        bytes_copied: jobs
            .iter()
            .flat_map(|j| j.vol.clients())
            .map(|c| c.stats().bytes_copied.load(Ordering::Relaxed))
            .sum(),
        runtime_s,
        lat_ns,
        cpu_client_s,
        cpu_server_s,
        frames_per_send,
        waterfall: Waterfall::of(&TraceLog::global().drain()),
    };
    for j in &jobs {
        let _ = block_on(j.vol.close(j.fd.clone()));
    }
    if result.errors > 0 {
        return Err(std::io::Error::other(format!(
            "{} requests failed",
            result.errors
        )));
    }
    Ok(result)
}

/// `kiln bench`.
pub fn main(args: BenchArgs) -> Result<(), Error> {
    if let Some(t) = &args.tls {
        if args.transport != Transport::Tcp {
            return Err(Error::invalid("--tls needs --transport tcp"));
        }
        // Before any thread starts: every connection this process makes reads it.
        std::env::set_var(kiln_tls::ENV_DIR, t);
    }
    let (server, addr, pid) = match &args.connect {
        Some(_) if args.profile_points || args.bare || args.delay_read_us.is_some() => {
            return Err(Error::invalid(
                "--profile-points, --bare and --delay-read-us shape the server this command \
                 starts; they cannot be used with --connect",
            ))
        }
        Some(a) => (None, a.clone(), args.server_pid),
        None if args.replica > 1 => {
            if args.profile_points || args.bare || args.delay_read_us.is_some() {
                return Err(Error::invalid("--replica starts its own bricks with the replica stack; it cannot be combined with --profile-points, --bare or --delay-read-us"));
            }
            (None, String::new(), None)
        }
        None => {
            let s = ChildServer::start(
                args.brick.clone(),
                args.transport,
                args.tls.as_deref(),
                |d| args.server_volfile(d),
            )
            .context("cannot start a brick server")?;
            let (a, p) = (s.addr.clone(), s.pid());
            (Some(s), a, Some(p))
        }
    };
    let r = if args.replica > 1 && args.connect.is_none() {
        let mut bricks = Vec::new();
        for i in 0..args.replica {
            let name = format!("brick{i}");
            let dir = args.brick.as_ref().map(|b| b.join(&name));
            if let Some(d) = &dir {
                std::fs::create_dir_all(d)
                    .with_context(|| format!("cannot make brick directory {}", d.display()))?;
            }
            bricks.push(
                ChildServer::start(dir, args.transport, args.tls.as_deref(), |d| {
                    Some(kiln_server::replica_volfile(d, &name))
                })
                .with_context(|| format!("cannot start brick {i}"))?,
            );
        }
        let addrs: Vec<String> = bricks.iter().map(|b| b.addr.clone()).collect();
        let pids = bricks.iter().map(|b| b.pid()).collect();
        run_volfile(&args, &args.short_circuit(replica_volfile(&addrs)), pids)
            .with_context(|| format!("bench over replica {} failed", args.replica))?
    } else {
        run(&args, &addr, pid)
            .map_err(|e| match e.raw_os_error() {
                // Only a kilnd without a brick (its management port) answers a fop so.
                Some(libc::ENOSYS) => format!(
                    "bench against {addr} failed: it is a management port, not a brick (give \
                 --connect a brick's address: `kiln volume status VOL` lists their ports)"
                ),
                _ => format!("bench against {addr} failed: {e}"),
            })
            .map_err(Error::failed)?
    };
    drop(server);
    report(&args, &addr, &r);
    Ok(())
}

/// Prints what a run measured: the table, or one JSON object with `--json`.
fn report(args: &BenchArgs, addr: &str, r: &BenchResult) {
    let transport = if addr.starts_with("unix:") {
        "unix"
    } else {
        "tcp"
    };
    let cpu_total = r.cpu_client_s + r.cpu_server_s.unwrap_or(0.0);
    let mb_per_cpu = if cpu_total > 0.0 {
        r.bytes as f64 / 1e6 / cpu_total
    } else {
        0.0
    };
    let rw = format!("{:?}", args.rw).to_lowercase();
    if args.json {
        let v = serde_json::json!({
            "rw": rw, "bs": args.bs, "iodepth": args.iodepth, "numjobs": args.numjobs,
            "replica": args.replica,
            "size": args.size, "transport": transport,
            "bytes": r.bytes, "ios": r.ios, "runtime_s": r.runtime_s,
            "mb_s": r.mb_s(), "iops": r.iops(),
            "lat_us": {
                "mean": r.lat_ns.mean() / 1000.0, "p50": r.lat_us(0.5), "p99": r.lat_us(0.99),
                "p999": r.lat_us(0.999), "max": r.lat_ns.max() as f64 / 1000.0,
            },
            "cpu_s": { "client": r.cpu_client_s, "server": r.cpu_server_s },
            "mb_per_cpu_s": mb_per_cpu,
            "bytes_copied": r.bytes_copied,
            "frames_per_send": r.frames_per_send,
            "waterfall": r.waterfall.as_ref().map(|w| serde_json::json!({
                "samples": w.samples,
                "stages": w.stages,
                "sum_p50_us": w.sum_p50_ns() as f64 / 1e3,
                "end_to_end_p50_us": w.total_p50_ns as f64 / 1e3,
                "end_to_end_p99_us": w.total_p99_ns as f64 / 1e3,
            })),
        });
        crate::out::show(true, &v, |_| String::new());
    } else {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(
            o,
            "kiln bench: {rw} bs={} iodepth={} numjobs={} over {transport} for {:.1} s",
            args.bs, args.iodepth, args.numjobs, r.runtime_s
        );
        let _ = writeln!(
            o,
            "  throughput  {:>10.1} MB/s  {:>10.0} IOPS",
            r.mb_s(),
            r.iops()
        );
        let _ = writeln!(
            o,
            "  latency µs  p50 {:.1}  p99 {:.1}  p99.9 {:.1}  mean {:.1}",
            r.lat_us(0.5),
            r.lat_us(0.99),
            r.lat_us(0.999),
            r.lat_ns.mean() / 1000.0
        );
        let srv = r
            .cpu_server_s
            .map(|s| format!("{s:.2} s"))
            .unwrap_or_else(|| "unknown".into());
        let _ = writeln!(
            o,
            "  cpu         client {:.2} s  server {srv}  ({mb_per_cpu:.0} MB per CPU-second)",
            r.cpu_client_s
        );
        let _ = writeln!(
            o,
            "  data path   {} bytes copied in user space, {:.1} frames per sendmsg",
            r.bytes_copied, r.frames_per_send
        );
        if let Some(w) = &r.waterfall {
            let _ = writeln!(
                o,
                "\nwaterfall of traced requests (every {}th):",
                args.trace_every
            );
            let _ = write!(o, "{}", w.render());
            let sum = w.sum_p50_ns() as f64 / 1e3;
            let _ = writeln!(
                o,
                "measured by the bench: p50 {:.2} µs; stage medians sum to {:.1}% of it",
                r.lat_us(0.5),
                sum * 100.0 / r.lat_us(0.5)
            );
        }
    }
}
