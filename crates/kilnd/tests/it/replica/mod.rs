//! What the replica-3 tests share: brick processes with the replica stack, the client graph
//! over them, a seeded generator, bounded waits, and the check that no marks are left.
#![allow(dead_code)] // each test file uses some of these

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::faults::DelayGenConfig;
use kiln_layer::heal;
use kiln_layer::replicate::ReplicateConfig;
use kiln_layer::volfile::{LayerDef, LayerKind, ProtocolClientConfig, Volfile};
use kiln_layer::Ctx;
use kiln_proto::Op;
#[allow(unused_imports)] // each test binary uses some of it
pub use kiln_testkit::wait_for;

/// One brick: a kilnd process with the replica stack (marks) on its own directory.
pub struct Brick {
    pub dir: PathBuf,
    volfile: PathBuf,
    pub addr: String,
    pub child: Option<Child>,
    /// The network namespace it runs in (`None`: this process's).
    netns: Option<String>,
}

impl Brick {
    pub fn new(root: &Path, i: usize) -> Brick {
        Brick::slow(root, i, None)
    }

    /// A brick whose writes wait `delay` (µs, with probability `p`) before they reach the
    /// marks layer, as on a slow disk: with `Some`, the brick stack has a delay-gen on top.
    pub fn slow(root: &Path, i: usize, delay: Option<(u64, f64)>) -> Brick {
        Brick::delayed(root, i, &["write"], delay)
    }

    /// A brick whose `fops` wait `delay` (µs, with probability `p`) before they reach the
    /// marks layer: with `Some`, the brick stack has a delay-gen on top.
    pub fn delayed(root: &Path, i: usize, fops: &[&str], delay: Option<(u64, f64)>) -> Brick {
        let mut b = Brick::made(root, i, fops, delay);
        b.start();
        b
    }

    /// A brick in network namespace `ns`, listening on `ip` there.
    pub fn in_netns(root: &Path, i: usize, ns: &str, ip: &str) -> Brick {
        let mut b = Brick::made(root, i, &[], None);
        b.addr = format!("tcp:{ip}:0");
        b.netns = Some(ns.to_owned());
        b.start();
        b
    }

    /// [`Brick::delayed`], not started yet.
    fn made(root: &Path, i: usize, fops: &[&str], delay: Option<(u64, f64)>) -> Brick {
        let dir = root.join(format!("brick{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let volfile = root.join(format!("brick{i}.toml"));
        let mut v = kiln_server::replica_volfile(&dir, &format!("brick{i}"));
        if let Some((delay_us, probability)) = delay {
            v.layers.insert(
                1,
                LayerDef {
                    name: "slow-writes".into(),
                    subvolumes: Vec::new(),
                    kind: LayerKind::DelayGen(DelayGenConfig {
                        fops: fops.iter().map(|f| (*f).to_owned()).collect(),
                        delay_us,
                        probability,
                        seed: 7 + i as u64,
                    }),
                },
            );
        }
        std::fs::write(&volfile, v.to_toml()).unwrap();
        Brick {
            dir,
            volfile,
            addr: "tcp:127.0.0.1:0".into(),
            child: None,
            netns: None,
        }
    }

    /// Starts kilnd on the brick's address (the first time: any port, then the same one).
    pub fn start(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut child =
                kiln_testkit::net::command_in(self.netns.as_deref(), env!("CARGO_BIN_EXE_kilnd"))
                    .arg("--volfile")
                    .arg(&self.volfile)
                    .args(["--listen", &self.addr, "--metrics", "off"])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("spawn kilnd");
            let mut out = BufReader::new(child.stdout.take().expect("stdout"));
            let mut line = String::new();
            out.read_line(&mut line).expect("kilnd output");
            if let Some(a) = line.trim().strip_prefix("kilnd: listening on ") {
                self.addr = a.to_owned();
                // Keep reading its stdout so it never blocks on a full pipe.
                std::thread::spawn(move || for _ in out.lines() {});
                self.child = Some(child);
                return;
            }
            // The port may still be held by the killed process's socket for a moment.
            let _ = child.kill();
            let _ = child.wait();
            assert!(
                Instant::now() < deadline,
                "kilnd did not start on {}: {line:?}",
                self.addr
            );
            std::thread::yield_now();
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    pub fn file(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).unwrap_or_default()
    }
}

impl Drop for Brick {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn volfile(bricks: &[Brick]) -> Volfile {
    let addrs: Vec<String> = bricks.iter().map(|b| b.addr.clone()).collect();
    volfile_at(&addrs)
}

/// The replica-3 client graph over bricks at `addrs`.
pub fn volfile_at(addrs: &[String]) -> Volfile {
    let mut layers = vec![LayerDef {
        name: "rep".into(),
        subvolumes: (0..addrs.len()).map(|i| format!("client-{i}")).collect(),
        kind: LayerKind::Replicate(ReplicateConfig::default()),
    }];
    for (i, a) in addrs.iter().enumerate() {
        layers.push(LayerDef {
            name: format!("client-{i}"),
            subvolumes: Vec::new(),
            kind: LayerKind::ProtocolClient(ProtocolClientConfig::to(a)),
        });
    }
    Volfile { layers }
}

/// xorshift64*: the test's only source of randomness, from the seed.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

pub fn index_empty(vol: &Volume) -> bool {
    heal::replicate_layers(vol.top()).iter().all(|r| {
        r.children().iter().all(|k| {
            block_on(k.pending_index(&Ctx::NONE, "", &())).is_ok_and(|p| p.entries.0.is_empty())
        })
    })
}

/// Asserts that every block of every brick's files matches its checksum: after kill -9 of
/// bricks and clients mid-write, a block left mid-change is sealed as found, never reported
/// as damage (no false checksum errors).
pub fn sums_clean(bricks: &[Brick], seed: u64) {
    for (i, b) in bricks.iter().enumerate() {
        let c = kiln_server::posix::sums::check_tree(&b.dir).expect("check the brick's sums");
        assert!(c.files > 0, "seed {seed}: brick {i} has no files to check");
        assert!(
            c.damaged.is_empty(),
            "seed {seed}: brick {i} has blocks that do not match their sums: {:?}",
            &c.damaged[..c.damaged.len().min(10)]
        );
    }
}

/// Seeded runs per soak test in a CI run: each run is a new seed from the clock, so CI covers
/// new ground every time; `KILN_RUNS=N` soaks longer (`KILN_SEED=N` repeats one failure).
pub const CI_RUNS: u64 = 10;

/// The seeds of a seeded test's runs: `KILN_SEED=N` repeats one, `KILN_RUNS=N` sets how many
/// (default `runs`); otherwise from the clock (a failure prints its seed).
pub fn seeds(runs: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("KILN_SEED") {
        return vec![s.parse().expect("KILN_SEED is a number")];
    }
    let runs =
        std::env::var("KILN_RUNS").map_or(runs, |s| s.parse().expect("KILN_RUNS is a number"));
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    (0..runs)
        .map(|i| base.wrapping_add(i * 0x9e37_79b9))
        .collect()
}

/// [`volfile`] with io-stats `stats-N` above each protocol-client.
pub fn counted(bricks: &[Brick]) -> Volfile {
    let mut v = volfile(bricks);
    v.layers[0].subvolumes = (0..bricks.len()).map(|i| format!("stats-{i}")).collect();
    for i in 0..bricks.len() {
        v.layers.push(LayerDef {
            name: format!("stats-{i}"),
            subvolumes: vec![format!("client-{i}")],
            kind: LayerKind::IoStats {},
        });
    }
    v
}

/// Calls of `op` that io-stats `name` counted.
pub fn calls(name: &str, op: Op) -> u64 {
    let mut n = 0;
    for p in kiln_layer::iostats::points() {
        if p.name() == name {
            p.for_each_fop(|fop, c, _, _, _| {
                if fop == op.name().to_ascii_lowercase() {
                    n += c;
                }
            });
        }
    }
    n
}

/// Four writers of 4 KiB blocks at random offsets of `fd`'s first `size` bytes, each at queue
/// depth 1, until `stop`: `done` counts their writes; each returns its slowest write and the
/// errors it met.
pub fn writers(
    vol: &std::sync::Arc<Volume>,
    fd: &std::sync::Arc<kiln_layer::Fd>,
    size: u64,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    done: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Vec<std::thread::JoinHandle<(Duration, Vec<String>)>> {
    use std::sync::atomic::Ordering;
    (0..4u64)
        .map(|w| {
            let (vol, fd, stop, done) = (vol.clone(), fd.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9 ^ (w + 1));
                let (mut worst, mut errors) = (Duration::ZERO, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    let at = rng.next() % (size / 4096) * 4096;
                    let t = Instant::now();
                    let (r, _) = block_on(vol.pwritev(&fd, vec![vec![w as u8 + 1; 4096]], at));
                    worst = worst.max(t.elapsed());
                    match r {
                        Ok(_) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                (worst, errors)
            })
        })
        .collect()
}
