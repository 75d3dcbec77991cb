//! `add-brick`: whole replica sets appended to a volume, online.
//!
//! The new bricks start empty and take their identity as members at once (nothing needs
//! rebuilding: no file is theirs yet). In a started volume they run before the definition that
//! names them is recorded — one change to the pool's store, made only if nothing else changed
//! the volume meanwhile — so a leader lost half way leaves the volume as it was (and the bricks
//! it ran are stopped as orphans by their hosts). The recorded definition is a new graph:
//! running clients switch to it within a second, and from then on new files land on the new
//! sets too (the distribute layout is the graph's). Files already there stay where they are,
//! found by the lookup fallback, until `rebalance VOL start` moves them (`crate::rebalancer`).
//!
//! `add-brick VOL replica N BRICK...` with N above the volume's count raises it instead: each
//! replica set takes N - R new bricks (given set by set), which start as new bricks and are
//! rebuilt in full from the set's old ones by the heal service ([`widened`]); the sets' members
//! are then listed in the definition (`sets`), since they are no longer consecutive.

use std::fs;

use crate::def::{check_name, is_local, VolState, VolumeDef};
use crate::manager::{Manager, Procs};
use crate::pool::{Cmd, Outcome};
use crate::response::{Changed, Response, VolumeView};
use crate::store::vol_key;
use kiln_proto::error::Context as _;
use kiln_proto::Error;

impl Manager {
    pub(crate) fn add_brick(
        &self,
        procs: &mut Procs,
        name: &str,
        replica: Option<u64>,
        specs: &[String],
    ) -> Result<Response, Error> {
        check_name(name)?;
        let (def, version) = self.load_versioned(name)?;
        let r = def.replica.max(1);
        let widen = match replica.map(|n| n as usize) {
            Some(n) if n < r => {
                return Err(Error::invalid(format!(
                    "volume {name}: a replica count below {r} means fewer copies: remove \
                     bricks with remove-brick instead"
                )))
            }
            Some(n) if n > r => Some(n),
            _ => None,
        };
        match widen {
            Some(n) => check_widen(&def, n, specs.len())?,
            None if specs.is_empty() || !specs.len().is_multiple_of(r) => {
                return Err(Error::invalid(format!(
                    "volume {name}: {} brick(s) do not make replica sets of {r}: add a \
                     multiple of {r} bricks (or raise the count: `replica N`)",
                    specs.len()
                )))
            }
            None => {}
        }
        let (bricks, ips) = self.check_bricks(specs, false)?;
        for (b, ip) in bricks.iter().zip(&ips) {
            if is_local(*ip) {
                fs::create_dir_all(&b.dir).map_err(|e| {
                    Error::io(
                        format_args!("cannot create brick directory {}", b.dir.display()),
                        &e,
                    )
                })?;
            }
        }
        let first_new = def.bricks.len();
        let mut grown = def.clone();
        grown.bricks.extend(bricks);
        match widen {
            Some(n) => widened(&def, &mut grown, n),
            // Sets listed (a count raised before): the new ones are listed too.
            None if !def.sets.is_empty() => {
                let new: Vec<usize> = (first_new..grown.bricks.len()).collect();
                grown.sets.extend(new.chunks(r).map(<[usize]>::to_vec));
            }
            None => {}
        }
        // Every other host with a new brick is in the pool and makes its directory now.
        let new_hosts = self.peers(&crate::VolumeDef {
            bricks: grown.bricks[first_new..].to_vec(),
            ..grown.clone()
        });
        for addr in new_hosts {
            self.check_member(addr)
                .and_then(|_| self.sync_to(addr, &grown))
                .with_context(|| format!("volume {name}: no bricks added"))?;
        }
        if def.state == VolState::Started {
            self.run_new_bricks(procs, &mut grown, first_new)?;
        }
        let cmd = Cmd::Put {
            key: vol_key(name),
            value: serde_json::to_value(&grown).expect("a definition serialises"),
            expect: Some(version),
        };
        match self.pool()?.write(cmd)?.outcome {
            Outcome::Done { .. } => self.sync_files(),
            Outcome::Conflict { have } => {
                return Err(Error::conflict(format!(
                    "volume {name}: no bricks added: it changed meanwhile (now at version \
                     {have}); try again"
                )))
            }
        }
        tracing::info!(
            volume = %name, "{} brick(s) added ({} replica set(s) now)",
            grown.bricks.len() - first_new,
            grown.live_sets().len()
        );
        Ok(Changed {
            volume: VolumeView::from(&grown),
            warnings: Vec::new(),
        }
        .into())
    }

    /// Runs bricks `first..` of `def` on their hosts and notes where; a brick that does not
    /// start fails the command, and those started are stopped (the volume stays as it was).
    fn run_new_bricks(
        &self,
        procs: &mut Procs,
        def: &mut crate::VolumeDef,
        first: usize,
    ) -> Result<(), Error> {
        let secret = self.read_secret(&def.name)?;
        let mut ran = Vec::new();
        for i in first..def.bricks.len() {
            let r = match def.bricks[i].ip() {
                Ok(ip) if is_local(ip) => self.ensure_brick(procs, def, i),
                Ok(_) => self.remote_brick_start(def, i, &secret),
                Err(e) => Err(e),
            };
            match r {
                Ok(r) => {
                    r.record_in(&mut def.bricks[i]);
                    ran.push(i);
                }
                Err(e) => {
                    for &j in &ran {
                        if let Err(e) = self.stop_any(procs, def, j) {
                            tracing::warn!(volume = %def.name, "new brick {j} not stopped: {e}");
                        }
                    }
                    return Err(e.context(format_args!(
                        "volume {}: no bricks added: brick {} did not start",
                        def.name,
                        def.bricks[i].spec()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Whether `n` new bricks can raise `def`'s replica count to `n`: as many for each set, in
/// set order, while nothing else reshapes the volume.
fn check_widen(def: &VolumeDef, n: usize, given: usize) -> Result<(), Error> {
    let (name, r) = (&def.name, def.replica.max(1));
    let sets = def.live_sets().len();
    if n > 32 {
        return Err(Error::invalid(format!(
            "volume {name}: at most 32 replicas"
        )));
    }
    if def.widening.is_some() {
        return Err(Error::conflict(format!(
            "volume {name}: its new replicas are still being rebuilt (`volume status {name}`)"
        )));
    }
    if def.rebalancing() || !def.draining.is_empty() {
        return Err(Error::conflict(format!(
            "volume {name}: a rebalance or remove-brick is under way; let it end first"
        )));
    }
    if given != sets * (n - r) {
        return Err(Error::invalid(format!(
            "volume {name}: replica {r} → {n} takes {} new brick(s) for each of its {sets} \
             replica set(s) ({} in all, set by set), not {given}",
            n - r,
            sets * (n - r)
        )));
    }
    Ok(())
}

/// Raises `grown`'s replica count to `n` (its new bricks appended to `old`'s): each live set
/// takes the next `n - r` of them. They start as new bricks — joining, rebuilt in full by the
/// heal service before anything is read from them — and until every one is a member a change
/// needs a majority of the old count (`widening`: the old bricks are the only members).
fn widened(old: &VolumeDef, grown: &mut VolumeDef, n: usize) {
    let add = n - old.replica.max(1);
    let first_new = old.bricks.len();
    let mut sets = old.set_bricks();
    for (j, k) in old.live_sets().into_iter().enumerate() {
        sets[k].extend((0..add).map(|m| first_new + j * add + m));
    }
    for b in &mut grown.bricks[first_new..] {
        // Not adopted at its first start: new to the volume until rebuilt.
        b.settled = true;
    }
    grown.sets = sets;
    grown.replica = n;
    grown.widening = Some(old.replica.max(1));
}

impl Manager {
    /// The heal service found every brick of `name` a member: a change needs a majority of
    /// each set again (a new graph).
    pub(crate) fn widening_done(&self, name: &str) {
        let Ok((mut def, version)) = self.load_versioned(name) else {
            return;
        };
        if def.widening.is_none() {
            return;
        }
        def.widening = None;
        let cmd = Cmd::Put {
            key: vol_key(name),
            value: serde_json::to_value(&def).expect("a definition serialises"),
            expect: Some(version),
        };
        match self.pool().and_then(|p| p.write(cmd)) {
            Ok(w) if matches!(w.outcome, Outcome::Done { .. }) => {
                self.sync_files();
                tracing::info!(
                    volume = %name, "every new replica is rebuilt; changes need a majority again"
                );
            }
            // Changed meanwhile, or no majority: the next round tries again.
            Ok(_) => {}
            Err(e) => tracing::warn!(volume = %name, "cannot record the rebuilt replicas: {e}"),
        }
    }
}
