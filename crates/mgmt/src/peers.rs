//! Several hosts: authenticated calls between kilnds, the authority's copies on its peers,
//! and the peer side of starting and stopping bricks.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use crate::def::{check_index, check_name, is_local, VolState, VolumeDef};
use crate::manager::{Manager, Procs, MGMT_SECRET_FILE};
use crate::request::Request;
use crate::response::{self, Ack, BrickStarted, BrickStopped, Response};
use crate::store::random;
use serde::de::DeserializeOwned;

/// Connect timeout for probes of bricks and calls to other kilnds.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a call to another kilnd may take (it may start bricks).
const PEER_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Sends one MGMT request to the kilnd at `addr`, proving `secret` (the management secret) and
/// requiring `addr` to prove it back, and returns the reply's JSON (an `"ok": false` reply
/// becomes an error carrying its message). Used between kilnds; clients use
/// `kiln_client::mgmt::call`.
pub fn call_peer<R: DeserializeOwned>(
    addr: SocketAddr,
    secret: &[u8],
    req: &Request,
) -> Result<R, String> {
    let mut s = PeerConn::connect(addr, secret)?;
    s.call(req)
}

/// An authenticated connection to another kilnd's management port.
pub(crate) struct PeerConn {
    addr: SocketAddr,
    sock: TcpStream,
    next_id: u64,
}

impl PeerConn {
    /// Connects and runs the handshake: this kilnd proves the secret, and so must the other
    /// one — a kilnd that does not ask for it, or cannot prove it, gets no command (commands
    /// carry volume secrets).
    pub(crate) fn connect(addr: SocketAddr, secret: &[u8]) -> Result<PeerConn, String> {
        use kiln_proto::auth::{client_transcript, server_transcript, NONCE_LEN};
        use kiln_proto::codec::Wire;
        use kiln_proto::ops::{AuthReply, AuthReq, HelloReply, HelloReq};
        let sock = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
            .map_err(|e| format!("cannot reach kilnd at {addr}: {e}"))?;
        let _ = sock.set_read_timeout(Some(PEER_CALL_TIMEOUT));
        let _ = sock.set_write_timeout(Some(PEER_CALL_TIMEOUT));
        let mut c = PeerConn {
            addr,
            sock,
            next_id: 1,
        };
        let hello = HelloReq {
            version: kiln_proto::frame::VERSION as u32,
            client: format!("kilnd {} (peer)", env!("CARGO_PKG_VERSION")),
            metrics: String::new(),
        };
        let (status, args, _) = c.exchange(kiln_proto::Op::Hello, &hello.to_wire())?;
        if status != 0 {
            return Err(format!(
                "kilnd at {addr} refused the handshake: {}",
                io::Error::from_raw_os_error(status as i32)
            ));
        }
        let hello = HelloReply::from_wire(&args)
            .map_err(|e| format!("kilnd at {addr}: bad HELLO reply: {e}"))?;
        if !hello.auth_required {
            return Err(format!(
                "kilnd at {addr} does not ask for the management secret (a kilnd from before \
                 management authentication?): not sending it volume commands"
            ));
        }
        let mut nonce = [0u8; NONCE_LEN];
        random(&mut nonce)?;
        let req = AuthReq {
            client_nonce: nonce.to_vec(),
            proof: kiln_server::auth::mac(secret, &client_transcript(&hello.nonce, &nonce)),
        };
        let (status, args, _) = c.exchange(kiln_proto::Op::Auth, &req.to_wire())?;
        if status == libc::EACCES as u32 {
            return Err(format!(
                "kilnd at {addr} refused this host's management secret: every kilnd of a \
                 cluster needs the same one (copy STATE_DIR/{MGMT_SECRET_FILE} from one host \
                 to the others, or start them all with --mgmt-secret-file naming a copy)"
            ));
        }
        if status != 0 {
            return Err(format!(
                "kilnd at {addr}: authentication failed: {}",
                io::Error::from_raw_os_error(status as i32)
            ));
        }
        let reply = AuthReply::from_wire(&args)
            .map_err(|e| format!("kilnd at {addr}: bad AUTH reply: {e}"))?;
        if !kiln_server::auth::verify(
            secret,
            &server_transcript(&hello.nonce, &nonce),
            &reply.proof,
        ) {
            return Err(format!(
                "kilnd at {addr} could not prove it holds the management secret: not sending \
                 it volume commands"
            ));
        }
        Ok(c)
    }

    /// This end's address: how the peer sees us.
    pub(crate) fn local_ip(&self) -> Result<IpAddr, String> {
        self.sock
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| format!("{}: {e}", self.addr))
    }

    /// Sends one request frame and reads its reply: status, arguments, payload.
    pub(crate) fn exchange(
        &mut self,
        op: kiln_proto::Op,
        args: &[u8],
    ) -> Result<(u32, Vec<u8>, Vec<u8>), String> {
        use kiln_proto::frame::{Header, HEADER_LEN};
        let addr = self.addr;
        let err = |e: io::Error| format!("kilnd at {addr}: {e}");
        let id = self.next_id;
        self.next_id += 1;
        let hdr = Header::request(op as u16, id, args.len() as u32, 0);
        let mut frame = hdr.to_bytes().to_vec();
        frame.extend_from_slice(args);
        self.sock.write_all(&frame).map_err(err)?;
        let mut h = [0u8; HEADER_LEN];
        self.sock.read_exact(&mut h).map_err(err)?;
        let h = Header::parse(&h).map_err(|e| format!("kilnd at {addr}: {e}"))?;
        let alen = h.args_len.get() as usize;
        let mut rest = vec![0u8; alen + h.payload_len.get() as usize];
        self.sock.read_exact(&mut rest).map_err(err)?;
        let payload = rest.split_off(alen);
        Ok((h.status.get(), rest, payload))
    }

    pub(crate) fn call<R: DeserializeOwned>(&mut self, req: &Request) -> Result<R, String> {
        use kiln_proto::codec::Wire;
        let addr = self.addr;
        let args = kiln_proto::ops::MgmtReq {
            json: serde_json::to_vec(req).expect("a request serialises"),
        }
        .to_wire();
        let (status, _, payload) = self.exchange(kiln_proto::Op::Mgmt, &args)?;
        if status != 0 {
            return Err(format!(
                "kilnd at {addr} refused the request: {}",
                io::Error::from_raw_os_error(status as i32)
            ));
        }
        response::decode(&payload).map_err(|e| format!("{addr}: {e}"))
    }
}

impl Manager {
    /// Peer side of `start`: caches the definition and the secret, runs brick `index`.
    pub(crate) fn brick_start(
        &self,
        procs: &mut Procs,
        def: VolumeDef,
        index: usize,
        secret: Option<&str>,
    ) -> Result<Response, String> {
        let def = self.take_peer_def(def)?;
        let i = check_index(index, &def)?;
        if let Some(s) = secret {
            self.write_secret(&def.name, s)?;
        }
        let ip = def.bricks[i].ip()?;
        if !is_local(ip) {
            return Err(format!(
                "brick {} is not on this host",
                def.bricks[i].spec()
            ));
        }
        let (port, pid) = self.ensure_brick(procs, &def, i)?;
        let mut def = def;
        def.bricks[i].ran(port, pid);
        def.state = VolState::Started;
        self.save(&def)?;
        Ok(BrickStarted { port, pid }.into())
    }

    /// Peer side of `stop`.
    pub(crate) fn brick_stop(
        &self,
        procs: &mut Procs,
        name: &str,
        index: usize,
    ) -> Result<Response, String> {
        check_name(name)?;
        let mut def = self.load(name)?;
        let i = check_index(index, &def)?;
        self.stop_brick(procs, &def, i);
        def.bricks[i].pid = None;
        self.save(&def)?;
        Ok(BrickStopped { stopped: i }.into())
    }

    /// Stores a copy of a definition sent by its authority.
    pub(crate) fn peer_sync(
        &self,
        def: VolumeDef,
        secret: Option<&str>,
    ) -> Result<Response, String> {
        let def = self.take_peer_def(def)?;
        if let Some(s) = secret {
            self.write_secret(&def.name, s)?;
        }
        for b in &def.bricks {
            if b.ip().is_ok_and(is_local) {
                fs::create_dir_all(&b.dir).map_err(|e| {
                    format!("cannot create brick directory {}: {e}", b.dir.display())
                })?;
            }
        }
        Ok(Ack {
            volume: def.name,
            warnings: Vec::new(),
        }
        .into())
    }

    pub(crate) fn peer_forget(&self, name: &str) -> Result<Response, String> {
        check_name(name)?;
        match self.load(name) {
            Ok(d) if d.authority.is_some() => {
                fs::remove_dir_all(self.vol_dir(name))
                    .map_err(|e| format!("cannot remove the copy of volume {name}: {e}"))?;
            }
            Ok(_) => return Err(format!("this kilnd is the authority of volume {name}")),
            Err(_) => {}
        }
        Ok(Ack {
            volume: name.to_owned(),
            warnings: Vec::new(),
        }
        .into())
    }

    /// The `def` of a peer request, checked and saved as this kilnd's cached copy (keeping the
    /// pids of bricks this kilnd runs).
    pub(crate) fn take_peer_def(&self, mut def: VolumeDef) -> Result<VolumeDef, String> {
        check_name(&def.name)?;
        if def.authority.is_none() {
            return Err("bad request: a peer copy names no authority".into());
        }
        if let Ok(mine) = self.load(&def.name) {
            if mine.authority.is_none() {
                return Err(format!(
                    "this kilnd is itself the authority of a volume named {}",
                    def.name
                ));
            }
            if mine.id == def.id {
                for (b, m) in def.bricks.iter_mut().zip(&mine.bricks) {
                    if b.ip().is_ok_and(is_local) && b.pid.is_none() && m.pid.is_some() {
                        b.pid = m.pid;
                        b.port = b.port.or(m.port);
                    }
                }
            }
        }
        fs::create_dir_all(self.vol_dir(&def.name).join("bricks"))
            .map_err(|e| format!("cannot create {}: {e}", self.vol_dir(&def.name).display()))?;
        self.save(&def)?;
        Ok(def)
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

    /// Sends `def` to the peer at `addr`, naming this kilnd (as the peer reaches it) the
    /// authority.
    pub(crate) fn sync_to(
        &self,
        addr: SocketAddr,
        def: &VolumeDef,
        with_secret: bool,
    ) -> Result<(), String> {
        let mut c = PeerConn::connect(addr, &self.secret)?;
        let mut copy = def.clone();
        copy.authority = Some(self.authority_addr(&c)?);
        let secret = if with_secret {
            Some(self.read_secret(&def.name)?)
        } else {
            None
        };
        c.call::<Ack>(&Request::PeerSync { def: copy, secret })
            .map(|_| ())
    }

    pub(crate) fn authority_addr(&self, c: &PeerConn) -> Result<String, String> {
        let port = *self.mgmt_port.lock().unwrap_or_else(|e| e.into_inner());
        Ok(format!("tcp:{}", SocketAddr::new(c.local_ip()?, port)))
    }

    /// Best effort: every peer gets the new definition; returns what failed.
    pub(crate) fn sync_all(&self, def: &VolumeDef) -> Vec<String> {
        self.peers(def)
            .into_iter()
            .filter_map(|a| {
                self.sync_to(a, def, false)
                    .err()
                    .map(|e| format!("{a} keeps an old copy of the definition: {e}"))
            })
            .collect()
    }

    pub(crate) fn remote_brick_start(
        &self,
        def: &VolumeDef,
        i: usize,
        secret: &str,
    ) -> Result<(u16, u32), String> {
        let addr = def.bricks[i].mgmt_addr()?;
        let mut c = PeerConn::connect(addr, &self.secret)?;
        let mut copy = def.clone();
        copy.authority = Some(self.authority_addr(&c)?);
        let req = Request::BrickStart {
            def: copy,
            index: i,
            secret: Some(secret.to_owned()),
        };
        let r: BrickStarted = c.call(&req)?;
        Ok((r.port, r.pid))
    }

    /// Authority side: a peer restarted one of its bricks on another port.
    pub(crate) fn brick_report(
        &self,
        name: &str,
        id: &str,
        index: usize,
        port: Option<u16>,
        pid: Option<u32>,
    ) -> Result<Response, String> {
        check_name(name)?;
        let mut def = self.load(name)?;
        if def.authority.is_some() || id != def.id {
            return Err(format!("this kilnd is not the authority of volume {name}"));
        }
        let i = check_index(index, &def)?;
        def.bricks[i].port = port;
        def.bricks[i].pid = pid;
        def.bricks[i].settled |= pid.is_some();
        self.save(&def)?;
        // The reporter already knows; calling it back now could wait on it.
        let reporter = def.bricks[i].mgmt_addr().ok();
        let mut warnings = Vec::new();
        for a in self.peers(&def) {
            if Some(a) != reporter {
                if let Err(e) = self.sync_to(a, &def, false) {
                    warnings.push(format!("{a} keeps an old copy of the definition: {e}"));
                }
            }
        }
        Ok(Ack {
            volume: name.to_owned(),
            warnings,
        }
        .into())
    }
}
