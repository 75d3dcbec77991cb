//! The pool's commands: `peer probe|detach|status`, `pool list`, and what members send each
//! other (Raft RPCs, changes forwarded to the leader, the prober's questions). None of them
//! waits for the volume commands' lock: Raft's heartbeats must not queue behind a brick start.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::def::{resolve, DEFAULT_MGMT_PORT};
use crate::manager::Manager;
use crate::peers::PeerLink;
use crate::pool::{NodeId, Pool};
use crate::request::Request;
use crate::response::{Joined, PeerDetached, PoolView, RaftReply, Response};
use kiln_proto::Error;

/// `HOST` or `HOST:PORT` as a management address.
pub(crate) fn host_addr(host: &str) -> Result<SocketAddr, Error> {
    if let Ok(a) = host.parse::<SocketAddr>() {
        return Ok(a);
    }
    let (h, port) = match host.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (
            h,
            p.parse::<u16>().map_err(|_| {
                Error::invalid(format!("bad port in {host:?}: want HOST or HOST:PORT"))
            })?,
        ),
        _ => (
            host.trim_start_matches('[').trim_end_matches(']'),
            DEFAULT_MGMT_PORT,
        ),
    };
    Ok(SocketAddr::new(resolve(h)?, port))
}

impl Manager {
    /// Starts this kilnd's pool membership (see [`crate::pool`]) on the current runtime;
    /// `addr` is the management address bound.
    pub async fn start_pool(self: &Arc<Self>, addr: std::net::SocketAddr) -> Result<(), Error> {
        let link = Arc::new(PeerLink {
            secret: self.secret.clone(),
            tls: self.tls.get().cloned(),
        });
        let pool = crate::pool::Pool::open(&self.state, link, addr).await?;
        let pool = Arc::new(pool);
        let _ = self.pool.set(pool.clone());
        // This host's files follow the store: after every change this member applies.
        let m = Arc::downgrade(self);
        pool.on_applied(move || {
            if let Some(m) = m.upgrade() {
                m.sync_files();
            }
        });
        Ok(())
    }

    /// Whether this kilnd is the pool's leader (it makes changes and heals).
    pub fn is_leader(&self) -> bool {
        self.pool
            .get()
            .is_some_and(|p| p.leader().is_some_and(|(id, _)| id == p.id()))
    }

    /// This kilnd's pool (set once the management port is bound).
    pub(crate) fn pool(&self) -> Result<&Pool, Error> {
        self.pool
            .get()
            .map(|p| &**p)
            .ok_or_else(|| Error::unavailable("this kilnd's pool is not started yet"))
    }

    /// Runs the pool's commands; `None` for every other request.
    pub(crate) fn pool_dispatch(&self, req: &Request) -> Option<Result<Response, Error>> {
        let r = match req {
            Request::PeerProbe { host } => self.peer_probe(req, host).map(Into::into),
            Request::PeerDetach { host } => self.peer_detach(req, host).map(Into::into),
            Request::PoolList => self.pool().map(|p| p.view(true).into()),
            Request::Raft { to, rpc, body } => self.pool().and_then(|p| {
                let reply = p.serve_rpc(*to, *rpc, body.clone())?;
                Ok(RaftReply { reply }.into())
            }),
            Request::PoolWrite { change: cmd } => {
                self.pool().and_then(|p| match p.change_at()? {
                    None => p.write(cmd.clone()).map(Into::into),
                    Some(l) => Err(Error::unavailable(format!(
                        "this kilnd is not the pool's leader ({l} is)"
                    ))),
                })
            }
            Request::PoolJoin { prepare } => self
                .pool()
                .and_then(|p| p.join_info(*prepare).map(Into::into)),
            // Sent by the leader once the pool no longer counts this member (this member may
            // never see that change: the leader stops sending it the log); authenticated like
            // every kilnd-to-kilnd command.
            Request::PoolLeave { id } => self.pool().and_then(|p| {
                if *id == p.id() {
                    p.reset()?;
                }
                p.join_info(false).map(Into::into)
            }),
            _ => return None,
        };
        Some(r)
    }

    /// `peer probe`: made on the leader.
    fn peer_probe(&self, req: &Request, host: &str) -> Result<Joined, Error> {
        let addr = host_addr(host)?;
        let pool = self.pool()?;
        match pool.forward(req)? {
            Some(r) => Ok(r),
            None => pool.probe(addr),
        }
    }

    /// `peer detach`: made on the leader, which then tells the member to forget the pool.
    fn peer_detach(&self, req: &Request, host: &str) -> Result<PeerDetached, Error> {
        let pool = self.pool()?;
        let view = pool.view(false);
        let id = member_named(&view, host)?;
        if let Some(r) = pool.forward(req)? {
            return Ok(r);
        }
        // A member that holds bricks stays: its volumes would lose a brick's manager.
        let at = view
            .members
            .iter()
            .find(|m| m.id == id)
            .map(|m| m.addr.clone());
        for def in self.load_all() {
            let held: Vec<String> = def
                .bricks
                .iter()
                .filter(|b| !b.removed && b.mgmt_addr().ok().map(|a| a.to_string()) == at)
                .map(|b| b.spec())
                .collect();
            if !held.is_empty() {
                return Err(Error::conflict(format!(
                    "{host} holds bricks of volume {} ({}): move them with replace-brick, or \
                     delete the volume, first",
                    def.name,
                    held.join(", ")
                )));
            }
        }
        let addr = pool.detach(id)?;
        let mut warnings = Vec::new();
        let told = addr
            .parse()
            .map_err(|e| Error::failed(format!("{e}")))
            .and_then(|a| pool.call::<Joined>(a, &Request::PoolLeave { id }));
        match told {
            Ok(_) => {}
            // Ourselves: forget the pool once this reply is on its way.
            Err(_) if id == pool.id() => {
                let p = self.pool.get().expect("started").clone();
                std::thread::spawn(move || {
                    if let Err(e) = p.reset() {
                        tracing::warn!("pool: cannot forget the pool after detach: {e}");
                    }
                });
            }
            Err(e) => warnings.push(format!(
                "{addr} was detached but could not be told to forget the pool ({e}); it will \
                 keep asking for votes until its kilnd is stopped or its state directory reset"
            )),
        }
        Ok(PeerDetached {
            detached: addr,
            warnings,
        })
    }
}

/// The member `host` names: its id in hex, or its address (`HOST`, `HOST:PORT`).
fn member_named(view: &PoolView, host: &str) -> Result<NodeId, Error> {
    if let Some(m) = view
        .members
        .iter()
        .find(|m| format!("{:016x}", m.id) == host.to_ascii_lowercase())
    {
        return Ok(m.id);
    }
    let has_port = host.parse::<SocketAddr>().is_ok()
        || host.rsplit_once(':').is_some_and(|(h, _)| !h.contains(':'));
    let want = host_addr(host)?;
    let found: Vec<&crate::response::PoolMember> = view
        .members
        .iter()
        .filter(|m| {
            m.addr
                .parse::<SocketAddr>()
                .is_ok_and(|a| a.ip() == want.ip() && (!has_port || a.port() == want.port()))
        })
        .collect();
    match found.as_slice() {
        [m] => Ok(m.id),
        [] => Err(Error::not_found(format!(
            "no member of the pool is at {host}"
        ))),
        _ => Err(Error::invalid(format!(
            "several members are at {host}: name one by HOST:PORT or by its id"
        ))),
    }
}
