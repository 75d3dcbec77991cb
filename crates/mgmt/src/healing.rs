//! What the heal service knows about each volume it heals, shared with `status`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_layer::heal::Board;
use kiln_proto::sync::MutexExt as _;

use serde::{Deserialize, Serialize};

/// What the heal service knows about one volume.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolHeal {
    /// Files behind on a replica, at the end of the last round (including ones whose replica
    /// is down and cannot be healed yet).
    pub backlog: u64,
    /// Files brought up to date since kilnd started.
    pub healed_files: u64,
    /// Bytes copied to replicas that were behind since kilnd started.
    pub healed_bytes: u64,
    /// Rounds that found work.
    pub rounds: u64,
    /// When the last round ended (seconds since the epoch).
    pub last_round: u64,
    /// The last round's first error, if it had one.
    pub last_error: Option<String>,
    /// Full rebuilds of new bricks: under way, or finished in the last round.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rebuilds: Vec<kiln_layer::heal::Rebuild>,
}

/// The service's state, shared with `status`.
#[derive(Default)]
pub struct Healer {
    vols: Mutex<HashMap<String, VolHeal>>,
    /// Each volume's rebuild progress, updated while a round runs.
    boards: Mutex<HashMap<String, Arc<Board>>>,
}

impl Healer {
    /// The service's view of `volume`, if it heals it.
    pub fn view(&self, volume: &str) -> Option<VolHeal> {
        let mut v = self.vols.locked().get(volume).cloned()?;
        v.rebuilds = self.board(volume).snapshot();
        Some(v)
    }

    /// Every volume's view, for `/metrics`.
    pub fn views(&self) -> Vec<(String, VolHeal)> {
        let names: Vec<String> = self.vols.locked().keys().cloned().collect();
        let mut out: Vec<(String, VolHeal)> = names
            .into_iter()
            .filter_map(|n| self.view(&n).map(|v| (n, v)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The rebuild progress of `volume`'s heal rounds.
    pub(crate) fn board(&self, volume: &str) -> Arc<Board> {
        let mut b = self.boards.locked();
        b.entry(volume.to_owned()).or_default().clone()
    }

    pub(crate) fn update(&self, volume: &str, f: impl FnOnce(&mut VolHeal)) {
        let mut v = self.vols.locked();
        f(v.entry(volume.to_owned()).or_default());
    }
}

impl Healer {
    /// The heal service's gauges and counters for `/metrics`: backlog and bytes healed per
    /// volume, and each full rebuild's progress (names and bytes in all and done, rate,
    /// seconds left).
    pub fn render(&self, out: &mut kiln_layer::metrics::Scrape) {
        // Every family is declared even before the first heal round, so dashboards and
        // alerts find the names on any kilnd.
        let views = self.views();
        let f = out.gauge(
            "kiln_heal_backlog_files",
            "Files behind on a replica after the last heal round.",
        );
        for (vol, v) in &views {
            f.set(&[("volume", vol)], v.backlog as f64);
        }
        let f = out.counter(
            "kiln_heal_bytes",
            "Bytes the heal service copied to replicas behind.",
        );
        for (vol, v) in &views {
            f.count(&[("volume", vol)], v.healed_bytes);
        }
        type Gauge = (
            &'static str,
            &'static str,
            fn(&kiln_layer::heal::Rebuild) -> f64,
        );
        let gauges: [Gauge; 6] = [
            (
                "kiln_rebuild_files",
                "Names on the member a new brick is rebuilt from.",
                |r| r.files_total as f64,
            ),
            (
                "kiln_rebuild_files_done",
                "Names the new brick holds.",
                |r| r.files_done as f64,
            ),
            (
                "kiln_rebuild_bytes",
                "File bytes on the member it is rebuilt from.",
                |r| r.bytes_total as f64,
            ),
            (
                "kiln_rebuild_bytes_done",
                "File bytes the new brick holds.",
                |r| r.bytes_done as f64,
            ),
            (
                "kiln_rebuild_rate_bytes",
                "Bytes copied per second by the rebuild.",
                |r| r.rate,
            ),
            (
                "kiln_rebuild_eta_seconds",
                "Seconds the rebuild needs at that rate.",
                |r| r.eta.map_or(f64::NAN, |e| e as f64),
            ),
        ];
        for (name, help, get) in gauges {
            let f = out.gauge(name, help);
            for (vol, v) in &views {
                for r in &v.rebuilds {
                    f.set(&[("volume", vol), ("brick", &r.target_name)], get(r));
                }
            }
        }
    }
}
