//! The rebalance service: the pool's leader moves files to where the volume's layout wants
//! them, while I/O continues.
//!
//! A rebalance is asked for in the store (`rebalance VOL start`, or `remove-brick … start`,
//! which also marks the sets draining): the volume definition's `rebalance` says `running`.
//! Every half second the leader looks for such volumes and runs each in a thread of its own,
//! over a client stack of its own built from the definition:
//!
//! 1. **scan**: every directory, on every replica set at once
//!    (`kiln_layer::distribute::Distribute::misplaced`): the names not on their hashed set,
//!    with their sizes — the totals the report's ETA rests on;
//! 2. **move**: each in turn (`Distribute::migrate`: open files keep working, see there), paced
//!    to the run's rate (`rebalance start --rate MIB`, MiB/s; 0: none).
//!
//! It ends `completed` (or `stopped` by `rebalance stop`, or `failed`), recorded in the
//! store. A leader that changes leaves the run to the next one, which scans again (names
//! already moved are where they belong and are not counted again). What a run did — bytes and
//! files in all and moved, per replica set, rate and ETA — is in `rebalance status`,
//! `volume status` and `/metrics` ([`Runs::render`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_layer::distribute::{self, Distribute, Misplaced, Progress};
use kiln_layer::exec::block_on;
use serde::{Deserialize, Serialize};

use crate::def::{VolState, VolumeDef};
use crate::manager::Manager;
use crate::pool::{Cmd, Outcome};
use crate::store::vol_key;

/// Names at least this big count as large in the ETA: their time goes by their bytes; a small
/// name's time by the name (lookups, create, session, rename, removal dwarf its bytes).
const LARGE: u64 = 1 << 20;
/// Until the run has moved one of each, the guesses: seconds per small name, bytes per second.
const GUESS_SMALL_S: f64 = 0.005;
const GUESS_LARGE_BPS: f64 = 500e6;

/// One replica set's part in a run.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct SetMoves {
    /// The set (its graph layer's name).
    pub set: String,
    /// Its bricks.
    pub bricks: Vec<String>,
    /// Being removed: takes no new files.
    pub draining: bool,
    /// Files found on it that belong elsewhere, and their bytes.
    pub files_out: u64,
    /// Their bytes.
    pub bytes_out: u64,
    /// Of those, moved off so far.
    pub moved_out: u64,
    /// Their bytes.
    pub moved_out_bytes: u64,
    /// Files moved onto it.
    pub moved_in: u64,
    /// Their bytes.
    pub moved_in_bytes: u64,
}

/// A rebalance as `rebalance status` shows it.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct RebalanceView {
    /// The volume.
    pub volume: String,
    /// `not started`, `running`, `stopped`, `completed` or `failed`.
    pub state: String,
    /// While running: `scanning` or `moving`.
    pub phase: String,
    /// When it was asked for (seconds since the epoch).
    pub since: u64,
    /// Names found misplaced (so far, while scanning).
    pub files_total: u64,
    /// Their bytes.
    pub bytes_total: u64,
    /// Names moved.
    pub files_moved: u64,
    /// Bytes copied (holes of sparse files included; ranges clients changed meanwhile count
    /// again).
    pub bytes_moved: u64,
    /// Names left where they are on purpose (hard links, two copies).
    pub skipped: u64,
    /// Names that could not be moved.
    pub failed: u64,
    /// Seconds since the run began.
    pub elapsed_s: f64,
    /// Bytes per second copied since moving began.
    pub rate_bps: f64,
    /// Seconds left, estimated from the rate so far (while moving).
    pub eta_s: Option<f64>,
    /// The pace asked for, bytes per second (0: none).
    pub rate_limit_bps: u64,
    /// Per replica set.
    pub sets: Vec<SetMoves>,
    /// The first error met.
    pub error: Option<String>,
}

/// What the ETA rests on: names and bytes found and done, small and large apart, and the time
/// their moves took.
#[derive(Default, Clone, Copy)]
struct Pace {
    small: u64,
    small_done: u64,
    small_s: f64,
    large_bytes: u64,
    large_done_bytes: u64,
    large_s: f64,
}

impl Pace {
    /// Seconds left: small names by the time one took so far, large ones by the byte rate.
    fn eta(&self) -> f64 {
        let per_small = match self.small_done {
            0 => GUESS_SMALL_S,
            n => self.small_s / n as f64,
        };
        let bps = match self.large_done_bytes {
            0 => GUESS_LARGE_BPS,
            b => b as f64 / self.large_s.max(1e-6),
        };
        let small_left = self.small.saturating_sub(self.small_done) as f64;
        let large_left = self.large_bytes.saturating_sub(self.large_done_bytes) as f64;
        small_left * per_small + large_left / bps
    }
}

/// One run in progress (or just ended) on this kilnd.
struct Run {
    since: u64,
    progress: Progress,
    started: Instant,
    view: Mutex<RebalanceView>,
    moving: Mutex<Option<Instant>>,
    pace: Mutex<Pace>,
}

/// The runs of this kilnd, by volume.
#[derive(Default)]
pub struct Runs {
    runs: Mutex<HashMap<String, Arc<Run>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Run {
    /// The view now: counters, rate and ETA.
    fn view(&self) -> RebalanceView {
        let mut v = lock(&self.view).clone();
        let p = &self.progress;
        v.bytes_moved = p.bytes.load(Relaxed);
        v.files_moved = p.files.load(Relaxed);
        v.skipped = p.skipped.load(Relaxed);
        v.failed = p.failed.load(Relaxed);
        v.rate_limit_bps = p.rate.load(Relaxed);
        v.elapsed_s = self.started.elapsed().as_secs_f64();
        if let Some(t) = *lock(&self.moving) {
            let secs = t.elapsed().as_secs_f64();
            if secs > 0.0 {
                v.rate_bps = v.bytes_moved as f64 / secs;
            }
            if v.state == "running" {
                v.eta_s = Some(lock(&self.pace).eta());
            }
        }
        v
    }
}

impl Runs {
    /// The run of `volume` on this kilnd, if any.
    pub fn view(&self, volume: &str) -> Option<RebalanceView> {
        lock(&self.runs).get(volume).map(|r| r.view())
    }

    /// Tells `volume`'s run (if this kilnd has one) to stop after the file it is moving.
    pub fn stop(&self, volume: &str) {
        if let Some(r) = lock(&self.runs).get(volume) {
            r.progress.stop.store(true, Relaxed);
        }
    }

    /// Every run's counters in Prometheus text.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let mut views: Vec<RebalanceView> = lock(&self.runs).values().map(|r| r.view()).collect();
        if views.is_empty() {
            return;
        }
        views.sort_by(|a, b| a.volume.cmp(&b.volume));
        type Field = (
            &'static str,
            &'static str,
            &'static str,
            fn(&RebalanceView) -> f64,
        );
        let fields: [Field; 6] = [
            (
                "kiln_rebalance_running",
                "gauge",
                "1 while a rebalance runs.",
                |v| f64::from(u8::from(v.state == "running")),
            ),
            (
                "kiln_rebalance_files",
                "gauge",
                "Names found misplaced.",
                |v| v.files_total as f64,
            ),
            (
                "kiln_rebalance_files_moved",
                "counter",
                "Names moved.",
                |v| v.files_moved as f64,
            ),
            (
                "kiln_rebalance_bytes",
                "gauge",
                "Bytes of the names found misplaced.",
                |v| v.bytes_total as f64,
            ),
            (
                "kiln_rebalance_bytes_moved",
                "counter",
                "Bytes copied.",
                |v| v.bytes_moved as f64,
            ),
            (
                "kiln_rebalance_eta_seconds",
                "gauge",
                "Seconds left, estimated.",
                |v| v.eta_s.unwrap_or(0.0),
            ),
        ];
        for (name, kind, help, get) in fields {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for v in &views {
                let _ = writeln!(out, "{name}{{volume=\"{}\"}} {}", v.volume, get(v));
            }
        }
        let _ = writeln!(
            out,
            "# HELP kiln_rebalance_brick_bytes_moved Bytes moved off (out) and onto (in) each \
             brick's replica set.\n# TYPE kiln_rebalance_brick_bytes_moved counter"
        );
        for v in &views {
            for s in &v.sets {
                for b in &s.bricks {
                    for (dir, n) in [("out", s.moved_out_bytes), ("in", s.moved_in_bytes)] {
                        let _ = writeln!(
                            out,
                            "kiln_rebalance_brick_bytes_moved{{volume=\"{}\",brick=\"{b}\",\
                             direction=\"{dir}\"}} {n}",
                            v.volume
                        );
                    }
                }
            }
        }
    }
}

/// Starts the service thread (see the module documentation).
pub fn start(manager: Arc<Manager>) {
    let run = move || loop {
        // A timer, not synchronisation: the service looks at the store twice a second.
        std::thread::sleep(Duration::from_millis(500));
        if !manager.is_leader() {
            continue;
        }
        for def in manager.load_all() {
            if def.state != VolState::Started || !def.rebalancing() {
                continue;
            }
            let since = def.rebalance.as_ref().map_or(0, |r| r.since);
            // One run per request on this kilnd, however it ended.
            let busy = lock(&manager.runs.runs)
                .get(&def.name)
                .is_some_and(|r| r.since == since);
            if !busy {
                launch(&manager, def);
            }
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kilnd-rebalance".into())
        .spawn(run)
    {
        tracing::error!("cannot start the rebalance service: {e}");
    }
}

/// Runs `def`'s rebalance in a thread of its own.
fn launch(manager: &Arc<Manager>, def: VolumeDef) {
    let Some(asked) = def.rebalance.clone() else {
        return;
    };
    let run = Arc::new(Run {
        since: asked.since,
        progress: Progress::default(),
        started: Instant::now(),
        pace: Mutex::default(),
        view: Mutex::new(RebalanceView {
            volume: def.name.clone(),
            state: "running".into(),
            phase: "scanning".into(),
            since: asked.since,
            ..RebalanceView::default()
        }),
        moving: Mutex::new(None),
    });
    run.progress.rate.store(asked.rate, Relaxed);
    lock(&manager.runs.runs).insert(def.name.clone(), run.clone());
    let m = manager.clone();
    let volume = def.name.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("rebalance-{}", def.name))
        .spawn(move || {
            let end = match rebalance(&m, &def, &run) {
                Ok(()) if run.progress.stop.load(Relaxed) => ("stopped", None),
                Ok(()) => ("completed", None),
                Err(e) => {
                    tracing::error!(volume = %def.name, "rebalance failed: {e}");
                    ("failed", Some(e))
                }
            };
            // Recorded first: `status` says running until the store says how it ended. A
            // leader that lost its place leaves the record to the next one.
            if m.is_leader() && end.0 != "stopped" {
                record_end(&m, &def.name, run.since, end.0, end.1.clone());
            }
            {
                let mut v = lock(&run.view);
                v.state = end.0.into();
                v.phase = String::new();
                v.error = v.error.clone().or(end.1);
            }
            let v = run.view();
            tracing::info!(
                volume = %def.name,
                "rebalance {}: {} names moved ({} bytes) in {:.1} s, {} skipped, {} failed",
                end.0, v.files_moved, v.bytes_moved, v.elapsed_s, v.skipped, v.failed
            );
        });
    if let Err(e) = spawned {
        tracing::error!("cannot run the rebalance of {volume}: {e}");
    }
}

/// Writes the end of run `since` of `name` in the store (unless another run was asked since).
fn record_end(m: &Manager, name: &str, since: u64, state: &str, error: Option<String>) {
    for _ in 0..5 {
        let Ok((mut def, version)) = m.load_versioned(name) else {
            return;
        };
        match def.rebalance.as_mut() {
            Some(r) if r.since == since && r.state == "running" => {
                r.state = state.into();
                r.error = error.clone();
            }
            _ => return,
        }
        let cmd = Cmd::Put {
            key: vol_key(name),
            value: serde_json::to_value(&def).expect("a definition serialises"),
            expect: Some(version),
        };
        match m.pool().and_then(|p| p.write(cmd)) {
            Ok(w) if matches!(w.outcome, Outcome::Done { .. }) => {
                m.sync_files();
                return;
            }
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!("volume {name}: cannot record the rebalance's end: {e}");
                return;
            }
        }
    }
}

/// Scans, then moves (see the module documentation).
fn rebalance(m: &Manager, def: &VolumeDef, run: &Run) -> Result<(), String> {
    let volfile = m.client_volfile_here(def)?;
    let secret = m.read_secret(&def.name)?;
    let vol = kiln_client::Volume::from_volfile_with_secret(&volfile, Some(secret.as_bytes()))
        .map_err(|e| format!("cannot reach the bricks of {}: {e}", def.name))?;
    let Some(layer) = distribute::find(vol.top()) else {
        return Ok(());
    };
    let d = layer
        .as_any()
        .and_then(|a| a.downcast_ref::<Distribute>())
        .ok_or("no distribute layer")?;
    lock(&run.view).sets = sets_of(def, d);
    let list = interleave(scan(d, run)?);
    {
        let mut v = lock(&run.view);
        v.phase = "moving".into();
    }
    *lock(&run.moving) = Some(Instant::now());
    for mv in &list {
        if run.progress.stop.load(Relaxed) || !m.is_leader() {
            run.progress.stop.store(true, Relaxed);
            break;
        }
        let t = Instant::now();
        let r = block_on(d.migrate(mv, &run.progress));
        {
            let took = t.elapsed().as_secs_f64();
            let mut p = lock(&run.pace);
            if mv.size >= LARGE {
                p.large_done_bytes += mv.size;
                p.large_s += took;
            } else {
                p.small_done += 1;
                p.small_s += took;
            }
        }
        match r {
            Ok(true) => {
                run.progress.files.fetch_add(1, Relaxed);
                let mut v = lock(&run.view);
                if let Some(s) = v.sets.get_mut(mv.from) {
                    s.moved_out += 1;
                    s.moved_out_bytes += mv.size;
                }
                if let Some(s) = v.sets.get_mut(mv.to) {
                    s.moved_in += 1;
                    s.moved_in_bytes += mv.size;
                }
            }
            Ok(false) => {
                run.progress.skipped.fetch_add(1, Relaxed);
            }
            Err(e) if e == libc::ECANCELED as u32 => break,
            Err(e) => {
                run.progress.failed.fetch_add(1, Relaxed);
                let msg = format!(
                    "{}: {}",
                    mv.path,
                    std::io::Error::from_raw_os_error(e as i32)
                );
                tracing::warn!(volume = %def.name, "rebalance could not move {msg}");
                lock(&run.view).error.get_or_insert(msg);
            }
        }
    }
    Ok(())
}

/// Small and large names in turn, each kind spread evenly over the run: both rates the ETA
/// rests on are sampled from the start, and it holds all along.
fn interleave(list: Vec<Misplaced>) -> Vec<Misplaced> {
    let (large, small): (Vec<Misplaced>, Vec<Misplaced>) =
        list.into_iter().partition(|m| m.size >= LARGE);
    let (nl, ns) = (large.len().max(1) as f64, small.len().max(1) as f64);
    let mut keyed: Vec<(f64, Misplaced)> = large
        .into_iter()
        .enumerate()
        .map(|(i, m)| (i as f64 / nl, m))
        .chain(
            small
                .into_iter()
                .enumerate()
                .map(|(i, m)| (i as f64 / ns, m)),
        )
        .collect();
    keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
    keyed.into_iter().map(|(_, m)| m).collect()
}

/// Every directory, breadth first: the misplaced names, counted into the run's view as found.
fn scan(d: &Distribute, run: &Run) -> Result<Vec<Misplaced>, String> {
    let mut list = Vec::new();
    let mut dirs = std::collections::VecDeque::from([String::new()]);
    while let Some(dir) = dirs.pop_front() {
        if run.progress.stop.load(Relaxed) {
            break;
        }
        let (found, subdirs) = match block_on(d.misplaced(&dir)) {
            Ok(r) => r,
            // Removed meanwhile.
            Err(e) if e == libc::ENOENT as u32 => continue,
            Err(e) => {
                return Err(format!(
                    "cannot list /{dir}: {}",
                    std::io::Error::from_raw_os_error(e as i32)
                ))
            }
        };
        {
            let mut v = lock(&run.view);
            let mut p = lock(&run.pace);
            for f in &found {
                v.files_total += 1;
                v.bytes_total += f.size;
                if f.size >= LARGE {
                    p.large_bytes += f.size;
                } else {
                    p.small += 1;
                }
                if let Some(s) = v.sets.get_mut(f.from) {
                    s.files_out += 1;
                    s.bytes_out += f.size;
                }
            }
        }
        list.extend(found);
        dirs.extend(subdirs);
    }
    Ok(list)
}

/// The sets of the stack `d` with their bricks, in its order.
fn sets_of(def: &VolumeDef, d: &Distribute) -> Vec<SetMoves> {
    let r = def.replica.max(1);
    d.kid_names()
        .into_iter()
        .zip(def.live_sets())
        .map(|(set, k)| SetMoves {
            set,
            bricks: def.bricks[k * r..(k + 1) * r]
                .iter()
                .map(|b| b.spec())
                .collect(),
            draining: def.draining.contains(&k),
            ..SetMoves::default()
        })
        .collect()
}

/// Names still on the draining sets of `def` (a fresh walk): what `remove-brick commit` waits
/// for.
pub(crate) fn left_on_draining(m: &Manager, def: &VolumeDef) -> Result<u64, String> {
    let volfile = m.client_volfile_here(def)?;
    let secret = m.read_secret(&def.name)?;
    let vol = kiln_client::Volume::from_volfile_with_secret(&volfile, Some(secret.as_bytes()))
        .map_err(|e| format!("cannot reach the bricks of {}: {e}", def.name))?;
    let Some(layer) = distribute::find(vol.top()) else {
        return Ok(0);
    };
    let d = layer
        .as_any()
        .and_then(|a| a.downcast_ref::<Distribute>())
        .ok_or("no distribute layer")?;
    let draining: Vec<usize> = def
        .live_sets()
        .iter()
        .enumerate()
        .filter(|(_, k)| def.draining.contains(k))
        .map(|(i, _)| i)
        .collect();
    let run = Run {
        since: 0,
        progress: Progress::default(),
        started: Instant::now(),
        view: Mutex::default(),
        moving: Mutex::new(None),
        pace: Mutex::default(),
    };
    let list = scan(d, &run)?;
    Ok(list.iter().filter(|m| draining.contains(&m.from)).count() as u64)
}
