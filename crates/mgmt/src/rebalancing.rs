//! What the rebalance service (`crate::rebalancer`) knows of each run, shared with
//! `rebalance status`, `volume status` and `/metrics`: counters, per-set moves, and the ETA.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kiln_layer::distribute::Progress;
use kiln_proto::sync::MutexExt as _;
use serde::{Deserialize, Serialize};

/// Names at least this big count as large in the ETA: their time goes by their bytes; a small
/// name's time by the name (lookups, create, session, rename, removal dwarf its bytes).
pub(crate) const LARGE: u64 = 1 << 20;
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
pub(crate) struct Pace {
    pub(crate) small: u64,
    pub(crate) small_done: u64,
    pub(crate) small_s: f64,
    pub(crate) large_bytes: u64,
    pub(crate) large_done_bytes: u64,
    pub(crate) large_s: f64,
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
pub(crate) struct Run {
    pub(crate) since: u64,
    pub(crate) progress: Progress,
    pub(crate) started: Instant,
    pub(crate) view: Mutex<RebalanceView>,
    pub(crate) moving: Mutex<Option<Instant>>,
    pub(crate) pace: Mutex<Pace>,
}

/// The runs of this kilnd, by volume.
#[derive(Default)]
pub struct Runs {
    pub(crate) runs: Mutex<HashMap<String, Arc<Run>>>,
}

impl Run {
    /// The view now: counters, rate and ETA.
    pub(crate) fn view(&self) -> RebalanceView {
        let mut v = self.view.locked().clone();
        let p = &self.progress;
        v.bytes_moved = p.bytes.load(Relaxed);
        v.files_moved = p.files.load(Relaxed);
        v.skipped = p.skipped.load(Relaxed);
        v.failed = p.failed.load(Relaxed);
        v.rate_limit_bps = p.rate.load(Relaxed);
        v.elapsed_s = self.started.elapsed().as_secs_f64();
        if let Some(t) = *self.moving.locked() {
            let secs = t.elapsed().as_secs_f64();
            if secs > 0.0 {
                v.rate_bps = v.bytes_moved as f64 / secs;
            }
            if v.state == "running" {
                v.eta_s = Some(self.pace.locked().eta());
            }
        }
        v
    }
}

impl Runs {
    /// The run of `volume` on this kilnd, if any.
    pub fn view(&self, volume: &str) -> Option<RebalanceView> {
        self.runs.locked().get(volume).map(|r| r.view())
    }

    /// Tells `volume`'s run (if this kilnd has one) to stop after the file it is moving.
    pub fn stop(&self, volume: &str) {
        if let Some(r) = self.runs.locked().get(volume) {
            r.progress.stop.store(true, Relaxed);
        }
    }

    /// Every run's counters for `/metrics`.
    pub fn render(&self, out: &mut kiln_layer::metrics::Scrape) {
        // Declared with no samples before a first run, so dashboards find every name.
        let mut views: Vec<RebalanceView> = self.runs.locked().values().map(|r| r.view()).collect();
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
            if kind == "counter" {
                let f = out.counter(name, help);
                for v in &views {
                    f.count(&[("volume", &v.volume)], get(v) as u64);
                }
            } else {
                let f = out.gauge(name, help);
                for v in &views {
                    f.set(&[("volume", &v.volume)], get(v));
                }
            }
        }
        let f = out.counter(
            "kiln_rebalance_brick_bytes_moved",
            "Bytes moved off (out) and onto (in) each brick's replica set.",
        );
        for v in &views {
            for s in &v.sets {
                for b in &s.bricks {
                    for (dir, n) in [("out", s.moved_out_bytes), ("in", s.moved_in_bytes)] {
                        f.count(
                            &[("volume", &v.volume), ("brick", b), ("direction", dir)],
                            n,
                        );
                    }
                }
            }
        }
    }
}
