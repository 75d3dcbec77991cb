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
//! `volume status` and `/metrics` (`crate::rebalancing`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_layer::distribute::{self, Distribute, Misplaced, Progress};
use kiln_layer::exec::block_on;
use kiln_proto::sync::MutexExt as _;

use crate::def::{VolState, VolumeDef};
use crate::manager::Manager;
use crate::pool::{Cmd, Outcome};
use crate::rebalancing::{RebalanceView, Run, SetMoves, LARGE};
use crate::store::vol_key;
use kiln_proto::error::Context as _;
use kiln_proto::Error;

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
            // A run of this request is under way here. One that ended has recorded its end
            // first (so it is not asked for any more) unless it lost the leadership or could
            // not record: then it runs again.
            let busy = manager
                .runs
                .runs
                .locked()
                .get(&def.name)
                .is_some_and(|r| r.since == since && r.view.locked().state == "running");
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
    manager
        .runs
        .runs
        .locked()
        .insert(def.name.clone(), run.clone());
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
                    ("failed", Some(e.to_string()))
                }
            };
            // Recorded first: `status` says running until the store says how it ended. A
            // leader that lost its place leaves the record to the next one.
            if m.is_leader() && end.0 != "stopped" {
                record_end(&m, &def.name, run.since, end.0, end.1.clone());
            }
            {
                let mut v = run.view.locked();
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
        tracing::error!(volume = %volume, "cannot run the rebalance: {e}");
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
                tracing::warn!(volume = %name, "cannot record the rebalance's end: {e}");
                return;
            }
        }
    }
}

/// Scans, then moves (see the module documentation).
fn rebalance(m: &Manager, def: &VolumeDef, run: &Run) -> Result<(), Error> {
    let volfile = m.client_volfile_here(def)?;
    let key = m.service_key(&def.name);
    let vol = kiln_client::Volume::from_volfile_with_secret(&volfile, Some(key.as_bytes()))
        .with_context(|| format!("cannot reach the bricks of {}", def.name))?;
    let Some(layer) = distribute::find(vol.top()) else {
        return Ok(());
    };
    let d = layer
        .as_any()
        .and_then(|a| a.downcast_ref::<Distribute>())
        .ok_or(Error::failed("no distribute layer"))?;
    run.view.locked().sets = sets_of(def, d);
    let list = interleave(scan(d, run)?);
    {
        let mut v = run.view.locked();
        v.phase = "moving".into();
    }
    *run.moving.locked() = Some(Instant::now());
    for mv in &list {
        if run.progress.stop.load(Relaxed) || !m.is_leader() {
            run.progress.stop.store(true, Relaxed);
            break;
        }
        let t = Instant::now();
        let r = block_on(d.migrate(mv, &run.progress));
        {
            let took = t.elapsed().as_secs_f64();
            let mut p = run.pace.locked();
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
                let mut v = run.view.locked();
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
                run.view.locked().error.get_or_insert(msg);
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
fn scan(d: &Distribute, run: &Run) -> Result<Vec<Misplaced>, Error> {
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
                return Err(Error::failed(format!(
                    "cannot list /{dir}: {}",
                    std::io::Error::from_raw_os_error(e as i32)
                )))
            }
        };
        {
            let mut v = run.view.locked();
            let mut p = run.pace.locked();
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
    let sets = def.set_bricks();
    d.kid_names()
        .into_iter()
        .zip(def.live_sets())
        .map(|(set, k)| SetMoves {
            set,
            bricks: sets[k].iter().map(|&i| def.bricks[i].spec()).collect(),
            draining: def.draining.contains(&k),
            ..SetMoves::default()
        })
        .collect()
}

/// Names still on the draining sets of `def` (a fresh walk): what `remove-brick commit` waits
/// for.
pub(crate) fn left_on_draining(m: &Manager, def: &VolumeDef) -> Result<u64, Error> {
    let volfile = m.client_volfile_here(def)?;
    let key = m.service_key(&def.name);
    let vol = kiln_client::Volume::from_volfile_with_secret(&volfile, Some(key.as_bytes()))
        .with_context(|| format!("cannot reach the bricks of {}", def.name))?;
    let Some(layer) = distribute::find(vol.top()) else {
        return Ok(0);
    };
    let d = layer
        .as_any()
        .and_then(|a| a.downcast_ref::<Distribute>())
        .ok_or(Error::failed("no distribute layer"))?;
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
