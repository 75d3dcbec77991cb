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
        wait_for(secs, "a fio run to finish", || {
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
