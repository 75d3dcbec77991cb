//! What the heal service knows about each volume it heals, shared with `status`.

use std::collections::HashMap;
use std::sync::Mutex;

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
}

/// The service's state, shared with `status`.
#[derive(Default)]
pub struct Healer {
    vols: Mutex<HashMap<String, VolHeal>>,
}

impl Healer {
    /// The service's view of `volume`, if it heals it.
    pub fn view(&self, volume: &str) -> Option<VolHeal> {
        self.vols
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(volume)
            .cloned()
    }

    pub(crate) fn update(&self, volume: &str, f: impl FnOnce(&mut VolHeal)) {
        let mut v = self.vols.lock().unwrap_or_else(|e| e.into_inner());
        f(v.entry(volume.to_owned()).or_default());
    }
}
