//! Several hosts: authenticated calls between kilnds, the brick directories of a new volume,
//! and the peer side of starting and stopping bricks.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use crate::def::{check_index, check_name, is_local, VolumeDef};
use crate::manager::{Manager, Procs, MGMT_SECRET_FILE};
use crate::pool::{CallError, Channel, Link};
use crate::request::Request;
use crate::response::{Ack, BrickStarted, BrickStopped, Response};
use kiln_client::mgmt::{Key, MgmtConn, MgmtError, Proof};
use kiln_proto::error::Context as _;
use kiln_proto::Error;
use serde::de::DeserializeOwned;

/// Connect timeout for probes of bricks and calls to other kilnds.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a call to another kilnd may take (it may start bricks).
const PEER_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Sends one MGMT request to the kilnd at `addr`, proving `secret` (the management secret) and
/// requiring `addr` to prove it back, and returns the reply's JSON (an `"ok": false` reply
/// becomes an error carrying its message). Used between kilnds; clients use
/// `kiln_client::mgmt::call`.
pub(crate) fn call_peer<R: DeserializeOwned>(
    addr: SocketAddr,
    secret: &[u8],
    tls: Option<&Arc<kiln_tls::ClientConfig>>,
    req: &Request,
) -> Result<R, Error> {
    let mut s = PeerConn::connect(addr, secret, tls)?;
    s.call(req)
}

/// An authenticated connection to another kilnd's management port: the one management
/// connection ([`MgmtConn`]), where the other kilnd must prove the management secret too.
pub(crate) struct PeerConn {
    addr: SocketAddr,
    conn: MgmtConn,
}

impl PeerConn {
    /// Connects and runs the handshake: this kilnd proves the secret, and so must the other
    /// one — a kilnd that does not ask for it, or cannot prove it, gets no command (commands
    /// carry volume secrets).
    pub(crate) fn connect(
        addr: SocketAddr,
        secret: &[u8],
        tls: Option<&Arc<kiln_tls::ClientConfig>>,
    ) -> Result<PeerConn, Error> {
        // With --tls, kilnds speak TLS to each other with their own identities (mutual).
        let mut conn = MgmtConn::connect(
            &addr.to_string(),
            tls.cloned(),
            CONNECT_TIMEOUT,
            PEER_CALL_TIMEOUT,
        )
        .map_err(Error::from)?;
        conn.authenticate(&Key::shared(secret), Proof::Required)
            .map_err(|e| match e {
                MgmtError::Denied(m) if m.contains("refused") => Error::failed(format!(
                    "kilnd at {addr} refused this host's management secret: every kilnd of a \
                     cluster needs the same one (copy STATE_DIR/{MGMT_SECRET_FILE} from one \
                     host to the others, or start them all with --mgmt-secret-file naming a \
                     copy)"
                )),
                MgmtError::Status(s) => Error::failed(format!(
                    "kilnd at {addr} refused the handshake: {}",
                    io::Error::from_raw_os_error(s)
                )),
                e => e.into(),
            })?;
        Ok(PeerConn { addr, conn })
    }

    /// How long a call may wait for its reply.
    pub(crate) fn set_timeout(&mut self, t: Duration) {
        self.conn.set_timeout(t);
    }

    /// This end's address: how the peer sees us.
    pub(crate) fn local_ip(&self) -> Result<IpAddr, Error> {
        self.conn
            .local_ip()
            .with_context(|| format!("{}", self.addr))
    }

    pub(crate) fn call<R: DeserializeOwned>(
        &mut self,
        req: &impl serde::Serialize,
    ) -> Result<R, Error> {
        let req = serde_json::to_value(req).expect("a request serialises");
        let v = Channel::call(self, &req, None)?;
        serde_json::from_value(v)
            .map_err(|e| Error::failed(format!("{}: bad reply: {e}", self.addr)))
    }
}

impl Channel for PeerConn {
    fn call(
        &mut self,
        req: &serde_json::Value,
        timeout: Option<Duration>,
    ) -> Result<serde_json::Value, CallError> {
        self.set_timeout(timeout.unwrap_or(PEER_CALL_TIMEOUT));
        let addr = self.addr;
        self.conn.request(req).map_err(|e| match e {
            MgmtError::Broken(e) => CallError::Broken(e.to_string()),
            MgmtError::Status(s) => CallError::Refused(Error::failed(format!(
                "kilnd at {addr} refused the request: {}",
                io::Error::from_raw_os_error(s)
            ))),
            // The other kilnd's own sentence and kind.
            e => CallError::Refused(e.into()),
        })
    }

    fn local_ip(&self) -> Result<IpAddr, Error> {
        PeerConn::local_ip(self)
    }
}

/// The pool's way to other members: [`PeerConn`]s proving the management secret (over TLS
/// with `--tls`).
pub(crate) struct PeerLink {
    pub(crate) secret: Arc<[u8]>,
    pub(crate) tls: Option<Arc<kiln_tls::ClientConfig>>,
}

impl Link for PeerLink {
    fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Channel>, Error> {
        Ok(Box::new(PeerConn::connect(
            addr,
            &self.secret,
            self.tls.as_ref(),
        )?))
    }
}

impl Manager {
    /// Peer side of `start`: runs brick `index` of `def` here (the leader records where).
    pub(crate) fn brick_start(
        &self,
        procs: &mut Procs,
        def: VolumeDef,
        index: usize,
        secret: Option<&str>,
    ) -> Result<Response, Error> {
        check_name(&def.name)?;
        let i = check_index(index, &def)?;
        let ip = def.bricks[i].ip()?;
        if !is_local(ip) {
            return Err(Error::not_found(format!(
                "brick {} is not on this host",
                def.bricks[i].spec()
            )));
        }
        self.local_files(&def, secret)?;
        Ok(self.ensure_brick(procs, &def, i)?.into())
    }

    /// Peer side of `stop`.
    pub(crate) fn brick_stop(
        &self,
        procs: &mut Procs,
        name: &str,
        index: usize,
    ) -> Result<Response, Error> {
        check_name(name)?;
        let def = self.load(name)?;
        let i = check_index(index, &def)?;
        self.stop_brick(procs, &def, i);
        Ok(BrickStopped { stopped: i }.into())
    }

    /// Peer side of `create`: makes this host's brick directories of `def`.
    pub(crate) fn peer_sync(
        &self,
        def: VolumeDef,
        secret: Option<&str>,
    ) -> Result<Response, Error> {
        check_name(&def.name)?;
        self.local_files(&def, secret)?;
        Ok(Ack {
            volume: def.name,
            warnings: Vec::new(),
        }
        .into())
    }

    /// This host's files of `def`: the volume's directory, the key its clients here prove
    /// (the shared secret when given and on, else the pool hosts' local key; the store brings
    /// it too, but a brick may start before this member has applied the change that made it),
    /// and its brick directories here.
    fn local_files(&self, def: &VolumeDef, secret: Option<&str>) -> Result<(), Error> {
        let dir = self.vol_dir(&def.name);
        fs::create_dir_all(dir.join("bricks"))
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let key = match secret {
            Some(s) if def.shared_secret != Some(false) => Some(s.to_owned()),
            Some(_) => Some(self.local_key(&def.name)),
            None => None,
        };
        if let Some(k) = key {
            crate::files::write_atomic(&dir, "secret", format!("{k}\n").as_bytes(), 0o600)?;
        }
        for b in &def.bricks {
            if b.ip().is_ok_and(is_local) {
                fs::create_dir_all(&b.dir).map_err(|e| {
                    Error::io(
                        format_args!("cannot create brick directory {}", b.dir.display()),
                        &e,
                    )
                })?;
            }
        }
        Ok(())
    }

    // ---- several hosts ----

    /// Management addresses of the other hosts with bricks of `def`.
    pub(crate) fn peers(&self, def: &VolumeDef) -> Vec<SocketAddr> {
        let mut out = BTreeSet::new();
        for b in &def.bricks {
            if let (Ok(ip), Ok(addr)) = (b.ip(), b.mgmt_addr()) {
                if !is_local(ip) {
                    out.insert(addr);
                }
            }
        }
        out.into_iter().collect()
    }

    /// Refuses a host whose kilnd is not a member of this kilnd's pool.
    pub(crate) fn check_member(&self, addr: SocketAddr) -> Result<(), Error> {
        let view = self.pool()?.view(false);
        if view.members.iter().any(|m| m.addr == addr.to_string()) {
            return Ok(());
        }
        Err(Error::not_found(format!(
            "the kilnd at {addr} is not in this pool: `kiln peer probe {addr}` first"
        )))
    }

    /// Asks the peer at `addr` to make its brick directories of `def` (and so proves it is
    /// there).
    pub(crate) fn sync_to(&self, addr: SocketAddr, def: &VolumeDef) -> Result<(), Error> {
        let mut c = PeerConn::connect(addr, &self.secret, self.tls.get())?;
        c.call::<Ack>(&Request::PeerSync {
            def: def.clone(),
            secret: None,
        })
        .map(|_| ())
    }

    pub(crate) fn remote_brick_start(
        &self,
        def: &VolumeDef,
        i: usize,
        secret: &str,
    ) -> Result<BrickStarted, Error> {
        let addr = def.bricks[i].mgmt_addr()?;
        let mut c = PeerConn::connect(addr, &self.secret, self.tls.get())?;
        let req = Request::BrickStart {
            def: def.clone(),
            index: i,
            secret: Some(secret.to_owned()),
        };
        c.call(&req)
    }
}
