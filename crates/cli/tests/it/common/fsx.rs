//! A file-system exerciser in the manner of fsx, of our own (Debian ships no fsx): random
//! writes, reads, truncates, hole punches, fsyncs and reopens of one file through a mount, in a
//! thread, every read and size checked against a model of what the file must hold.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Largest the file grows.
const MAX: u64 = 1 << 20;
/// Longest write or read.
const MAX_OP: u64 = 64 << 10;

pub struct Fsx {
    done: Arc<AtomicU64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<Result<u64, Failed>>,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn open(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

impl Fsx {
    /// Runs operations on `path` (made empty first), seeded with `seed`, until told to
    /// [`Fsx::finish`] and at least `ops` are done.
    pub fn start(path: &Path, ops: u64, seed: u64) -> Fsx {
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d, st) = (done.clone(), stop.clone());
        let path: PathBuf = path.to_owned();
        let handle = std::thread::spawn(move || run(&path, ops, seed, &d, &st));
        Fsx { done, stop, handle }
    }

    /// Operations done so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    /// Stops it once the least number of operations is done: all of them, or the first
    /// mismatch or error.
    pub fn finish(self) -> Result<u64, Failed> {
        self.stop.store(true, Ordering::Release);
        self.handle.join().expect("the fsx thread")
    }
}

/// The operation where the exerciser stopped, and what went wrong (a mismatch with its
/// model, or an error); with the seed, `Fsx::start` repeats the run up to it.
#[derive(Debug)]
pub struct Failed {
    pub op: u64,
    pub seed: u64,
    pub what: String,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fsx op {} (seed {}): {}", self.op, self.seed, self.what)
    }
}

fn run(
    path: &Path,
    ops: u64,
    seed: u64,
    done: &AtomicU64,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<u64, Failed> {
    let mut rng = Rng(seed | 1);
    let mut model: Vec<u8> = Vec::new();
    let mut f = open(path);
    f.set_len(0).map_err(|e| Failed {
        op: 0,
        seed,
        what: format!("truncate at start: {e}"),
    })?;
    let mut punch = true;
    for n in 0.. {
        if n >= ops && stop.load(Ordering::Acquire) {
            return Ok(n);
        }
        let fail = |what: String| Err(Failed { op: n, seed, what });
        match rng.below(100) {
            0..=29 => {
                let off = rng.below(MAX - 1);
                let len = 1 + rng.below(MAX_OP.min(MAX - off));
                let byte = (n % 251) as u8 + 1;
                let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                if let Err(e) = f.write_all_at(&data, off) {
                    return fail(format!("write {len} at {off}: {e}"));
                }
                let end = (off + len) as usize;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
            }
            30..=59 => {
                let size = model.len() as u64;
                let off = rng.below(size + 1);
                let len = rng.below(MAX_OP + 1);
                let mut buf = vec![0u8; len as usize];
                let got = match read_full(&f, &mut buf, off) {
                    Ok(g) => g,
                    Err(e) => return fail(format!("read {len} at {off}: {e}")),
                };
                let want_end = (off + len).min(size) as usize;
                let want = &model[(off as usize).min(want_end)..want_end];
                if &buf[..got] != want {
                    let at = buf[..got]
                        .iter()
                        .zip(want)
                        .position(|(a, b)| a != b)
                        .unwrap_or(got.min(want.len()));
                    return fail(format!(
                        "read {len} at {off}: {got} bytes, want {}; first difference at {}",
                        want.len(),
                        off + at as u64
                    ));
                }
            }
            60..=69 => {
                let size = rng.below(MAX);
                if let Err(e) = f.set_len(size) {
                    return fail(format!("truncate to {size}: {e}"));
                }
                model.resize(size as usize, 0);
            }
            70..=74 if punch && !model.is_empty() => {
                let off = rng.below(model.len() as u64);
                let len = 1 + rng.below(MAX_OP);
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                // SAFETY: fallocate(2) on an open descriptor; no memory is passed.
                let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as i64, len as i64) };
                if r != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                        punch = false;
                        continue;
                    }
                    return fail(format!("punch {len} at {off}: {e}"));
                }
                let end = ((off + len) as usize).min(model.len());
                model[off as usize..end].fill(0);
            }
            75..=79 => {
                if let Err(e) = f.sync_data() {
                    return fail(format!("fdatasync: {e}"));
                }
            }
            80..=84 => f = open(path),
            _ => match f.metadata() {
                Ok(m) if m.len() == model.len() as u64 => {}
                Ok(m) => return fail(format!("size {}, want {}", m.len(), model.len())),
                Err(e) => return fail(format!("fstat: {e}")),
            },
        }
        done.store(n + 1, Ordering::Release);
    }
    unreachable!("the loop returns")
}

/// Reads until `buf` is full or the file ends.
fn read_full(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], off + got as u64)? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}
