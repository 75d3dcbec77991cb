//! Brick processes the pool's store does not account for, stopped.
//!
//! `start` runs a volume's bricks first and then records the volume as started; a leader that
//! dies in between (or a store write that fails) leaves bricks running for a volume the store
//! still holds as created — or, after a `delete` that lost its kilnd, for none. Every kilnd
//! looks at the brick processes of its own state directory every few seconds and stops those
//! of a volume that is not started (or not there), and a second process of a brick whose
//! recorded process runs. A brick younger than [`GRACE`] is left alone: a start on its way
//! records it within that time.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bricks::signal;
use crate::def::VolState;
use crate::manager::{Manager, Procs};
use kiln_proto::sync::MutexExt as _;

/// How old a brick process must be before it can be an orphan: a start spawns its bricks and
/// records them in the pool's store well within this. `KILN_ORPHAN_GRACE_MS` changes it (tests).
pub const GRACE: Duration = Duration::from_secs(20);

/// [`GRACE`], or `KILN_ORPHAN_GRACE_MS`.
fn grace() -> Duration {
    std::env::var("KILN_ORPHAN_GRACE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(GRACE, Duration::from_millis)
}

/// A brick process of this state directory, from `/proc`.
#[derive(Debug, PartialEq)]
struct BrickProc {
    pid: u32,
    volume: String,
    index: usize,
    age: Duration,
}

impl Manager {
    /// Stops the orphan bricks of this state directory older than `grace`; returns how many.
    pub fn reap_orphans(&self, grace: Duration) -> usize {
        let Ok(pool) = self.pool() else { return 0 };
        // Not while this member is cut off from the pool: its copy may be behind.
        if pool.leader().is_none() {
            return 0;
        }
        let defs = self.load_all();
        let mut procs = self.procs.locked();
        let mut n = 0;
        for p in brick_procs(&self.state) {
            if p.age < grace {
                continue;
            }
            let def = defs.iter().find(|d| d.name == p.volume);
            let why = match def {
                None => "the pool has no such volume",
                Some(d) if d.state != VolState::Started => "the volume is not started",
                Some(d) => match d.bricks.get(p.index).map(|b| b.pid) {
                    None => "the volume has no such brick",
                    // Not recorded: a start that could not record it; left for `start
                    // force` to adopt or replace.
                    Some(None) => continue,
                    Some(Some(rec))
                        if rec != p.pid
                            && self.pid_runs_brick(
                                &mut procs,
                                rec,
                                &self.brick_volfile_path(&d.name, p.index),
                            ) =>
                    {
                        "the brick runs as another process"
                    }
                    Some(_) => continue,
                },
            };
            tracing::warn!(
                volume = %p.volume,
                "brick {} runs as pid {} but {why}: stopping it",
                p.index,
                p.pid
            );
            stop_pid(&mut procs, p.pid);
            n += 1;
        }
        n
    }
}

/// Starts the thread that reaps orphans: every 5 s, or a quarter of the grace if shorter.
pub fn start(manager: Arc<Manager>) {
    let grace = grace();
    let every = (grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let run = move || loop {
        // A timer, not synchronisation: orphans are looked for once per interval.
        std::thread::sleep(every);
        manager.reap_orphans(grace);
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kilnd-orphans".into())
        .spawn(run)
    {
        tracing::error!("cannot start the orphan reaper: {e}");
    }
}

/// SIGTERM, then SIGKILL if it has not gone after a grace period; our child is waited for.
fn stop_pid(procs: &mut Procs, pid: u32) {
    signal(pid, rustix::process::Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut child = procs.children.remove(&pid);
    loop {
        let gone = match &mut child {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => !alive(pid),
        };
        if gone {
            return;
        }
        if Instant::now() > deadline {
            signal(pid, rustix::process::Signal::KILL);
            if let Some(c) = &mut child {
                let _ = c.wait();
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// True while `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| !r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Sends `sig` to the live bricks of `volume` run from `state` (SIGHUP: read the identities
/// file again).
pub(crate) fn signal_bricks(state: &Path, volume: &str, sig: rustix::process::Signal) {
    for p in brick_procs(state)
        .into_iter()
        .filter(|p| p.volume == volume)
    {
        if let Some(pid) = rustix::process::Pid::from_raw(p.pid as i32) {
            if let Err(e) = rustix::process::kill_process(pid, sig) {
                tracing::warn!(volume, pid = p.pid, "cannot signal brick: {e}");
            }
        }
    }
}

/// The live processes whose command line names a brick volfile of `state`
/// (`STATE/vols/NAME/bricks/N.toml`).
fn brick_procs(state: &Path) -> Vec<BrickProc> {
    let prefix = state.join("vols");
    let prefix = prefix.as_os_str().as_encoded_bytes();
    let boot_ticks = uptime_ticks();
    let mut out = Vec::new();
    let entries = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    for e in entries {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let Some((volume, index)) = cmdline
            .split(|b| *b == 0)
            .find_map(|a| a.strip_prefix(prefix).and_then(parse_brick_volfile))
        else {
            continue;
        };
        let Some(started) = start_ticks(pid) else {
            continue;
        };
        if !alive(pid) {
            continue;
        }
        let age = Duration::from_secs_f64(boot_ticks.saturating_sub(started) as f64 / hz());
        out.push(BrickProc {
            pid,
            volume,
            index,
            age,
        });
    }
    out
}

/// `/NAME/bricks/N.toml` → (NAME, N).
fn parse_brick_volfile(rest: &[u8]) -> Option<(String, usize)> {
    let rest = std::str::from_utf8(rest).ok()?;
    let mut parts = rest.strip_prefix('/')?.split('/');
    let (name, bricks, file) = (parts.next()?, parts.next()?, parts.next()?);
    if bricks != "bricks" || parts.next().is_some() {
        return None;
    }
    let index = file.strip_suffix(".toml")?.parse().ok()?;
    Some((name.to_owned(), index))
}

/// Clock ticks per second.
fn hz() -> f64 {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Ticks since boot now.
fn uptime_ticks() -> u64 {
    let s = std::fs::read_to_string("/proc/uptime").unwrap_or_default();
    let secs: f64 = s
        .split_whitespace()
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or(0.0);
    (secs * hz()) as u64
}

/// When `pid` started, in ticks since boot (`/proc/PID/stat` field 22).
fn start_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(')')?;
    // Fields after the command: state is field 3, so starttime (22) is the 20th here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brick_volfile_paths() {
        assert_eq!(
            parse_brick_volfile(b"/vol-1/bricks/2.toml"),
            Some(("vol-1".into(), 2))
        );
        for bad in [
            &b"/vol/bricks/x.toml"[..],
            b"/vol/other/2.toml",
            b"/vol/bricks/2.toml/x",
            b"vol/bricks/2.toml",
        ] {
            assert_eq!(parse_brick_volfile(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn this_process_has_an_age() {
        let pid = std::process::id();
        let started = start_ticks(pid).expect("our own start time");
        // The two clocks round differently: a tick or two of slack.
        assert!(
            started <= uptime_ticks() + 2,
            "{started} > {}",
            uptime_ticks()
        );
        assert!(started > 0);
    }
}
