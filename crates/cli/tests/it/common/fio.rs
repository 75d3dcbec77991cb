//! fio in a loop against a mount or an NBD export, for tests that disturb a volume under I/O.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;

use super::wait_for;

/// fio runs one after another until `stop`: each writes `size` at random 4 KiB blocks, then
/// reads every block back and verifies it. Counts finished runs; returns the failures.
pub struct FioLoop {
    runs: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Vec<String>>,
}

impl FioLoop {
    pub fn start(name: &str, target: Vec<String>, dir: &Path) -> FioLoop {
        let runs = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s, dir, name) = (runs.clone(), stop.clone(), dir.to_owned(), name.to_owned());
        let handle = std::thread::spawn(move || {
            let mut failures = Vec::new();
            while !s.load(Ordering::Acquire) {
                let out = Command::new("fio")
                    .current_dir(&dir)
                    .args([
                        &format!("--name={name}"),
                        "--rw=randwrite",
                        "--bs=4k",
                        "--size=2m",
                        "--iodepth=8",
                        "--verify=crc32c",
                        "--verify_fatal=1",
                        "--do_verify=1",
                        "--output-format=json",
                    ])
                    .args(&target)
                    .output()
                    .expect("run fio");
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let errors = text
                    .find('{')
                    .and_then(|i| serde_json::from_str::<Value>(&text[i..]).ok())
                    .map(|j| {
                        j["jobs"]
                            .as_array()
                            .map(|a| a.iter().map(|x| x["error"].as_u64().unwrap_or(1)).sum())
                            .unwrap_or(1)
                    })
                    .unwrap_or(1u64);
                if !out.status.success() || errors != 0 {
                    failures.push(format!(
                        "{name}: exit {:?}, errors {errors}\n{}\n{}",
                        out.status.code(),
                        String::from_utf8_lossy(&out.stderr),
                        text
                    ));
                }
                r.fetch_add(1, Ordering::AcqRel);
            }
            failures
        });
        FioLoop { runs, stop, handle }
    }

    /// The loop on `fio.img` in the mount at `mnt` (O_DIRECT, libaio), fio working in `work`.
    pub fn on_mount(mnt: &Path, work: &Path) -> FioLoop {
        std::fs::create_dir_all(work).unwrap();
        let file = format!("--filename={}", mnt.join("fio.img").display());
        let args = vec![file, "--direct=1".into(), "--ioengine=libaio".into()];
        FioLoop::start("mount", args, work)
    }

    /// The loop on the NBD export at `uri`, fio working in `work`.
    pub fn on_nbd(uri: &str, work: &Path) -> FioLoop {
        std::fs::create_dir_all(work).unwrap();
        let args = vec!["--ioengine=nbd".into(), format!("--uri={uri}")];
        FioLoop::start("nbd", args, work)
    }

    /// Waits until a run that was in progress (or starts) now has finished.
    pub fn one_more(&self, secs: u64) {
        let seen = self.runs.load(Ordering::Acquire);
        wait_for("a fio run to finish", secs, || {
            self.runs.load(Ordering::Acquire) >= seen + 2
        });
    }

    pub fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Release);
        let failures = self.handle.join().expect("fio loop");
        (self.runs.load(Ordering::Acquire), failures)
    }
}

pub fn need_fio() {
    if Command::new("fio").arg("--version").output().is_err() {
        panic!("fio is needed (apt-get install fio; scripts/test.sh installs it)");
    }
}

/// What one timed fio run saw.
pub struct Timed {
    /// fio's error count (None: no JSON came).
    pub errors: Option<u64>,
    /// The slowest write, submission to completion.
    pub max_write: std::time::Duration,
    /// The slowest read of the verify pass.
    pub max_read: std::time::Duration,
    /// Writes completed.
    pub writes: u64,
    /// fio's output, for a failure's message.
    pub text: String,
}

/// fio randwrite 4k QD8 (O_DIRECT, libaio) with crc32c verify on `NAME.0.0` in `dir` for
/// `runtime`: every 64 blocks written are read back and verified as the writes go (a
/// time-based run never reaches a verify pass of its own at the end).
pub fn randwrite_verify(dir: &Path, name: &str, runtime: std::time::Duration) -> Timed {
    let out = Command::new("fio")
        .current_dir(dir)
        .args([
            &format!("--name={name}"),
            "--rw=randwrite",
            "--bs=4k",
            "--size=16m",
            "--iodepth=8",
            "--ioengine=libaio",
            "--direct=1",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            "--verify_backlog=64",
            "--time_based",
            &format!("--runtime={}", runtime.as_secs()),
            "--output-format=json",
        ])
        .output()
        .expect("run fio");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let j: Value = text
        .find('{')
        .and_then(|i| serde_json::from_str(&text[i..]).ok())
        .unwrap_or_default();
    let job = &j["jobs"][0];
    let errors = job["error"].as_u64().filter(|_| out.status.success());
    let max = |dir: &str| {
        std::time::Duration::from_nanos(job[dir]["lat_ns"]["max"].as_u64().unwrap_or(u64::MAX))
    };
    Timed {
        errors,
        max_write: max("write"),
        max_read: max("read"),
        writes: job["write"]["total_ios"].as_u64().unwrap_or(0),
        text: format!("{text}\n{}", String::from_utf8_lossy(&out.stderr)),
    }
}

/// A writer beside the load that times every one of its own writes and reads by the clock, so
/// that an I/O stuck for the whole of an outage counts even if fio never reports it: 4 KiB
/// O_DIRECT writes to `probe-NAME` in a directory, each read back and compared, one at a time.
pub struct Probe {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<ProbeSeen>,
}

/// What a [`Probe`] saw.
#[derive(Debug)]
pub struct ProbeSeen {
    /// The slowest write or read.
    pub slowest: std::time::Duration,
    /// Writes (each with its read) done.
    pub rounds: u64,
    /// The first error or wrong read, if any.
    pub failure: Option<String>,
}

impl Probe {
    pub fn start(dir: &Path, name: &str) -> Probe {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let stop = Arc::new(AtomicBool::new(false));
        let path = dir.join(format!("probe-{name}"));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .expect("open the probe file");
            let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
            // SAFETY: a non-zero size; freed below with the same layout.
            let (w, r) = unsafe { (std::alloc::alloc(layout), std::alloc::alloc(layout)) };
            assert!(!w.is_null() && !r.is_null());
            // SAFETY: both blocks are 4096 bytes, allocated above, and only used here.
            let (wb, rb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(w, 4096),
                    std::slice::from_raw_parts_mut(r, 4096),
                )
            };
            let mut seen = ProbeSeen {
                slowest: std::time::Duration::ZERO,
                rounds: 0,
                failure: None,
            };
            while !s.load(Ordering::Acquire) && seen.failure.is_none() {
                let n = seen.rounds;
                wb.fill((n % 251) as u8);
                let at = (n % 256) * 4096;
                let t = std::time::Instant::now();
                let wrote = f.write_all_at(wb, at);
                seen.slowest = seen.slowest.max(t.elapsed());
                let t = std::time::Instant::now();
                let read = f.read_exact_at(rb, at);
                seen.slowest = seen.slowest.max(t.elapsed());
                seen.failure = match (wrote, read) {
                    (Err(e), _) | (_, Err(e)) => Some(format!("round {n}: {e}")),
                    _ if wb != rb => Some(format!("round {n}: read back other bytes")),
                    _ => None,
                };
                seen.rounds += 1;
            }
            // SAFETY: allocated above with this layout; the slices are not used after.
            unsafe {
                std::alloc::dealloc(w, layout);
                std::alloc::dealloc(r, layout);
            }
            seen
        });
        Probe { stop, handle }
    }

    /// Stops the probe after the I/O it has under way; what it saw.
    pub fn stop(self) -> ProbeSeen {
        self.stop.store(true, Ordering::Release);
        self.handle.join().unwrap()
    }
}
