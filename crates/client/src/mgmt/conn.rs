//! The one management connection: connect (TCP, TLS when configured), the HELLO/AUTH
//! handshake of [`kiln_proto::auth`], framing, and JSON request → reply. The `kiln` commands,
//! kilnd-to-kilnd calls and clients fetching a graph all use it.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use kiln_proto::auth::{ClientHalf, Key};
use kiln_proto::codec::Wire;
use kiln_proto::frame::{Header, HEADER_LEN};
use kiln_proto::ops::{AuthReply, HelloReply, HelloReq, MgmtReq};
use kiln_proto::{Error, Kind, Op};

/// How long a connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a management call failed.
#[derive(Debug)]
pub enum MgmtError {
    /// The connection failed (connect, I/O, framing, a handshake the other side could not
    /// finish): the request may not have been carried out.
    Broken(io::Error),
    /// The kilnd refused the key: no such identity, a wrong key, or one it may not use here.
    Denied(String),
    /// The kilnd answered the frame with an error status (`ENOSYS`: it manages no volumes).
    Status(i32),
    /// The kilnd carried the request and answered `"ok": false` with its reason.
    Refused {
        /// The kilnd's sentence.
        message: String,
        /// What kind of refusal (`not-found`, `conflict`, …; `failed` from an older kilnd).
        kind: Kind,
        /// It refused for want of a key (or of the admin capability).
        auth_required: bool,
    },
}

impl std::fmt::Display for MgmtError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MgmtError::Broken(e) => write!(f, "{e}"),
            MgmtError::Denied(m) => f.write_str(m),
            MgmtError::Status(e) => write!(f, "{}", io::Error::from_raw_os_error(*e)),
            MgmtError::Refused { message, .. } => f.write_str(message),
        }
    }
}

impl std::error::Error for MgmtError {}

impl From<MgmtError> for io::Error {
    fn from(e: MgmtError) -> io::Error {
        match e {
            MgmtError::Broken(e) => e,
            MgmtError::Denied(m) => io::Error::new(io::ErrorKind::PermissionDenied, m),
            MgmtError::Status(s) => io::Error::from_raw_os_error(s),
            MgmtError::Refused {
                message,
                auth_required: true,
                ..
            } => io::Error::new(io::ErrorKind::PermissionDenied, message),
            MgmtError::Refused { message, .. } => io::Error::other(message),
        }
    }
}

impl From<MgmtError> for Error {
    /// The kind a caller acts on: a broken exchange may work later, a refused key is denied
    /// (and carries `EACCES`, which tells it from a command the kilnd denied), and a refusal
    /// keeps the kind the kilnd gave it.
    fn from(e: MgmtError) -> Error {
        match e {
            MgmtError::Broken(e) => Error::from(e).with_kind(Kind::Unavailable),
            MgmtError::Denied(m) => Error::denied(m).with_errno(libc::EACCES),
            MgmtError::Status(s) => {
                let e = io::Error::from_raw_os_error(s);
                Error::new(Kind::of_io(&e), e.to_string()).with_errno(s)
            }
            MgmtError::Refused {
                message,
                auth_required: true,
                ..
            } => Error::denied(message).with_errno(libc::EACCES),
            MgmtError::Refused { message, kind, .. } => Error::new(kind, message),
        }
    }
}

/// Whether the other side must prove the key back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// It must ask for a key and prove it (kilnd to kilnd: commands carry secrets).
    Required,
    /// Only when it asks for one (a command line talking to a kilnd that may keep none).
    IfAsked,
}

/// One blocking connection to a management port.
pub struct MgmtConn {
    addr: String,
    sock: kiln_tls::Blocking,
    next_id: u64,
}

impl MgmtConn {
    /// Connects to `addr` (`tcp:HOST:PORT` or `HOST:PORT`) with `tls` (None: plain TCP),
    /// giving up after `connect`; replies may take `timeout`.
    pub fn connect(
        addr: &str,
        tls: Option<Arc<kiln_tls::ClientConfig>>,
        connect: Duration,
        timeout: Duration,
    ) -> io::Result<MgmtConn> {
        let hostport = addr.strip_prefix("tcp:").unwrap_or(addr);
        let sa: SocketAddr = hostport
            .to_socket_addrs()
            .map_err(|e| io::Error::new(e.kind(), format!("bad management address {addr}: {e}")))?
            .next()
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("{addr}: no address"))
            })?;
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("kilnd at {addr}: {e}"));
        let sock = TcpStream::connect_timeout(&sa, connect)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot reach kilnd at {addr}: {e}")))?;
        sock.set_read_timeout(Some(timeout)).map_err(ctx)?;
        sock.set_write_timeout(Some(timeout)).map_err(ctx)?;
        let sock = kiln_tls::Blocking::connect(sock, tls, hostport).map_err(ctx)?;
        Ok(MgmtConn {
            addr: addr.to_owned(),
            sock,
            next_id: 1,
        })
    }

    /// [`MgmtConn::connect`] with the TLS identity `KILN_TLS_DIR` names, if any (a kilnd
    /// started with `--tls` takes TLS clients only).
    pub fn connect_env(addr: &str, timeout: Duration) -> io::Result<MgmtConn> {
        MgmtConn::connect(
            addr,
            kiln_tls::client_config_from_env()?,
            CONNECT_TIMEOUT,
            timeout,
        )
    }

    /// The address this connection was made to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn ctx(&self, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("kilnd at {}: {e}", self.addr))
    }

    /// How long a reply may take from now on.
    pub fn set_timeout(&mut self, t: Duration) {
        let t = Some(t.max(Duration::from_millis(1)));
        let _ = self.sock.tcp().set_read_timeout(t);
        let _ = self.sock.tcp().set_write_timeout(t);
    }

    /// This end's address: how the other side sees us.
    pub fn local_ip(&self) -> io::Result<IpAddr> {
        self.sock.tcp().local_addr().map(|a| a.ip())
    }

    /// Sends one request frame; returns the reply's status, arguments and payload.
    pub fn exchange(&mut self, op: Op, args: &[u8]) -> io::Result<(u32, Vec<u8>, Vec<u8>)> {
        if args.len() > kiln_proto::MAX_ARGS_LEN as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "management request above 64 KiB",
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = Header::request(op as u16, id, args.len() as u32, 0)
            .to_bytes()
            .to_vec();
        frame.extend_from_slice(args);
        self.sock.write_all(&frame).map_err(|e| self.ctx(e))?;
        let mut h = [0u8; HEADER_LEN];
        self.sock.read_exact(&mut h).map_err(|e| self.ctx(e))?;
        let h = Header::parse(&h).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("kilnd at {}: {e}", self.addr),
            )
        })?;
        if h.status.get() == libc::EPROTONOSUPPORT as u32 {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "kilnd at {} requires TLS: set {} to a directory with an identity from its \
                     CA (ca.pem, cert.pem, key.pem: kiln tls issue)",
                    self.addr,
                    kiln_tls::ENV_DIR
                ),
            ));
        }
        let alen = h.args_len.get() as usize;
        let plen = h.payload_len.get() as usize;
        if alen > kiln_proto::MAX_ARGS_LEN as usize || plen > kiln_proto::MAX_PAYLOAD_LEN as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("kilnd at {}: reply above the frame limits", self.addr),
            ));
        }
        let mut rest = vec![0u8; alen + plen];
        self.sock.read_exact(&mut rest).map_err(|e| self.ctx(e))?;
        let payload = rest.split_off(alen);
        Ok((h.status.get(), rest, payload))
    }

    /// HELLO, then, when the kilnd asks for a key (or `proof` requires it), proves `key` and
    /// checks the kilnd's proof back.
    pub fn authenticate(&mut self, key: &Key, proof: Proof) -> Result<(), MgmtError> {
        let addr = self.addr.clone();
        let bad = |what: &str, e: kiln_proto::DecodeError| {
            MgmtError::Broken(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("kilnd at {addr}: bad {what} reply: {e}"),
            ))
        };
        let hello = HelloReq {
            version: kiln_proto::frame::VERSION as u32,
            client: format!("kiln {} (management)", env!("CARGO_PKG_VERSION")),
            metrics: String::new(),
        };
        let (status, args, _) = self
            .exchange(Op::Hello, &hello.to_wire())
            .map_err(MgmtError::Broken)?;
        if status != 0 {
            return Err(MgmtError::Status(status as i32));
        }
        let hello = HelloReply::from_wire(&args).map_err(|e| bad("HELLO", e))?;
        if !hello.auth_required {
            return match proof {
                Proof::IfAsked => Ok(()),
                Proof::Required => Err(MgmtError::Denied(format!(
                    "kilnd at {addr} does not ask for a key: not sending it commands"
                ))),
            };
        }
        let (half, req) = ClientHalf::answer(key, &hello.nonce).map_err(MgmtError::Broken)?;
        let (status, args, _) = self
            .exchange(Op::Auth, &req.to_wire())
            .map_err(MgmtError::Broken)?;
        if status == libc::EACCES as u32 {
            let why = match key.identity.as_str() {
                "" => "the management secret: wrong secret".to_owned(),
                n => format!("the key of identity {n}: wrong key, or no such identity"),
            };
            return Err(MgmtError::Denied(format!("kilnd at {addr} refused {why}")));
        }
        if status != 0 {
            return Err(MgmtError::Status(status as i32));
        }
        let reply = AuthReply::from_wire(&args).map_err(|e| bad("AUTH", e))?;
        if !half.server_proved(&reply.proof) {
            return Err(MgmtError::Denied(format!(
                "kilnd at {addr} could not prove it holds the key: not using it"
            )));
        }
        Ok(())
    }

    /// Sends one management request (a JSON object with `"cmd"`) and returns the reply of a
    /// kilnd that carried it out.
    pub fn request(&mut self, req: &serde_json::Value) -> Result<serde_json::Value, MgmtError> {
        let args = MgmtReq {
            json: req.to_string().into_bytes(),
        }
        .to_wire();
        let (status, _, payload) = self.exchange(Op::Mgmt, &args).map_err(MgmtError::Broken)?;
        if status != 0 {
            return Err(MgmtError::Status(status as i32));
        }
        let v: serde_json::Value = serde_json::from_slice(&payload).map_err(|e| {
            MgmtError::Broken(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("kilnd at {}: bad reply: {e}", self.addr),
            ))
        })?;
        if v["ok"] == true {
            return Ok(v);
        }
        Err(MgmtError::Refused {
            message: v["error"]
                .as_str()
                .unwrap_or("the server refused without saying why")
                .to_owned(),
            kind: Kind::from_name(v["kind"].as_str().unwrap_or_default()),
            auth_required: v["auth_required"] == true,
        })
    }
}
