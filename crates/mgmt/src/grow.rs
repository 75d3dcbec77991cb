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

use std::fs;

use crate::def::{check_name, is_local, VolState};
use crate::manager::{Manager, Procs};
use crate::pool::{Cmd, Outcome};
use crate::response::{Changed, Response, VolumeView};
use crate::store::vol_key;

impl Manager {
    pub(crate) fn add_brick(
        &self,
        procs: &mut Procs,
        name: &str,
        replica: Option<u64>,
        specs: &[String],
    ) -> Result<Response, String> {
        check_name(name)?;
        let (def, version) = self.load_versioned(name)?;
        let r = def.replica.max(1);
        match replica.map(|n| n as usize) {
            Some(n) if n > r => {
                return Err(format!(
                    "volume {name}: raising the replica count ({r} → {n}) is not supported yet; \
                     add whole replica sets of {r}"
                ))
            }
            Some(n) if n < r => {
                return Err(format!(
                    "volume {name}: a replica count below {r} means fewer copies: remove \
                     bricks with remove-brick instead"
                ))
            }
            _ => {}
        }
        if specs.is_empty() || !specs.len().is_multiple_of(r) {
            return Err(format!(
                "volume {name}: {} brick(s) do not make replica sets of {r}: add a multiple of \
                 {r} bricks",
                specs.len()
            ));
        }
        let (bricks, ips) = self.check_bricks(specs)?;
        for (b, ip) in bricks.iter().zip(&ips) {
            if is_local(*ip) {
                fs::create_dir_all(&b.dir).map_err(|e| {
                    format!("cannot create brick directory {}: {e}", b.dir.display())
                })?;
            }
        }
        let first_new = def.bricks.len();
        let mut grown = def.clone();
        grown.bricks.extend(bricks);
        // Every other host with a new brick is in the pool and makes its directory now.
        let new_hosts = self.peers(&crate::VolumeDef {
            bricks: grown.bricks[first_new..].to_vec(),
            ..grown.clone()
        });
        for addr in new_hosts {
            self.check_member(addr)
                .and_then(|_| self.sync_to(addr, &grown))
                .map_err(|e| format!("volume {name}: no bricks added: {e}"))?;
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
                return Err(format!(
                    "volume {name}: no bricks added: it changed meanwhile (now at version \
                     {have}); try again"
                ))
            }
        }
        tracing::info!(
            "volume {name}: {} brick(s) added ({} replica set(s) now)",
            grown.bricks.len() - first_new,
            grown.bricks.len() / r
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
    ) -> Result<(), String> {
        let secret = self.read_secret(&def.name)?;
        let mut ran = Vec::new();
        for i in first..def.bricks.len() {
            let r = match def.bricks[i].ip() {
                Ok(ip) if is_local(ip) => self.ensure_brick(procs, def, i),
                Ok(_) => self.remote_brick_start(def, i, &secret),
                Err(e) => Err(e),
            };
            match r {
                Ok((port, pid)) => {
                    def.bricks[i].ran(port, pid);
                    ran.push(i);
                }
                Err(e) => {
                    for &j in &ran {
                        if let Err(e) = self.stop_any(procs, def, j) {
                            tracing::warn!("volume {}: new brick {j} not stopped: {e}", def.name);
                        }
                    }
                    return Err(format!(
                        "volume {}: no bricks added: brick {} did not start: {e}",
                        def.name,
                        def.bricks[i].spec()
                    ));
                }
            }
        }
        Ok(())
    }
}
