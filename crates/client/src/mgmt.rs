//! Talking to a kilnd's management port: volume commands, and fetching a volume's graph.
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! let (server, vol) = kiln_client::mgmt::parse_volume_spec("127.0.0.1:/vol")?;
//! let volfile = kiln_client::mgmt::fetch_volfile(&server, &vol)?;
//! let secret = kiln_client::mgmt::secret_file(&vol, None);
//! # Ok(()) }
//! ```
//!
//! The management port requires the management secret (the kilnd's `STATE_DIR/mgmt.secret`,
//! or the file its `--mgmt-secret-file` names) for every command but `volfile`: [`call`] proves
//! it with the same HMAC challenge-response as bricks when [`mgmt_secret_file`] finds it, and
//! [`call_with_secret`] takes it from the caller. [`fetch_volfile`] needs no secret: a client
//! volfile holds brick addresses, no secret, so mounting works from any host, as in GlusterFS.
//! The bricks of a volume require the volume's own secret, which [`secret_file`] finds.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln_layer::volfile::Volfile;
use kiln_proto::codec::Wire;
use kiln_proto::frame::{Header, HEADER_LEN};
use kiln_proto::ops::MgmtReq;
use kiln_proto::Op;

/// The management port a kilnd listens on by default.
pub const DEFAULT_MGMT_PORT: u16 = 24007;
/// The management address the `kiln` commands use by default.
pub const DEFAULT_SERVER: &str = "tcp:127.0.0.1:24007";
/// Where a kilnd keeps its state by default.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/kiln";

/// The name of the management secret in a kilnd's state directory.
pub const MGMT_SECRET_FILE: &str = "mgmt.secret";

/// The management secret file: `explicit` (a `--mgmt-secret-file` option), else
/// `KILN_MGMT_SECRET_FILE`, else `STATE_DIR/mgmt.secret` when it exists (readable by root on a
/// host of the cluster).
pub fn mgmt_secret_file(explicit: Option<&Path>, state_dir: &Path) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_owned());
    }
    if let Some(p) = std::env::var_os("KILN_MGMT_SECRET_FILE") {
        return Some(PathBuf::from(p));
    }
    let p = state_dir.join(MGMT_SECRET_FILE);
    p.exists().then_some(p)
}

/// Sends one management request (a JSON object with `"cmd"`) to the kilnd at `addr`
/// (`tcp:HOST:PORT` or `HOST:PORT`) and returns its reply, proving the management secret that
/// [`mgmt_secret_file`] finds (with the default state directory `/var/lib/kiln`) when it is
/// readable. A reply with `"ok": false` becomes an error carrying the server's message; a
/// refusal for want of the secret, or of a wrong one, is an error of kind `PermissionDenied`.
pub fn call(addr: &str, req: &serde_json::Value) -> io::Result<serde_json::Value> {
    let secret = match mgmt_secret_file(None, Path::new(DEFAULT_STATE_DIR)) {
        Some(p) if std::env::var_os("KILN_MGMT_SECRET_FILE").is_some() => Some(read_secret(&p)?),
        // The default file may be root's: without it, open commands still work.
        Some(p) => read_secret(&p).ok(),
        None => None,
    };
    call_with_secret(addr, req, secret.as_deref())
}

/// [`call`] proving `secret` (when the kilnd asks for one), or none: then only the commands
/// open to everyone (`volfile`) succeed on a kilnd that requires the secret.
pub fn call_with_secret(
    addr: &str,
    req: &serde_json::Value,
    secret: Option<&[u8]>,
) -> io::Result<serde_json::Value> {
    let mut c = MgmtConn::connect(addr)?;
    if let Some(secret) = secret {
        c.authenticate(secret)?;
    }
    c.call(req)
}

/// One blocking connection to a management port.
struct MgmtConn<'a> {
    addr: &'a str,
    sock: kiln_tls::Blocking,
    next_id: u64,
}

impl<'a> MgmtConn<'a> {
    fn connect(addr: &'a str) -> io::Result<MgmtConn<'a>> {
        let hostport = addr.strip_prefix("tcp:").unwrap_or(addr);
        let sa = hostport
            .to_socket_addrs()
            .map_err(|e| io::Error::new(e.kind(), format!("bad management address {addr}: {e}")))?
            .next()
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("{addr}: no address"))
            })?;
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("kilnd at {addr}: {e}"));
        let sock = TcpStream::connect_timeout(&sa, Duration::from_secs(5)).map_err(ctx)?;
        // Starting a volume may take a while (bricks on several hosts); two minutes bound a
        // hang.
        sock.set_read_timeout(Some(Duration::from_secs(120)))
            .map_err(ctx)?;
        // A kilnd started with --tls takes TLS clients only: KILN_TLS_DIR names our identity.
        let tls = kiln_tls::client_config_from_env()?;
        let sock = kiln_tls::Blocking::connect(sock, tls, hostport).map_err(ctx)?;
        Ok(MgmtConn {
            addr,
            sock,
            next_id: 1,
        })
    }

    fn ctx(&self, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("kilnd at {}: {e}", self.addr))
    }

    /// Sends one request frame; returns the reply's status, arguments and payload.
    fn exchange(&mut self, op: Op, args: &[u8]) -> io::Result<(u32, Vec<u8>, Vec<u8>)> {
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
        let mut rest = vec![0u8; alen + h.payload_len.get() as usize];
        self.sock.read_exact(&mut rest).map_err(|e| self.ctx(e))?;
        let payload = rest.split_off(alen);
        Ok((h.status.get(), rest, payload))
    }

    /// HELLO, then, when the kilnd asks for it, proves `secret` and checks the kilnd's proof.
    fn authenticate(&mut self, secret: &[u8]) -> io::Result<()> {
        use kiln_proto::auth::{client_transcript, server_transcript, NONCE_LEN};
        use kiln_proto::ops::{AuthReply, AuthReq, HelloReply, HelloReq};
        let addr = self.addr;
        let bad = |what: &str, e: kiln_proto::DecodeError| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("kilnd at {addr}: bad {what} reply: {e}"),
            )
        };
        let hello = HelloReq {
            version: kiln_proto::frame::VERSION as u32,
            client: "kiln-mgmt".into(),
            metrics: String::new(),
        };
        let (status, args, _) = self.exchange(Op::Hello, &hello.to_wire())?;
        if status != 0 {
            return Err(self.ctx(io::Error::from_raw_os_error(status as i32)));
        }
        let hello = HelloReply::from_wire(&args).map_err(|e| bad("HELLO", e))?;
        if !hello.auth_required {
            // A kilnd without a secret (older, or a brick): nothing to prove.
            return Ok(());
        }
        let mut nonce = vec![0u8; NONCE_LEN];
        rustix::rand::getrandom(&mut nonce, rustix::rand::GetRandomFlags::empty())?;
        let req = AuthReq {
            proof: hmac_sha256(secret, &client_transcript(&hello.nonce, &nonce)),
            client_nonce: nonce.clone(),
        };
        let (status, args, _) = self.exchange(Op::Auth, &req.to_wire())?;
        if status == libc::EACCES as u32 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("kilnd at {addr} refused the management secret: wrong secret"),
            ));
        }
        if status != 0 {
            return Err(self.ctx(io::Error::from_raw_os_error(status as i32)));
        }
        let reply = AuthReply::from_wire(&args).map_err(|e| bad("AUTH", e))?;
        if reply.proof != hmac_sha256(secret, &server_transcript(&hello.nonce, &nonce)) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("kilnd at {addr} could not prove it holds the management secret"),
            ));
        }
        Ok(())
    }

    fn call(&mut self, req: &serde_json::Value) -> io::Result<serde_json::Value> {
        let addr = self.addr;
        let args = MgmtReq {
            json: req.to_string().into_bytes(),
        }
        .to_wire();
        let (status, _, payload) = self.exchange(Op::Mgmt, &args)?;
        match status {
            0 => {}
            e if e == libc::ENOSYS as u32 => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "{addr} does not manage volumes (a brick server? point --server at a \
                         kilnd started without --brick)"
                    ),
                ))
            }
            e => return Err(self.ctx(io::Error::from_raw_os_error(e as i32))),
        }
        let v: serde_json::Value = serde_json::from_slice(&payload).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("kilnd at {addr}: bad reply: {e}"),
            )
        })?;
        if v["ok"] == true {
            return Ok(v);
        }
        let msg = v["error"]
            .as_str()
            .unwrap_or("the server refused without saying why");
        if v["auth_required"] == true {
            Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("kilnd at {addr}: {msg}"),
            ))
        } else {
            Err(io::Error::other(msg.to_owned()))
        }
    }
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> Vec<u8> {
    use hmac::Mac;
    let mut m =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(msg);
    m.finalize().into_bytes().to_vec()
}

/// A volume's client graph as a kilnd hands it out.
#[derive(Debug, Clone)]
pub struct Graph {
    /// The graph.
    pub volfile: Volfile,
    /// Its version in the pool's store: higher is newer (0 from a kilnd that keeps none).
    pub version: u64,
    /// The management addresses (`tcp:IP:PORT`) of the pool's members, to ask when this one
    /// does not answer.
    pub servers: Vec<String>,
}

/// Fetches the client volume graph of `volume` from the kilnd at `server` (any member of the
/// pool).
///
/// Needs no secret (the one command a kilnd answers without one), and sends none: the request
/// is a single MGMT frame, so a brick that requires its secret refuses it (`PermissionDenied`)
/// and one without a management handler says `Unsupported`.
pub fn fetch_graph(server: &str, volume: &str) -> io::Result<Graph> {
    let r = call_with_secret(
        server,
        &serde_json::json!({ "cmd": "volfile", "name": volume }),
        None,
    )?;
    let text = r["volfile"].as_str().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "volfile reply without \"volfile\"",
        )
    })?;
    let volfile = Volfile::parse(text)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("volume {volume}: {e}")))?;
    let servers = r["servers"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    Ok(Graph {
        volfile,
        version: r["graph"].as_u64().unwrap_or(0),
        servers,
    })
}

/// [`fetch_graph`]'s volfile alone.
pub fn fetch_volfile(server: &str, volume: &str) -> io::Result<Volfile> {
    fetch_graph(server, volume).map(|g| g.volfile)
}

/// Splits `HOST:/VOL` or `HOST:PORT:/VOL` into the management address (`tcp:HOST:PORT`,
/// default port [`DEFAULT_MGMT_PORT`]) and the volume name.
pub fn parse_volume_spec(spec: &str) -> io::Result<(String, String)> {
    let bad = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad volume {spec:?}: {why} (want HOST:/VOL or HOST:PORT:/VOL)"),
        )
    };
    let (hp, vol) = spec.split_once(":/").ok_or_else(|| bad("no \":/\""))?;
    if vol.is_empty() || vol.contains('/') {
        return Err(bad("the volume is a name, not a path"));
    }
    let (host, port) = match hp.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("bad port"))?,
        ),
        None => (hp, DEFAULT_MGMT_PORT),
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    Ok((format!("tcp:{host}:{port}"), vol.to_owned()))
}

/// The secret file of `volume`'s bricks: `explicit` (a `--secret-file` option), else
/// `KILN_SECRET_FILE`, else the local kilnd's `/var/lib/kiln/vols/VOL/secret` when readable.
pub fn secret_file(volume: &str, explicit: Option<&Path>) -> Option<PathBuf> {
    secret_file_in(volume, explicit, Path::new(DEFAULT_STATE_DIR))
}

/// [`secret_file`] with another state directory in place of `/var/lib/kiln`.
pub fn secret_file_in(volume: &str, explicit: Option<&Path>, state_dir: &Path) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_owned());
    }
    if let Some(p) = std::env::var_os("KILN_SECRET_FILE") {
        return Some(PathBuf::from(p));
    }
    let p = state_dir.join("vols").join(volume).join("secret");
    std::fs::File::open(&p).is_ok().then_some(p)
}

/// Makes `path` the secret file of this process's connections to bricks (what
/// `KILN_SECRET_FILE` says; `kiln mount --secret-file` and `kiln nbd --secret-file`). Call it
/// before the process starts any thread: it sets the process's environment.
pub fn use_secret_file(path: &Path) {
    // Environment changes race with threads reading it; the callers run this first thing,
    // while the process has one thread.
    std::env::set_var("KILN_SECRET_FILE", path);
}

/// Reads a secret file as bricks and clients use it (its text without surrounding space).
pub fn read_secret(path: &Path) -> io::Result<Vec<u8>> {
    let s = std::fs::read_to_string(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot read secret file {}: {e}", path.display()),
        )
    })?;
    Ok(s.trim().as_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_specs() {
        assert_eq!(
            parse_volume_spec("10.0.0.1:/vol").unwrap(),
            ("tcp:10.0.0.1:24007".into(), "vol".into())
        );
        assert_eq!(
            parse_volume_spec("node:24008:/v2").unwrap(),
            ("tcp:node:24008".into(), "v2".into())
        );
        for bad in ["vol", ":/vol", "h:/", "h:/a/b", "h:x:/v", "h:0:/v"] {
            assert!(parse_volume_spec(bad).is_err(), "{bad} accepted");
        }
    }
}
