//! `replace-brick`: a new, empty brick takes the place of one (dead, or to be retired) in a
//! replicated volume. The new brick carries no identity, so it starts as a *new* brick: it
//! takes every change at once but serves no read until the heal service has rebuilt it in
//! full from its replicas (`kiln_layer::heal`'s rebuild). On the same host it keeps the old
//! brick's port, so clients reconnect to it by themselves.

use std::fs;

use crate::def::{is_local, parse_brick, VolState};
use crate::manager::{Manager, Procs};
use crate::request::Request;
use crate::response::{BrickStopped, Changed, Response, VolumeView};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

impl Manager {
    pub(crate) fn replace_brick(
        &self,
        procs: &mut Procs,
        name: &str,
        old: &str,
        new: &str,
    ) -> Result<Response, Error> {
        let mut def = self.load(name)?;
        if def.replica < 2 {
            return Err(Error::invalid(format!(
                "volume {name} has no replicas: a brick's files exist only there, so a new \
                 brick could not be rebuilt from anywhere"
            )));
        }
        let ob = parse_brick(old)?;
        let oip = ob.ip()?;
        let i = def
            .bricks
            .iter()
            .position(|b| b.ip().ok() == Some(oip) && b.dir == ob.dir)
            .ok_or_else(|| Error::not_found(format!("volume {name} has no brick {old}")))?;
        // Checked like create's bricks, against every volume's (this one's old brick too: the
        // new directory may not nest in it).
        let (mut nb, nips) = self.check_bricks(&[new.to_owned()], false)?;
        let mut nb = nb.remove(0);
        let old_spec = def.bricks[i].spec();
        if nips[0] == oip {
            nb.port = def.bricks[i].port;
        }
        // Never adopts an identity: it is rebuilt before anyone reads from it.
        nb.settled = true;
        let started = def.state == VolState::Started;
        let mut warnings = Vec::new();
        if started {
            if let Err(e) = self.stop_any(procs, &def, i) {
                warnings.push(format!("old brick {old_spec} not stopped: {e}"));
            }
        }
        if !is_local(nips[0]) {
            self.check_member(nb.mgmt_addr()?)?;
        }
        if is_local(nips[0]) {
            fs::create_dir_all(&nb.dir)
                .with_context(|| format!("cannot create brick directory {}", nb.dir.display()))?;
        }
        def.bricks[i] = nb;
        self.save(&def)?;
        if started {
            let secret = self.read_secret(name)?;
            let r = if is_local(nips[0]) {
                self.ensure_brick(procs, &def, i)
            } else {
                self.remote_brick_start(&def, i, &secret)
            };
            match r {
                Ok(r) => r.record_in(&mut def.bricks[i]),
                Err(e) => warnings.push(format!(
                    "new brick {} did not start: {e} (`start {name} force` retries)",
                    def.bricks[i].spec()
                )),
            }
            self.save(&def)?;
        }
        tracing::info!(
            volume = %name, "brick {old_spec} replaced by {}; it is rebuilt from its replicas",
            def.bricks[i].spec()
        );
        Ok(Changed {
            volume: VolumeView::from(&def),
            warnings,
        }
        .into())
    }

    /// Stops brick `i` of `def`, here or on its host's kilnd.
    pub(crate) fn stop_any(
        &self,
        procs: &mut Procs,
        def: &crate::VolumeDef,
        i: usize,
    ) -> Result<(), Error> {
        let b = &def.bricks[i];
        if is_local(b.ip()?) {
            self.stop_brick(procs, def, i);
            return Ok(());
        }
        let req = Request::BrickStop {
            name: def.name.clone(),
            index: i,
        };
        self.call_peer::<BrickStopped>(b.mgmt_addr()?, &req)
            .map(|_| ())
    }
}
