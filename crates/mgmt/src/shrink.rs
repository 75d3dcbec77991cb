//! `rebalance` and `remove-brick`: asking the leader's rebalance service for a run, and taking
//! replica sets out of a volume once their files have moved off.
//!
//! `remove-brick VOL BRICK... start` marks the sets those bricks make up *draining* — a new
//! graph, in which they take no new files — and asks for a rebalance, which moves everything
//! on them to the other sets. `status` shows the run; `stop` ends it and the draining (files
//! moved stay moved); `commit` walks the draining sets once more and, only when nothing is
//! left on them, stops their bricks and marks them removed (kept in the definition so every
//! other brick keeps its index, which is its identity; their directories keep the empty
//! directory tree).

use crate::def::{check_name, RebalanceDef, VolState, VolumeDef};
use crate::manager::{Manager, Procs};
use crate::pool::{Cmd, Outcome};
use crate::rebalancer::left_on_draining;
use crate::rebalancing::RebalanceView;
use crate::response::{BrickStopped, Response};
use crate::store::vol_key;
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// Default pace of a rebalance, MiB/s (`--rate` sets another; 0: none). On the 2-core
/// machine of bench/README.md a mount's 4 KiB QD1 read p99 under a rebalance was 1.23x idle
/// at 64 MiB/s (median of 3), 1.9x at 100, 8x at 200, and 15-66x unpaced (530 MiB/s).
pub const DEFAULT_RATE_MIB: u64 = 64;

impl Manager {
    /// `rebalance NAME start|stop|status`.
    pub(crate) fn rebalance_cmd(
        &self,
        name: &str,
        action: &str,
        rate_mib: Option<u64>,
    ) -> Result<Response, Error> {
        check_name(name)?;
        let (mut def, version) = self.load_versioned(name)?;
        match action {
            "status" => return Ok(self.rebalance_view(&def).into()),
            "start" => {
                if def.state != VolState::Started {
                    return Err(Error::conflict(format!("volume {name} is not started")));
                }
                if def.live_sets().len() < 2 {
                    return Err(Error::conflict(format!(
                        "volume {name} has one replica set: nothing to rebalance (add-brick first)"
                    )));
                }
                if def.rebalancing() {
                    return Err(Error::conflict(format!(
                        "volume {name}: a rebalance is running (`rebalance {name} status`)"
                    )));
                }
                def.rebalance = Some(asked(rate_mib));
            }
            "stop" => {
                match def.rebalance.as_mut() {
                    Some(r) if r.state == "running" => r.state = "stopped".into(),
                    _ => {
                        return Err(Error::conflict(format!(
                            "volume {name}: no rebalance is running"
                        )))
                    }
                }
                self.runs.stop(name);
            }
            _ => {
                return Err(Error::invalid(format!(
                    "rebalance {name}: {action:?} is not start, stop or status"
                )))
            }
        }
        self.put_def(&def, version)?;
        tracing::info!(volume = %name, "rebalance {action}");
        Ok(self.rebalance_view(&def).into())
    }

    /// `remove-brick NAME BRICK... start|status|stop|commit`.
    pub(crate) fn remove_brick(
        &self,
        procs: &mut Procs,
        name: &str,
        bricks: &[String],
        action: &str,
        rate_mib: Option<u64>,
    ) -> Result<Response, Error> {
        check_name(name)?;
        let (mut def, version) = self.load_versioned(name)?;
        let sets = sets_named(&def, bricks)?;
        match action {
            "status" => {}
            "start" => {
                if def.state != VolState::Started {
                    return Err(Error::conflict(format!("volume {name} is not started")));
                }
                let live = def.live_sets();
                if live
                    .iter()
                    .all(|k| sets.contains(k) || def.draining.contains(k))
                {
                    return Err(Error::conflict(format!(
                        "volume {name}: removing these bricks would leave no replica set"
                    )));
                }
                if def.rebalancing() {
                    return Err(Error::conflict(format!(
                        "volume {name}: a rebalance is running; stop it first"
                    )));
                }
                for k in sets.iter() {
                    if !def.draining.contains(k) {
                        def.draining.push(*k);
                    }
                }
                def.rebalance = Some(asked(rate_mib));
            }
            "stop" => {
                def.draining.retain(|k| !sets.contains(k));
                if let Some(r) = def.rebalance.as_mut().filter(|r| r.state == "running") {
                    r.state = "stopped".into();
                }
                self.runs.stop(name);
            }
            "commit" => return self.commit_removal(procs, def, version, &sets),
            _ => {
                return Err(Error::invalid(format!(
                    "remove-brick {name}: {action:?} is not start, status, stop or commit"
                )))
            }
        }
        if action != "status" {
            self.put_def(&def, version)?;
            tracing::info!(
                volume = %name, "remove-brick {action} ({} set(s))",
                sets.len()
            );
        }
        Ok(self.rebalance_view(&def).into())
    }

    /// `remove-brick … commit`: refused while files are left on the sets.
    fn commit_removal(
        &self,
        procs: &mut Procs,
        mut def: VolumeDef,
        version: u64,
        sets: &[usize],
    ) -> Result<Response, Error> {
        let name = def.name.clone();
        if let Some(k) = sets.iter().find(|k| !def.draining.contains(k)) {
            return Err(Error::conflict(format!(
                "volume {name}: replica set {k} is not draining: `remove-brick {name} BRICK... \
                 start` first"
            )));
        }
        if def.rebalancing() {
            return Err(Error::conflict(format!(
                "volume {name}: the rebalance is still running (`remove-brick {name} BRICK... \
                 status`)"
            )));
        }
        if def.state != VolState::Started {
            return Err(Error::conflict(format!(
                "volume {name} is not started: commit walks the sets to check that nothing is \
                 left on them; start it first"
            )));
        }
        {
            let only: VolumeDef = VolumeDef {
                draining: sets.to_vec(),
                ..def.clone()
            };
            let left = left_on_draining(self, &only)?;
            if left > 0 {
                return Err(Error::conflict(format!(
                    "volume {name}: {left} name(s) are still on the bricks to remove; run \
                     `remove-brick {name} BRICK... start` again (or `rebalance {name} status` \
                     to see why they did not move)"
                )));
            }
        }
        let members = def.set_bricks();
        for &k in sets {
            for &i in &members[k] {
                self.stop_anywhere(procs, &def, i)?;
                let b = &mut def.bricks[i];
                b.removed = true;
                b.pid = None;
            }
        }
        def.draining.retain(|k| !sets.contains(k));
        self.put_def(&def, version)?;
        tracing::info!(volume = %name, "{} replica set(s) removed", sets.len());
        Ok(self.rebalance_view(&def).into())
    }

    /// Stops brick `i` of `def`, here or on its host.
    fn stop_anywhere(&self, procs: &mut Procs, def: &VolumeDef, i: usize) -> Result<(), Error> {
        let b = &def.bricks[i];
        if b.ip().is_ok_and(crate::def::is_local) {
            self.stop_brick(procs, def, i);
            return Ok(());
        }
        let req = crate::request::Request::BrickStop {
            name: def.name.clone(),
            index: i,
        };
        self.call_peer::<BrickStopped>(b.mgmt_addr()?, &req)
            .map(|_| ())
            .with_context(|| format!("brick {}", b.spec()))
    }

    /// Records `def` if the volume is still at `version`.
    fn put_def(&self, def: &VolumeDef, version: u64) -> Result<(), Error> {
        let cmd = Cmd::Put {
            key: vol_key(&def.name),
            value: serde_json::to_value(def).expect("a definition serialises"),
            expect: Some(version),
        };
        match self.pool()?.write(cmd)?.outcome {
            Outcome::Done { .. } => {
                self.sync_files();
                Ok(())
            }
            Outcome::Conflict { have } => Err(Error::conflict(format!(
                "volume {}: it changed meanwhile (now at version {have}); try again",
                def.name
            ))),
        }
    }

    /// The rebalance of `def` as this kilnd knows it: its run, else the store's record.
    pub(crate) fn rebalance_view(&self, def: &VolumeDef) -> RebalanceView {
        let asked = def.rebalance.as_ref();
        let mut v = match self.runs.view(&def.name) {
            Some(v) if asked.is_some_and(|a| a.since == v.since) => v,
            _ => RebalanceView {
                volume: def.name.clone(),
                state: asked.map_or("not started".into(), |a| a.state.clone()),
                since: asked.map_or(0, |a| a.since),
                error: asked.and_then(|a| a.error.clone()),
                ..RebalanceView::default()
            },
        };
        // The store says what was asked last (a stop takes effect after the file in hand).
        if let Some(a) = asked.filter(|a| a.since == v.since && a.state != "running") {
            if v.state == "running" {
                v.state = a.state.clone();
            }
        }
        v
    }
}

/// A new run's record.
fn asked(rate_mib: Option<u64>) -> RebalanceDef {
    RebalanceDef {
        since: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        state: "running".into(),
        rate: rate_mib.unwrap_or(DEFAULT_RATE_MIB) << 20,
        error: None,
    }
}

/// The replica sets `bricks` make up, whole: an error names a brick that is not in the
/// volume, or a set given in part.
fn sets_named(def: &VolumeDef, bricks: &[String]) -> Result<Vec<usize>, Error> {
    let name = &def.name;
    if bricks.is_empty() {
        return Err(Error::invalid(format!(
            "remove-brick {name}: name the bricks to remove"
        )));
    }
    let named = |b: &crate::def::BrickDef| {
        bricks
            .iter()
            .any(|s| b.spec() == *s || format!("{}:{}", b.host, b.dir.display()) == *s)
    };
    let all = def.set_bricks();
    let mut sets = Vec::new();
    for s in bricks {
        let k = all
            .iter()
            .position(|set| {
                set.iter().any(|&i| {
                    let b = &def.bricks[i];
                    !b.removed
                        && (b.spec() == *s || format!("{}:{}", b.host, b.dir.display()) == *s)
                })
            })
            .ok_or_else(|| {
                Error::not_found(format!(
                    "volume {name} has no brick {s} (see `volume info {name}`)"
                ))
            })?;
        if !sets.contains(&k) {
            sets.push(k);
        }
    }
    for &k in &sets {
        if !all[k].iter().all(|&i| named(&def.bricks[i])) {
            return Err(Error::invalid(format!(
                "volume {name}: remove whole replica sets (set {k} is {})",
                all[k]
                    .iter()
                    .map(|&i| def.bricks[i].spec())
                    .collect::<Vec<_>>()
                    .join(" ")
            )));
        }
    }
    Ok(sets)
}
