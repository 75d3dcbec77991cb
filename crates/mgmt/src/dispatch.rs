//! Answering MGMT requests: authentication by command, decoding into [`Request`], forwarding
//! a change of a volume to the pool's leader, and running the rest.

use std::net::SocketAddr;

use kiln_proto::sync::MutexExt as _;
use kiln_server::control::{refusal, Caller, MgmtHandler};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::def::check_name;
use crate::manager::Manager;
use crate::peers::call_peer;
use crate::request::{Request, OPEN_COMMANDS};
use crate::response::{Changed, Deleted, Envelope, RebalanceView, Response};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

impl Manager {
    /// [`call_peer`] with this kilnd's secret.
    pub(crate) fn call_peer<R: DeserializeOwned>(
        &self,
        addr: SocketAddr,
        req: &Request,
    ) -> Result<R, Error> {
        call_peer(addr, &self.secret, self.tls.get(), req)
    }

    /// Answers one request from `caller`: only [`OPEN_COMMANDS`] without authentication.
    pub fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        let out = match serde_json::from_slice::<Value>(req) {
            Ok(v) if v.is_object() => {
                // Authentication is checked on the command's name before anything else of the
                // request is looked at.
                let cmd = v["cmd"].as_str().unwrap_or_default();
                if cmd == "volfile" && !caller.authenticated {
                    let name = v["name"].as_str().unwrap_or_default();
                    if !self.may_fetch(caller, name) {
                        tracing::info!(peer = %caller.peer, identity = caller.identity, "mgmt: refused the graph of {name:?}");
                        return Envelope::encode(Err(Error::not_found(format!(
                            "volume {name}: no such volume, or this client may not use it (a \
                             client proves the key of an identity allowed on it: \
                             --secret-file)"
                        ))));
                    }
                }
                if !caller.authenticated && !OPEN_COMMANDS.contains(&cmd) {
                    tracing::warn!(
                        peer = %caller.peer,
                        "mgmt: refused {cmd:?} from {}: not authenticated (no management \
                         secret proved)",
                        caller.peer
                    );
                    let what = if cmd.is_empty() {
                        "this request".to_owned()
                    } else {
                        format!("`{cmd}`")
                    };
                    return refusal(&what).into_bytes();
                }
                match serde_json::from_value::<Request>(v) {
                    Ok(r) => self.dispatch(r),
                    Err(e) => Err(Error::invalid(format!("bad request: {e}"))),
                }
            }
            Ok(_) => Err(Error::invalid("bad request: not a JSON object")),
            Err(e) => Err(Error::invalid(format!("bad request: {e}"))),
        };
        if let Err(e) = &out {
            tracing::info!("mgmt: {e}");
        }
        Envelope::encode(out)
    }

    /// True when `caller` proved the key of an identity that may use `volume` (the volume's
    /// own secret is its identity `vol.NAME` here).
    fn may_fetch(&self, caller: &Caller, volume: &str) -> bool {
        !caller.identity.is_empty()
            && self
                .ids
                .get(&caller.identity)
                .is_some_and(|i| i.caps.has_volume(volume))
    }

    /// Runs one request of an authenticated caller (or an open command).
    fn dispatch(&self, req: Request) -> Result<Response, Error> {
        tracing::debug!(cmd = req.cmd(), "mgmt request");
        if let Some(r) = self.pool_dispatch(&req) {
            return r;
        }
        // A change is made on the pool's leader — forwarded without holding our lock, since
        // the leader may call back (brick-start) to this kilnd.
        if let Some(name) = req.forwarded_volume() {
            check_name(name)?;
            let pool = self.pool()?;
            let fwd = match req {
                Request::Delete { .. } => pool.forward::<Deleted>(&req).map(|r| r.map(Into::into)),
                Request::Rebalance { .. } | Request::RemoveBrick { .. } => pool
                    .forward::<RebalanceView>(&req)
                    .map(|r| r.map(Into::into)),
                _ => pool.forward::<Changed>(&req).map(|r| r.map(Into::into)),
            };
            if let Some(r) = fwd.with_context(|| format!("volume {name}"))? {
                return Ok(r);
            }
        }
        let mut procs = self.procs.locked();
        let procs = &mut procs;
        match req {
            Request::Create {
                name,
                replica,
                bricks,
                allow,
                shard,
                force,
            } => self.create(&name, replica, &bricks, &allow, shard, force),
            Request::Start { name, force } => self.start(procs, &name, force),
            Request::Stop { name } => self.stop(procs, &name),
            Request::Set { name, options } => self.set(procs, &name, &options),
            Request::AddBrick {
                name,
                replica,
                bricks,
            } => self.add_brick(procs, &name, replica, &bricks),
            Request::ReplaceBrick { name, old, new } => {
                self.replace_brick(procs, &name, &old, &new)
            }
            Request::Rebalance {
                name,
                action,
                rate_mib,
            } => self.rebalance_cmd(&name, &action, rate_mib),
            Request::RemoveBrick {
                name,
                bricks,
                action,
                rate_mib,
            } => self.remove_brick(procs, &name, &bricks, &action, rate_mib),
            Request::Delete { name } => self.delete(&name),
            Request::Auth { op, name, caps } => self.auth(op, name.as_deref(), caps),
            Request::Info { name } => self.info(name.as_deref()),
            Request::List => self.list(),
            Request::Status { name } => self.status(procs, name.as_deref()),
            Request::Volfile { name } => self.volfile(&name),
            Request::BrickStart { def, index, secret } => {
                self.brick_start(procs, def, index, secret.as_deref())
            }
            Request::BrickStop { name, index } => self.brick_stop(procs, &name, index),
            Request::PeerSync { def, secret } => self.peer_sync(def, secret.as_deref()),
            _ => Err(Error::invalid(format!(
                "`{}` is not a volume command",
                req.cmd()
            ))),
        }
    }
}

impl MgmtHandler for Manager {
    fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        Manager::handle(self, req, caller)
    }
}
