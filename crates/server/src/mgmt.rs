//! Volume management: the volume definitions a kilnd keeps, the brick processes it runs for
//! them, and the MGMT commands (JSON over `Op::Mgmt`) that change them.
//!
//! A kilnd started without `--brick` is a management daemon. It keeps its state in a directory
//! (`--state-dir`, default `/var/lib/kiln`):
//!
//! ```text
//! mgmt.secret              the management secret (64 hex digits, mode 0600), unless
//!                          `--mgmt-secret-file` names another file
//! vols/NAME/volume.json    the definition (or, on a peer, a cached copy of it)
//! vols/NAME/secret         the volume's shared secret (64 hex digits, mode 0600)
//! vols/NAME/bricks/N.toml  brick N's volfile; N.log is its output
//! mgmt-root/               an empty directory behind the management port's (refused) file fops
//! ```
//!
//! Bricks are separate processes (the same executable, in brick mode), so one can die or be
//! killed without taking the others or the management daemon along; they outlive a restart of
//! kilnd, which adopts them again (pid alive, running this brick's volfile, port answering).
//!
//! Several hosts: the kilnd where `create` ran is the volume's *authority*. It keeps the
//! definition and makes every change; bricks on other hosts are started and stopped by asking
//! that host's kilnd (`brick-start`, `brick-stop`), and every host with a brick of the volume
//! holds a cached copy (`peer-sync`), so `info`, `status` and `volfile` work from any of them.
//! A peer forwards `start`, `stop` and `delete` of a volume it only caches to the authority.
//!
//! A brick is written `HOST:/DIR` or `HOST:PORT:/DIR`, where PORT is the management port of
//! HOST's kilnd (default [`DEFAULT_MGMT_PORT`]). HOST is an IP address or a name that resolves
//! to one; a brick is on "this host" when this host can bind that address.
//!
//! Every reply is a JSON object with `"ok": true` and the command's fields, or `"ok": false`
//! and `"error"`: a sentence meant for the operator.
//!
//! **Authentication.** The management port requires the management secret (`mgmt.secret`
//! above, created at first start; the same HMAC challenge-response as bricks, see
//! `kiln_proto::auth`) for every command but one: `volfile`, the client graph of a started
//! volume, stays open to unauthenticated connections as in GlusterFS, so that `kiln mount
//! HOST:/VOL` works on a client host without handing it the key to create and delete
//! volumes. What `volfile` returns is layer names and brick addresses (`tcp:IP:PORT`) — the
//! same things a port scan finds — and never a secret; the bricks themselves still require
//! the volume's own secret. Everything else — `create`, `start`, `stop`, `delete`, `info`,
//! `list`, `status` and the kilnd-to-kilnd commands (`peer-sync` and `brick-start`, which
//! carry volume secrets, `brick-stop`, `brick-report`, `peer-forget`) — is refused, and the
//! refusal logged with the peer's address, unless the connection proved the secret. An
//! unauthenticated connection can do nothing else either: the connection code refuses every
//! other fop before authentication (see [`Caller`]).
//!
//! Kilnds prove the secret to each other too, and a kilnd sends a command (and with it a
//! volume secret) only to a kilnd that proves the secret back, so every host of a cluster
//! must hold the same one: copy the first host's `STATE_DIR/mgmt.secret` to the others before
//! they first start (or start every kilnd with `--mgmt-secret-file` naming a shared copy).

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_layer::volfile::{LayerDef, LayerKind, Volfile};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Who sent a MGMT request, as the connection that carried it knows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The peer's address (`IP:PORT`, or `unix`), for logs.
    pub peer: String,
    /// True when the connection proved the server's secret, or the server has none.
    pub authenticated: bool,
}

/// What the connection code calls with a MGMT request's JSON; returns the reply's JSON.
///
/// On a server with a secret, MGMT is the one fop besides HELLO and AUTH that the connection
/// code lets through before authentication: the handler decides per command, knowing the
/// [`Caller`]. A plain closure `Fn(&[u8]) -> Vec<u8>` is a handler that does not look at the
/// caller: it runs only for authenticated callers, and the others get a refusal.
pub trait MgmtHandler: Send + Sync {
    /// Answers one request (JSON) from `caller` with the reply's JSON.
    fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8>;
}

impl<F: Fn(&[u8]) -> Vec<u8> + Send + Sync> MgmtHandler for F {
    fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        if caller.authenticated {
            self(req)
        } else {
            tracing::warn!(peer = %caller.peer, "mgmt: refused a request before authentication");
            refusal("this request").to_string().into_bytes()
        }
    }
}

/// A MGMT handler as the server holds it.
pub type Handler = Arc<dyn MgmtHandler>;

/// The commands an unauthenticated connection may send (see the module documentation).
pub const OPEN_COMMANDS: &[&str] = &["volfile"];

/// The name of the management secret in the state directory.
pub const MGMT_SECRET_FILE: &str = "mgmt.secret";

/// The reply to an unauthenticated request for `what`: `"auth_required": true` tells clients
/// to say how to give the secret.
fn refusal(what: &str) -> Value {
    json!({
        "ok": false,
        "auth_required": true,
        "error": format!(
            "{what} needs the management secret, and this connection did not prove it"
        ),
    })
}

/// The management port a kilnd listens on by default (the same as glusterd's).
pub const DEFAULT_MGMT_PORT: u16 = 24007;
/// The first port tried for a brick.
pub const FIRST_BRICK_PORT: u16 = 24100;
/// How long a brick may take to bind its port after being spawned.
const BRICK_START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a brick may take to exit after SIGTERM before it gets SIGKILL.
const BRICK_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Connect timeout for probes of bricks and calls to other kilnds.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a call to another kilnd may take (it may start bricks).
const PEER_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// One brick of a volume.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct BrickDef {
    /// The host as given (IP address or name).
    pub host: String,
    /// The management port of the host's kilnd, when not [`DEFAULT_MGMT_PORT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mgmt_port: Option<u16>,
    /// The brick directory on that host.
    pub dir: PathBuf,
    /// The port the brick serves (or last served) on.
    #[serde(default)]
    pub port: Option<u16>,
    /// The brick process, while it runs (a pid on the brick's host).
    #[serde(default)]
    pub pid: Option<u32>,
}

impl BrickDef {
    /// `HOST:/DIR`, or `HOST:PORT:/DIR` with a management port.
    pub fn spec(&self) -> String {
        match self.mgmt_port {
            Some(p) => format!("{}:{p}:{}", self.host, self.dir.display()),
            None => format!("{}:{}", self.host, self.dir.display()),
        }
    }

    /// The host's address.
    pub fn ip(&self) -> Result<IpAddr, String> {
        resolve(&self.host)
    }

    /// The management address of the brick's host.
    pub fn mgmt_addr(&self) -> Result<SocketAddr, String> {
        Ok(SocketAddr::new(
            self.ip()?,
            self.mgmt_port.unwrap_or(DEFAULT_MGMT_PORT),
        ))
    }
}

/// Where a volume is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum VolState {
    /// Defined, never started.
    Created,
    /// Its bricks should run.
    Started,
    /// Its bricks were stopped.
    Stopped,
}

impl VolState {
    fn word(self) -> &'static str {
        match self {
            VolState::Created => "Created",
            VolState::Started => "Started",
            VolState::Stopped => "Stopped",
        }
    }
}

/// A volume definition.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct VolumeDef {
    /// The volume's name.
    pub name: String,
    /// Random, fixed at create: tells two volumes of the same name apart.
    pub id: String,
    /// Bricks per replica set.
    pub replica: usize,
    /// The bricks, replica sets in order (bricks `k*replica .. (k+1)*replica` are set `k`).
    pub bricks: Vec<BrickDef>,
    /// Created, started or stopped.
    pub state: VolState,
    /// `None` on the authority; on a peer, the authority's management address.
    #[serde(default)]
    pub authority: Option<String>,
    /// Address ranges clients of the bricks may connect from (empty: anyone); each brick
    /// gets them as `--allow`.
    #[serde(default)]
    pub allow: Vec<String>,
}

/// Checks a volume name: 1 to 64 of `A-Z a-z 0-9 _ -`, not starting with `-`.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "bad volume name {name:?}: use 1 to 64 letters, digits, '_' or '-' (not first)"
        ))
    }
}

/// Parses `HOST:/DIR` or `HOST:PORT:/DIR` (PORT: the management port of HOST's kilnd).
pub fn parse_brick(s: &str) -> Result<BrickDef, String> {
    let want = "want HOST:/DIR or HOST:MGMTPORT:/DIR with an absolute directory";
    let i = s
        .find(":/")
        .ok_or_else(|| format!("bad brick {s:?}: {want}"))?;
    let (hp, dir) = (&s[..i], &s[i + 1..]);
    let (host, mgmt_port) = match hp.rsplit_once(':') {
        Some((h, p)) => (
            h,
            Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("bad brick {s:?}: {p:?} is not a port; {want}"))?,
            ),
        ),
        None => (hp, None),
    };
    if host.is_empty() {
        return Err(format!("bad brick {s:?}: no host; {want}"));
    }
    let mut clean = PathBuf::from("/");
    for c in Path::new(dir).components() {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => clean.push(n),
            Component::CurDir | Component::ParentDir | Component::Prefix(_) => {
                return Err(format!(
                    "bad brick {s:?}: the directory may not contain '.' or '..'"
                ))
            }
        }
    }
    if clean == Path::new("/") {
        return Err(format!(
            "bad brick {s:?}: the root directory cannot be a brick"
        ));
    }
    Ok(BrickDef {
        host: host.to_owned(),
        mgmt_port,
        dir: clean,
        port: None,
        pid: None,
    })
}

/// The first address `host` resolves to (IPv4 preferred).
pub fn resolve(host: &str) -> Result<IpAddr, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    let addrs: Vec<SocketAddr> = (host, 0)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve host {host:?}: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .map(|a| a.ip())
        .ok_or_else(|| format!("host {host:?} has no address"))
}

/// True when this host can bind `ip`: the brick is ours to run.
fn is_local(ip: IpAddr) -> bool {
    !ip.is_unspecified() && TcpListener::bind((ip, 0)).is_ok()
}

/// The volfile a brick runs: io-stats (`NAME-brick-N`) → marks → dispatch → posix.
pub fn brick_volfile(volume: &str, index: usize, dir: &Path) -> Volfile {
    Volfile::linear(vec![
        (format!("{volume}-brick-{index}"), LayerKind::IoStats {}),
        (
            "marks".into(),
            LayerKind::Marks {
                directory: dir.to_owned(),
            },
        ),
        ("dispatch".into(), LayerKind::Dispatch {}),
        (
            "posix".into(),
            LayerKind::Posix {
                directory: dir.to_owned(),
            },
        ),
    ])
}

/// The client volfile of a started volume: io-stats `NAME` → distribute `NAME-dht` (with more
/// than one replica set) → replicate `NAME-replicate-K` (with replica > 1) → protocol-client
/// `NAME-client-N` for brick N.
pub fn client_volfile(def: &VolumeDef) -> Result<Volfile, String> {
    let name = &def.name;
    let mut clients = Vec::new();
    for (i, b) in def.bricks.iter().enumerate() {
        let port = b.port.ok_or_else(|| {
            format!(
                "volume {name}: brick {} has no port yet (start the volume)",
                b.spec()
            )
        })?;
        clients.push(LayerDef {
            name: format!("{name}-client-{i}"),
            subvolumes: Vec::new(),
            kind: LayerKind::ProtocolClient {
                remote: format!("tcp:{}", SocketAddr::new(b.ip()?, port)),
            },
        });
    }
    let replica = def.replica.max(1);
    let sets = def.bricks.len() / replica;
    let mut layers = Vec::new();
    let mut set_tops = Vec::new();
    let mut replicates = Vec::new();
    if replica > 1 {
        for k in 0..sets {
            let lname = format!("{name}-replicate-{k}");
            set_tops.push(lname.clone());
            replicates.push(LayerDef {
                name: lname,
                subvolumes: clients[k * replica..(k + 1) * replica]
                    .iter()
                    .map(|c| c.name.clone())
                    .collect(),
                kind: LayerKind::Replicate { quorum: None },
            });
        }
    } else {
        set_tops = clients.iter().map(|c| c.name.clone()).collect();
    }
    let below_top = if sets > 1 {
        layers.push(LayerDef {
            name: format!("{name}-dht"),
            subvolumes: set_tops,
            kind: LayerKind::Distribute {},
        });
        format!("{name}-dht")
    } else {
        set_tops[0].clone()
    };
    layers.insert(
        0,
        LayerDef {
            name: name.clone(),
            subvolumes: vec![below_top],
            kind: LayerKind::IoStats {},
        },
    );
    layers.extend(replicates);
    layers.extend(clients);
    let v = Volfile { layers };
    v.check().map_err(|e| format!("volume {name}: {e}"))?;
    Ok(v)
}

/// The stack behind the management port: every file fop fails (error-gen, ENOSYS) over an
/// empty directory; only HELLO and MGMT mean anything there.
pub fn placeholder_volfile(state_dir: &Path) -> Volfile {
    Volfile::linear(vec![
        (
            "mgmt".into(),
            LayerKind::ErrorGen {
                fops: Vec::new(),
                error: libc::ENOSYS.to_string(),
                probability: 1.0,
                seed: 1,
            },
        ),
        (
            "mgmt-root".into(),
            LayerKind::Posix {
                directory: state_dir.join("mgmt-root"),
            },
        ),
    ])
}

/// Sends one MGMT request to the kilnd at `addr`, proving `secret` (the management secret) and
/// requiring `addr` to prove it back, and returns the reply's JSON (an `"ok": false` reply
/// becomes an error carrying its message). Used between kilnds; clients use
/// `kiln_client::mgmt::call`.
pub fn call_peer(addr: SocketAddr, secret: &[u8], req: &Value) -> Result<Value, String> {
    let mut s = PeerConn::connect(addr, secret)?;
    s.call(req)
}

/// An authenticated connection to another kilnd's management port.
struct PeerConn {
    addr: SocketAddr,
    sock: TcpStream,
    next_id: u64,
}

impl PeerConn {
    /// Connects and runs the handshake: this kilnd proves the secret, and so must the other
    /// one — a kilnd that does not ask for it, or cannot prove it, gets no command (commands
    /// carry volume secrets).
    fn connect(addr: SocketAddr, secret: &[u8]) -> Result<PeerConn, String> {
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
            proof: crate::auth::mac(secret, &client_transcript(&hello.nonce, &nonce)),
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
        if !crate::auth::verify(
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
    fn local_ip(&self) -> Result<IpAddr, String> {
        self.sock
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| format!("{}: {e}", self.addr))
    }

    /// Sends one request frame and reads its reply: status, arguments, payload.
    fn exchange(
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

    fn call(&mut self, req: &Value) -> Result<Value, String> {
        use kiln_proto::codec::Wire;
        let addr = self.addr;
        let args = kiln_proto::ops::MgmtReq {
            json: req.to_string().into_bytes(),
        }
        .to_wire();
        let (status, _, payload) = self.exchange(kiln_proto::Op::Mgmt, &args)?;
        if status != 0 {
            return Err(format!(
                "kilnd at {addr} refused the request: {}",
                io::Error::from_raw_os_error(status as i32)
            ));
        }
        let v: Value = serde_json::from_slice(&payload)
            .map_err(|e| format!("kilnd at {addr}: bad reply: {e}"))?;
        if v["ok"] == true {
            Ok(v)
        } else {
            Err(v["error"]
                .as_str()
                .map(|e| format!("{addr}: {e}"))
                .unwrap_or_else(|| format!("kilnd at {addr}: reply without \"ok\"")))
        }
    }
}

/// Brick processes this kilnd spawned (so it can reap them) — everything else it knows about
/// bricks is on disk.
#[derive(Default)]
struct Procs {
    children: HashMap<u32, Child>,
}

/// The volume manager of one kilnd.
pub struct Manager {
    state: PathBuf,
    /// The program and leading arguments that run a brick.
    exe: Vec<OsString>,
    /// This kilnd's management port (for peers to call back, recorded as authority).
    mgmt_port: Mutex<u16>,
    /// Serialises commands: one change at a time, and the children table.
    procs: Mutex<Procs>,
    /// The management secret: clients and other kilnds prove it, and this kilnd proves it to
    /// other kilnds.
    secret: Arc<[u8]>,
    /// The heal service's state (see [`crate::healer`]).
    healer: crate::healer::Healer,
    /// Where brick ports start (`--brick-port-base`).
    first_brick_port: Mutex<u16>,
}

/// The command that runs a brick: this executable, as `kilnd` or as `kiln server`.
pub fn brick_command() -> io::Result<Vec<OsString>> {
    let exe = std::env::current_exe()?;
    // A binary rebuilt while running shows as "PATH (deleted)"; the new file is what we want.
    let s = exe.to_string_lossy();
    let exe = match s.strip_suffix(" (deleted)") {
        Some(p) => PathBuf::from(p),
        None => exe,
    };
    let is_kiln = exe.file_name().is_some_and(|n| n == "kiln");
    let mut cmd = vec![exe.into_os_string()];
    if is_kiln {
        cmd.push("server".into());
    }
    Ok(cmd)
}

impl Manager {
    /// Opens (creating) the state directory, and loads the management secret from
    /// `secret_file`, default `STATE_DIR/mgmt.secret` — a missing file is created with a new
    /// random secret (mode 0600). `exe` runs a brick (see [`brick_command`]).
    pub fn open(
        state: &Path,
        exe: Vec<OsString>,
        secret_file: Option<&Path>,
    ) -> Result<Arc<Manager>, String> {
        for d in [state.join("vols"), state.join("mgmt-root")] {
            fs::create_dir_all(&d)
                .map_err(|e| format!("cannot create state directory {}: {e}", d.display()))?;
        }
        let path = secret_file
            .map(Path::to_owned)
            .unwrap_or_else(|| state.join(MGMT_SECRET_FILE));
        let existed = path.exists();
        let secret = crate::auth::load_or_create(&path)
            .map_err(|e| format!("management secret {}: {e}", path.display()))?;
        if !existed {
            tracing::info!(
                "{} is this kilnd's management secret: `kiln volume` reads it as root on this \
                 host; every other kilnd of the cluster needs a copy",
                path.display()
            );
        }
        if let Ok(m) = fs::metadata(&path) {
            use std::os::unix::fs::PermissionsExt;
            if m.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    "management secret {} is readable by others (mode {:o}): chmod 600 it",
                    path.display(),
                    m.permissions().mode() & 0o777
                );
            }
        }
        Ok(Arc::new(Manager {
            state: state.to_owned(),
            exe,
            mgmt_port: Mutex::new(DEFAULT_MGMT_PORT),
            procs: Mutex::default(),
            secret: secret.into(),
            healer: crate::healer::Healer::default(),
            first_brick_port: Mutex::new(FIRST_BRICK_PORT),
        }))
    }

    /// The heal service's state.
    pub fn healer(&self) -> &crate::healer::Healer {
        &self.healer
    }

    /// The management secret, for the server's handshake (`Server::with_secret`).
    pub fn secret(&self) -> Vec<u8> {
        self.secret.to_vec()
    }

    /// Brick ports are allocated from `port` up (default [`FIRST_BRICK_PORT`]).
    pub fn set_first_brick_port(&self, port: u16) {
        *lock_port(&self.first_brick_port) = port;
    }

    /// Records the port the management server bound.
    pub fn set_mgmt_port(&self, port: u16) {
        *self.mgmt_port.lock().unwrap_or_else(|e| e.into_inner()) = port;
    }

    /// The handler to attach to the management server (together with [`Manager::secret`]).
    pub fn handler(self: &Arc<Self>) -> Handler {
        self.clone()
    }

    /// [`call_peer`] with this kilnd's secret.
    fn call_peer(&self, addr: SocketAddr, req: &Value) -> Result<Value, String> {
        call_peer(addr, &self.secret, req)
    }

    /// Answers one request from `caller`: only [`OPEN_COMMANDS`] without authentication.
    pub fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        let out = match serde_json::from_slice::<Value>(req) {
            Ok(v) if v.is_object() => {
                let cmd = v["cmd"].as_str().unwrap_or_default();
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
                    return refusal(&what).to_string().into_bytes();
                }
                self.dispatch(&v)
            }
            Ok(_) => Err("bad request: not a JSON object".into()),
            Err(e) => Err(format!("bad request: {e}")),
        };
        let v = match out {
            Ok(mut v) => {
                if !v.is_object() {
                    v = json!({ "result": v });
                }
                v["ok"] = true.into();
                v
            }
            Err(e) => {
                tracing::info!("mgmt: {e}");
                json!({ "ok": false, "error": e })
            }
        };
        v.to_string().into_bytes()
    }

    /// Runs one request of an authenticated caller (or an open command).
    fn dispatch(&self, req: &Value) -> Result<Value, String> {
        let cmd = req["cmd"]
            .as_str()
            .ok_or("bad request: no \"cmd\" string")?;
        tracing::debug!(cmd, "mgmt request");
        // A change to a volume this kilnd only caches goes to the authority — without holding
        // our lock, since the authority will call back (brick-start) to this kilnd.
        if matches!(cmd, "start" | "stop" | "delete" | "set") {
            let name = str_arg(req, "name")?;
            check_name(name)?;
            if let Ok(def) = self.load(name) {
                if let Some(auth) = &def.authority {
                    let addr = parse_sockaddr(auth)?;
                    return self
                        .call_peer(addr, req)
                        .map_err(|e| format!("volume {name} (authority {auth}): {e}"));
                }
            }
        }
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        match cmd {
            "create" => self.create(req),
            "start" => self.start(&mut procs, req),
            "stop" => self.stop(&mut procs, req),
            "set" => self.set(&mut procs, req),
            "delete" => self.delete(req),
            "info" => self.info(req),
            "list" => self.list(),
            "status" => self.status(&mut procs, req),
            "volfile" => self.volfile(req),
            "brick-start" => self.brick_start(&mut procs, req),
            "brick-stop" => self.brick_stop(&mut procs, req),
            "brick-report" => self.brick_report(req),
            "peer-sync" => self.peer_sync(req),
            "peer-forget" => self.peer_forget(req),
            other => Err(format!(
                "unknown command {other:?} (known: create, start, stop, delete, info, list, \
                 status, volfile)"
            )),
        }
    }

    // ---- state on disk ----

    fn vol_dir(&self, name: &str) -> PathBuf {
        self.state.join("vols").join(name)
    }

    fn secret_path(&self, name: &str) -> PathBuf {
        self.vol_dir(name).join("secret")
    }

    /// Brick `i`'s Unix socket (`STATE_DIR/run/NAME-i.sock`), unless the path is too long
    /// for one.
    fn brick_socket(&self, name: &str, i: usize) -> Option<PathBuf> {
        let p = self.state.join("run").join(format!("{name}-{i}.sock"));
        (p.as_os_str().len() < 100).then_some(p)
    }

    /// The client volfile, where each brick of this host is offered at its Unix socket first
    /// (clients use it when the TCP address names their own host; see
    /// `kiln_client::Volume::from_volfile`).
    pub(crate) fn client_volfile_here(&self, def: &VolumeDef) -> Result<Volfile, String> {
        let mut v = client_volfile(def)?;
        for (i, b) in def.bricks.iter().enumerate() {
            if !b.ip().is_ok_and(is_local) {
                continue;
            }
            let Some(sock) = self.brick_socket(&def.name, i) else {
                continue;
            };
            let lname = format!("{}-client-{i}", def.name);
            for l in v.layers.iter_mut().filter(|l| l.name == lname) {
                if let LayerKind::ProtocolClient { remote } = &mut l.kind {
                    *remote = format!("unix:{},{remote}", sock.display());
                }
            }
        }
        Ok(v)
    }

    fn brick_volfile_path(&self, name: &str, i: usize) -> PathBuf {
        self.vol_dir(name).join("bricks").join(format!("{i}.toml"))
    }

    fn load(&self, name: &str) -> Result<VolumeDef, String> {
        let p = self.vol_dir(name).join("volume.json");
        let text = match fs::read(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(format!("volume {name} does not exist"))
            }
            Err(e) => return Err(format!("cannot read {}: {e}", p.display())),
        };
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", p.display()))
    }

    /// Every definition (and cached copy) this kilnd holds, by name.
    pub(crate) fn load_all(&self) -> Vec<VolumeDef> {
        let mut names: Vec<String> = fs::read_dir(self.state.join("vols"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| check_name(n).is_ok())
            .collect();
        names.sort();
        names
            .iter()
            .filter_map(|n| match self.load(n) {
                Ok(d) => Some(d),
                Err(e) => {
                    if self.vol_dir(n).join("volume.json").exists() {
                        tracing::warn!("skipping volume {n}: {e}");
                    }
                    None
                }
            })
            .collect()
    }

    /// Writes the definition: temp file, fsync, rename, fsync of the directory.
    fn save(&self, def: &VolumeDef) -> Result<(), String> {
        let dir = self.vol_dir(&def.name);
        let text = serde_json::to_vec_pretty(def).expect("a definition serialises");
        write_atomic(&dir, "volume.json", &text, 0o644)
    }

    fn write_secret(&self, name: &str, hex: &str) -> Result<(), String> {
        write_atomic(
            &self.vol_dir(name),
            "secret",
            format!("{hex}\n").as_bytes(),
            0o600,
        )
    }

    pub(crate) fn read_secret(&self, name: &str) -> Result<String, String> {
        let p = self.secret_path(name);
        fs::read_to_string(&p)
            .map(|s| s.trim().to_owned())
            .map_err(|e| {
                format!(
                    "cannot read the secret of volume {name} ({}): {e}",
                    p.display()
                )
            })
    }

    // ---- commands ----

    fn create(&self, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        check_name(name)?;
        let replica = match &req["replica"] {
            Value::Null => 1,
            v => v
                .as_u64()
                .filter(|r| (1..=64).contains(r))
                .ok_or_else(|| format!("bad replica count {v}: want a number from 1 to 64"))?
                as usize,
        };
        let specs: Vec<&str> = req["bricks"]
            .as_array()
            .map(|a| a.iter().filter_map(|b| b.as_str()).collect())
            .unwrap_or_default();
        if specs.is_empty() {
            return Err(format!(
                "volume {name}: no bricks given (want HOST:/DIR, at least {replica})"
            ));
        }
        if !specs.len().is_multiple_of(replica) {
            return Err(format!(
                "volume {name}: {} brick(s) do not make replica sets of {replica}: give a \
                 multiple of {replica} bricks",
                specs.len()
            ));
        }
        if self.vol_dir(name).join("volume.json").exists() {
            return Err(format!("volume {name} already exists"));
        }
        let allow = allow_arg(req)?;
        let mut bricks = Vec::new();
        let mut ips = Vec::new();
        for s in &specs {
            let b = parse_brick(s)?;
            ips.push(b.ip().map_err(|e| format!("brick {s}: {e}"))?);
            bricks.push(b);
        }
        // Same host (by address), same or nested directory: refuse.
        for j in 0..bricks.len() {
            for i in 0..j {
                if ips[i] != ips[j] {
                    continue;
                }
                let (a, b) = (&bricks[i], &bricks[j]);
                if a.dir == b.dir {
                    return Err(format!("brick {} is given twice", b.spec()));
                }
                if b.dir.starts_with(&a.dir) || a.dir.starts_with(&b.dir) {
                    return Err(format!(
                        "bricks {} and {} nest: a brick may not be inside another",
                        a.spec(),
                        b.spec()
                    ));
                }
            }
        }
        for other in self.load_all() {
            for ob in &other.bricks {
                let Ok(oip) = ob.ip() else { continue };
                for (b, ip) in bricks.iter().zip(&ips) {
                    if *ip == oip && (b.dir.starts_with(&ob.dir) || ob.dir.starts_with(&b.dir)) {
                        return Err(format!(
                            "brick {} overlaps brick {} of volume {}",
                            b.spec(),
                            ob.spec(),
                            other.name
                        ));
                    }
                }
            }
        }
        for (b, ip) in bricks.iter().zip(&ips) {
            if is_local(*ip) {
                fs::create_dir_all(&b.dir).map_err(|e| {
                    format!("cannot create brick directory {}: {e}", b.dir.display())
                })?;
            }
        }
        let mut raw = [0u8; 32];
        random(&mut raw)?;
        let secret = hex(&raw);
        random(&mut raw[..8])?;
        let def = VolumeDef {
            name: name.to_owned(),
            id: hex(&raw[..8]),
            replica,
            bricks,
            state: VolState::Created,
            authority: None,
            allow,
        };
        fs::create_dir_all(self.vol_dir(name).join("bricks"))
            .map_err(|e| format!("cannot create {}: {e}", self.vol_dir(name).display()))?;
        self.write_secret(name, &secret)?;
        self.save(&def)?;
        // Every other host with a brick gets a copy (and creates its brick directories).
        let mut synced = Vec::new();
        for addr in self.peers(&def) {
            if let Err(e) = self.sync_to(addr, &def, true) {
                for a in synced {
                    let _ = self.call_peer(a, &json!({ "cmd": "peer-forget", "name": name }));
                }
                let _ = fs::remove_dir_all(self.vol_dir(name));
                return Err(format!("volume {name} not created: {e}"));
            }
            synced.push(addr);
        }
        tracing::info!("created volume {name} ({} bricks)", def.bricks.len());
        Ok(json!({ "volume": def_json(&def) }))
    }

    fn start(&self, procs: &mut Procs, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        let force = req["force"].as_bool().unwrap_or(false);
        let mut def = self.load(name)?;
        if def.state == VolState::Started && !force {
            return Err(format!(
                "volume {name} is already started (`start {name} force` restarts bricks that \
                 are down)"
            ));
        }
        let secret = self.read_secret(name)?;
        let mut errors = Vec::new();
        let mut up = 0;
        for i in 0..def.bricks.len() {
            let b = def.bricks[i].clone();
            let r = match b.ip() {
                Ok(ip) if is_local(ip) => self.ensure_brick(procs, &def, i),
                Ok(_) => self.remote_brick_start(&def, i, &secret),
                Err(e) => Err(e),
            };
            match r {
                Ok((port, pid)) => {
                    def.bricks[i].port = Some(port);
                    def.bricks[i].pid = Some(pid);
                    up += 1;
                }
                Err(e) => errors.push(format!("brick {}: {e}", b.spec())),
            }
        }
        if up > 0 {
            def.state = VolState::Started;
        }
        self.save(&def)?;
        let warnings = self.sync_all(&def);
        if !errors.is_empty() {
            return Err(format!(
                "volume {name}: {} of {} bricks did not start: {}",
                errors.len(),
                def.bricks.len(),
                errors.join("; ")
            ));
        }
        tracing::info!("started volume {name}");
        Ok(json!({ "volume": def_json(&def), "warnings": warnings }))
    }

    fn stop(&self, procs: &mut Procs, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        let mut def = self.load(name)?;
        if def.state != VolState::Started {
            return Err(format!("volume {name} is not started"));
        }
        let mut errors = Vec::new();
        for i in 0..def.bricks.len() {
            let b = def.bricks[i].clone();
            let r = match b.ip() {
                Ok(ip) if is_local(ip) => {
                    self.stop_brick(procs, &def, i);
                    Ok(())
                }
                Ok(_) => b.mgmt_addr().and_then(|a| {
                    self.call_peer(a, &json!({ "cmd": "brick-stop", "name": name, "index": i }))
                        .map(|_| ())
                }),
                Err(e) => Err(e),
            };
            match r {
                Ok(()) => def.bricks[i].pid = None,
                Err(e) => errors.push(format!("brick {}: {e}", b.spec())),
            }
        }
        def.state = VolState::Stopped;
        self.save(&def)?;
        let warnings = self.sync_all(&def);
        if !errors.is_empty() {
            return Err(format!(
                "volume {name} stopped, but {} brick(s) may still run: {}",
                errors.len(),
                errors.join("; ")
            ));
        }
        tracing::info!("stopped volume {name}");
        Ok(json!({ "volume": def_json(&def), "warnings": warnings }))
    }

    /// Changes a volume's options (today: `allow`, the address ranges its bricks take clients
    /// from). The bricks of a started volume are restarted with the new options; clients
    /// reconnect by themselves.
    fn set(&self, procs: &mut Procs, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        let mut def = self.load(name)?;
        def.allow = allow_arg(req)?;
        self.save(&def)?;
        let mut warnings = self.sync_all(&def);
        if def.state == VolState::Started {
            let secret = self.read_secret(name)?;
            for i in 0..def.bricks.len() {
                let b = def.bricks[i].clone();
                let r = match b.ip() {
                    Ok(ip) if is_local(ip) => {
                        self.stop_brick(procs, &def, i);
                        def.bricks[i].pid = None;
                        self.ensure_brick(procs, &def, i)
                    }
                    Ok(_) => b
                        .mgmt_addr()
                        .and_then(|a| {
                            self.call_peer(
                                a,
                                &json!({ "cmd": "brick-stop", "name": name, "index": i }),
                            )
                        })
                        .and_then(|_| {
                            def.bricks[i].pid = None;
                            self.remote_brick_start(&def, i, &secret)
                        }),
                    Err(e) => Err(e),
                };
                match r {
                    Ok((port, pid)) => {
                        def.bricks[i].port = Some(port);
                        def.bricks[i].pid = Some(pid);
                    }
                    Err(e) => warnings.push(format!("brick {}: not restarted: {e}", b.spec())),
                }
            }
            self.save(&def)?;
            warnings.extend(self.sync_all(&def));
        }
        tracing::info!(volume = name, allow = ?def.allow, "volume options set");
        Ok(json!({ "volume": def_json(&def), "warnings": warnings }))
    }

    fn delete(&self, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        let def = self.load(name)?;
        if def.state == VolState::Started {
            return Err(format!("volume {name} is started: stop it first"));
        }
        let mut warnings = Vec::new();
        for addr in self.peers(&def) {
            if let Err(e) = self.call_peer(addr, &json!({ "cmd": "peer-forget", "name": name })) {
                warnings.push(format!("{addr} keeps a stale copy: {e}"));
            }
        }
        fs::remove_dir_all(self.vol_dir(name))
            .map_err(|e| format!("cannot remove volume {name}: {e}"))?;
        tracing::info!("deleted volume {name} (brick data left in place)");
        Ok(json!({ "volume": name, "deleted": true, "warnings": warnings }))
    }

    fn info(&self, req: &Value) -> Result<Value, String> {
        let defs = match req["name"].as_str() {
            Some(n) => {
                check_name(n)?;
                vec![self.load(n)?]
            }
            None => self.load_all(),
        };
        Ok(json!({ "volumes": defs.iter().map(def_json).collect::<Vec<_>>() }))
    }

    fn list(&self) -> Result<Value, String> {
        let names: Vec<String> = self.load_all().into_iter().map(|d| d.name).collect();
        Ok(json!({ "volumes": names }))
    }

    fn status(&self, procs: &mut Procs, req: &Value) -> Result<Value, String> {
        let defs = match req["name"].as_str() {
            Some(n) => {
                check_name(n)?;
                vec![self.load(n)?]
            }
            None => self.load_all(),
        };
        let mut vols = Vec::new();
        for def in &defs {
            let mut bricks = Vec::new();
            for (i, b) in def.bricks.iter().enumerate() {
                let ip = b.ip().ok();
                let local = ip.is_some_and(is_local);
                let online = match (ip, b.port) {
                    (Some(ip), Some(port)) if def.state == VolState::Started => {
                        let pid_ok = !local
                            || b.pid.is_some_and(|pid| {
                                self.pid_runs_brick(
                                    procs,
                                    pid,
                                    &self.brick_volfile_path(&def.name, i),
                                )
                            });
                        pid_ok && port_answers(SocketAddr::new(ip, port))
                    }
                    _ => false,
                };
                bricks.push(json!({
                    "brick": b.spec(),
                    "host": b.host,
                    "dir": b.dir,
                    "port": b.port,
                    "pid": b.pid,
                    "online": online,
                }));
            }
            vols.push(json!({
                "name": def.name,
                "state": def.state,
                "authority": def.authority,
                "bricks": bricks,
                "heal": self.healer.view(&def.name),
            }));
        }
        Ok(json!({ "volumes": vols }))
    }

    fn volfile(&self, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        check_name(name)?;
        let def = self.load(name)?;
        if def.state != VolState::Started {
            return Err(format!("volume {name} is not started"));
        }
        let v = self.client_volfile_here(&def)?;
        Ok(json!({ "volume": name, "volfile": v.to_toml() }))
    }

    /// Peer side of `start`: caches the definition and the secret, runs brick `index`.
    fn brick_start(&self, procs: &mut Procs, req: &Value) -> Result<Value, String> {
        let def = self.take_peer_def(req)?;
        let i = index_arg(req, &def)?;
        if let Some(s) = req["secret"].as_str() {
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
        def.bricks[i].port = Some(port);
        def.bricks[i].pid = Some(pid);
        def.state = VolState::Started;
        self.save(&def)?;
        Ok(json!({ "port": port, "pid": pid }))
    }

    /// Peer side of `stop`.
    fn brick_stop(&self, procs: &mut Procs, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        check_name(name)?;
        let mut def = self.load(name)?;
        let i = index_arg(req, &def)?;
        self.stop_brick(procs, &def, i);
        def.bricks[i].pid = None;
        self.save(&def)?;
        Ok(json!({ "stopped": i }))
    }

    /// Stores a copy of a definition sent by its authority.
    fn peer_sync(&self, req: &Value) -> Result<Value, String> {
        let def = self.take_peer_def(req)?;
        if let Some(s) = req["secret"].as_str() {
            self.write_secret(&def.name, s)?;
        }
        for b in &def.bricks {
            if b.ip().is_ok_and(is_local) {
                fs::create_dir_all(&b.dir).map_err(|e| {
                    format!("cannot create brick directory {}: {e}", b.dir.display())
                })?;
            }
        }
        Ok(json!({ "volume": def.name }))
    }

    fn peer_forget(&self, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        check_name(name)?;
        match self.load(name) {
            Ok(d) if d.authority.is_some() => {
                fs::remove_dir_all(self.vol_dir(name))
                    .map_err(|e| format!("cannot remove the copy of volume {name}: {e}"))?;
            }
            Ok(_) => return Err(format!("this kilnd is the authority of volume {name}")),
            Err(_) => {}
        }
        Ok(json!({ "volume": name }))
    }

    /// The `def` of a peer request, checked and saved as this kilnd's cached copy (keeping the
    /// pids of bricks this kilnd runs).
    fn take_peer_def(&self, req: &Value) -> Result<VolumeDef, String> {
        let mut def: VolumeDef = serde_json::from_value(req["def"].clone())
            .map_err(|e| format!("bad request: \"def\": {e}"))?;
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
    fn peers(&self, def: &VolumeDef) -> Vec<SocketAddr> {
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
    fn sync_to(&self, addr: SocketAddr, def: &VolumeDef, with_secret: bool) -> Result<(), String> {
        let mut c = PeerConn::connect(addr, &self.secret)?;
        let mut copy = def.clone();
        copy.authority = Some(self.authority_addr(&c)?);
        let mut req = json!({ "cmd": "peer-sync", "def": copy });
        if with_secret {
            req["secret"] = self.read_secret(&def.name)?.into();
        }
        c.call(&req).map(|_| ())
    }

    fn authority_addr(&self, c: &PeerConn) -> Result<String, String> {
        let port = *self.mgmt_port.lock().unwrap_or_else(|e| e.into_inner());
        Ok(format!("tcp:{}", SocketAddr::new(c.local_ip()?, port)))
    }

    /// Best effort: every peer gets the new definition; returns what failed.
    fn sync_all(&self, def: &VolumeDef) -> Vec<String> {
        self.peers(def)
            .into_iter()
            .filter_map(|a| {
                self.sync_to(a, def, false)
                    .err()
                    .map(|e| format!("{a} keeps an old copy of the definition: {e}"))
            })
            .collect()
    }

    fn remote_brick_start(
        &self,
        def: &VolumeDef,
        i: usize,
        secret: &str,
    ) -> Result<(u16, u32), String> {
        let addr = def.bricks[i].mgmt_addr()?;
        let mut c = PeerConn::connect(addr, &self.secret)?;
        let mut copy = def.clone();
        copy.authority = Some(self.authority_addr(&c)?);
        let r = c.call(&json!({
            "cmd": "brick-start",
            "def": copy,
            "index": i,
            "secret": secret,
        }))?;
        match (r["port"].as_u64(), r["pid"].as_u64()) {
            (Some(port), Some(pid)) => Ok((port as u16, pid as u32)),
            _ => Err(format!("{addr}: brick-start reply without port and pid")),
        }
    }

    // ---- brick processes ----

    /// Restarts the local bricks of every started volume (adopting those still running).
    /// Called once at startup, before the management port answers.
    pub fn restore(&self) {
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        let mut moved = Vec::new();
        for mut def in self.load_all() {
            if def.state != VolState::Started {
                continue;
            }
            let mut changed = false;
            let mut ports_changed = Vec::new();
            for i in 0..def.bricks.len() {
                if !def.bricks[i].ip().is_ok_and(is_local) {
                    continue;
                }
                match self.ensure_brick(&mut procs, &def, i) {
                    Ok((port, pid)) => {
                        let b = &mut def.bricks[i];
                        changed |= b.port != Some(port) || b.pid != Some(pid);
                        if b.port != Some(port) {
                            ports_changed.push(i);
                        }
                        b.port = Some(port);
                        b.pid = Some(pid);
                    }
                    Err(e) => tracing::warn!(
                        "volume {}: brick {} did not start: {e}",
                        def.name,
                        def.bricks[i].spec()
                    ),
                }
            }
            if changed {
                if let Err(e) = self.save(&def) {
                    tracing::warn!("volume {}: {e}", def.name);
                }
            }
            tracing::info!("volume {}: restored", def.name);
            if !ports_changed.is_empty() {
                moved.push((def, ports_changed));
            }
        }
        drop(procs);
        // Bricks that came back on another port: the authority and the other peers must
        // hand out the new port in volfiles.
        for (def, bricks) in moved {
            let r = match &def.authority {
                None => {
                    let w = self.sync_all(&def);
                    if w.is_empty() {
                        Ok(())
                    } else {
                        Err(w.join("; "))
                    }
                }
                Some(auth) => parse_sockaddr(auth).and_then(|a| {
                    bricks.iter().try_for_each(|&i| {
                        let b = &def.bricks[i];
                        let req = json!({
                            "cmd": "brick-report", "name": def.name, "id": def.id,
                            "index": i, "port": b.port, "pid": b.pid,
                        });
                        self.call_peer(a, &req).map(|_| ())
                    })
                }),
            };
            if let Err(e) = r {
                tracing::warn!("volume {}: new brick ports not passed on: {e}", def.name);
            }
        }
    }

    /// Authority side: a peer restarted one of its bricks on another port.
    fn brick_report(&self, req: &Value) -> Result<Value, String> {
        let name = str_arg(req, "name")?;
        check_name(name)?;
        let mut def = self.load(name)?;
        if def.authority.is_some() || req["id"].as_str() != Some(def.id.as_str()) {
            return Err(format!("this kilnd is not the authority of volume {name}"));
        }
        let i = index_arg(req, &def)?;
        def.bricks[i].port = req["port"].as_u64().map(|p| p as u16);
        def.bricks[i].pid = req["pid"].as_u64().map(|p| p as u32);
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
        Ok(json!({ "volume": name, "warnings": warnings }))
    }

    /// True when `pid` is alive and runs the brick whose volfile is `volfile`.
    fn pid_runs_brick(&self, procs: &mut Procs, pid: u32, volfile: &Path) -> bool {
        if let Some(c) = procs.children.get_mut(&pid) {
            if !matches!(c.try_wait(), Ok(None)) {
                procs.children.remove(&pid);
                return false;
            }
            return true;
        }
        // Not our child (adopted after a restart): check what it runs, and that it is not a
        // zombie waiting for some other parent.
        let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
            return false;
        };
        let want = volfile.as_os_str().as_encoded_bytes();
        let runs = cmdline.split(|b| *b == 0).any(|a| a == want);
        let zombie = fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        runs && !zombie
    }

    /// Makes brick `i` of `def` run on this host; returns its port and pid.
    fn ensure_brick(
        &self,
        procs: &mut Procs,
        def: &VolumeDef,
        i: usize,
    ) -> Result<(u16, u32), String> {
        let b = &def.bricks[i];
        let ip = b.ip()?;
        let vf_path = self.brick_volfile_path(&def.name, i);
        if let (Some(port), Some(pid)) = (b.port, b.pid) {
            if self.pid_runs_brick(procs, pid, &vf_path) && port_answers(SocketAddr::new(ip, port))
            {
                return Ok((port, pid));
            }
        }
        fs::create_dir_all(&b.dir)
            .map_err(|e| format!("cannot create brick directory {}: {e}", b.dir.display()))?;
        let vf = brick_volfile(&def.name, i, &b.dir);
        let bricks_dir = self.vol_dir(&def.name).join("bricks");
        write_atomic(
            &bricks_dir,
            &format!("{i}.toml"),
            vf.to_toml().as_bytes(),
            0o644,
        )?;
        // Ports of every brick this kilnd knows on this address are taken, even if down.
        let mut taken: BTreeSet<u16> = self
            .load_all()
            .iter()
            .flat_map(|d| {
                d.bricks
                    .iter()
                    .enumerate()
                    .filter(|(j, x)| !(d.name == def.name && *j == i) && x.ip().ok() == Some(ip))
                    .filter_map(|(_, x)| x.port)
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut preferred = b.port;
        let log_path = bricks_dir.join(format!("{i}.log"));
        let mut last = String::new();
        for _ in 0..16 {
            let port = match preferred
                .take()
                .filter(|p| !taken.contains(p) && port_free(ip, *p))
            {
                Some(p) => p,
                None => free_port(ip, &taken, *lock_port(&self.first_brick_port))?,
            };
            taken.insert(port);
            match self.spawn_brick(procs, def, i, ip, port, &log_path) {
                Ok(pid) => {
                    tracing::info!(
                        "volume {}: brick {} runs as pid {pid} on port {port}",
                        def.name,
                        b.spec()
                    );
                    return Ok((port, pid));
                }
                Err((e, retry)) => {
                    last = e;
                    if !retry {
                        break;
                    }
                }
            }
        }
        Err(last)
    }

    /// Spawns a brick and waits until it listens. On failure: the message and whether another
    /// port may help.
    fn spawn_brick(
        &self,
        procs: &mut Procs,
        def: &VolumeDef,
        i: usize,
        ip: IpAddr,
        port: u16,
        log_path: &Path,
    ) -> Result<u32, (String, bool)> {
        let vf_path = self.brick_volfile_path(&def.name, i);
        let fail = |e: String| (e, false);
        let log = fs::File::create(log_path)
            .map_err(|e| fail(format!("cannot create {}: {e}", log_path.display())))?;
        let log2 = log
            .try_clone()
            .map_err(|e| fail(format!("{}: {e}", log_path.display())))?;
        let listen = format!("tcp:{}", SocketAddr::new(ip, port));
        let mut cmd = Command::new(&self.exe[0]);
        cmd.args(&self.exe[1..])
            .arg("--volfile")
            .arg(&vf_path)
            .args(["--listen", &listen, "--metrics", "off", "--secret-file"])
            .arg(self.secret_path(&def.name));
        if let Some(sock) = self.brick_socket(&def.name, i) {
            // Clients on this host reach the brick here: no TCP stack on the way (a third
            // less CPU per byte for replica-3 writes on one host, bench/replicate.py).
            let _ = fs::create_dir_all(sock.parent().expect("in the run directory"));
            cmd.arg("--listen").arg(format!("unix:{}", sock.display()));
        }
        for c in &def.allow {
            cmd.arg("--allow").arg(c);
        }
        cmd.stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            // Its own process group: a signal to kilnd's group (Ctrl-C) leaves bricks alone.
            .process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| fail(format!("cannot run {:?}: {e}", self.exe[0])))?;
        let pid = child.id();
        let deadline = Instant::now() + BRICK_START_TIMEOUT;
        loop {
            let text = fs::read_to_string(log_path).unwrap_or_default();
            if text.contains("kilnd: listening on") {
                procs.children.insert(pid, child);
                return Ok(pid);
            }
            if let Ok(Some(status)) = child.try_wait() {
                let tail: String = text.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                let retry = text.contains("in use");
                return Err((
                    format!("brick exited ({status}) on {listen}: {tail}"),
                    retry,
                ));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err((format!("brick did not listen on {listen} in time"), false));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops brick `i` of `def` if it runs here: SIGTERM, then SIGKILL after a grace period.
    fn stop_brick(&self, procs: &mut Procs, def: &VolumeDef, i: usize) {
        let Some(pid) = def.bricks[i].pid else { return };
        let vf_path = self.brick_volfile_path(&def.name, i);
        if let Some(mut c) = procs.children.remove(&pid) {
            signal(pid, rustix::process::Signal::TERM);
            let deadline = Instant::now() + BRICK_STOP_TIMEOUT;
            while matches!(c.try_wait(), Ok(None)) {
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            return;
        }
        if !self.pid_runs_brick(procs, pid, &vf_path) {
            return;
        }
        signal(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + BRICK_STOP_TIMEOUT;
        while self.pid_runs_brick(procs, pid, &vf_path) {
            if Instant::now() > deadline {
                signal(pid, rustix::process::Signal::KILL);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl MgmtHandler for Manager {
    fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        Manager::handle(self, req, caller)
    }
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

fn port_answers(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).is_ok()
}

fn port_free(ip: IpAddr, port: u16) -> bool {
    TcpListener::bind((ip, port)).is_ok()
}

/// The first free port from `first` not in `taken`.
fn free_port(ip: IpAddr, taken: &BTreeSet<u16>, first: u16) -> Result<u16, String> {
    (first..=u16::MAX)
        .find(|p| !taken.contains(p) && port_free(ip, *p))
        .ok_or_else(|| format!("no free port on {ip} from {first}"))
}

fn lock_port(m: &Mutex<u16>) -> std::sync::MutexGuard<'_, u16> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `allow` list of a request: address ranges (ADDR/PREFIX), each checked.
fn allow_arg(req: &Value) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for v in req["allow"].as_array().into_iter().flatten() {
        let c = v.as_str().ok_or("bad request: \"allow\" wants strings")?;
        c.parse::<crate::access::Cidr>()
            .map_err(|e| format!("allow {c:?}: {e}"))?;
        out.push(c.to_owned());
    }
    Ok(out)
}

fn str_arg<'a>(req: &'a Value, key: &str) -> Result<&'a str, String> {
    req[key]
        .as_str()
        .ok_or_else(|| format!("bad request: no \"{key}\" string"))
}

fn index_arg(req: &Value, def: &VolumeDef) -> Result<usize, String> {
    req["index"]
        .as_u64()
        .map(|i| i as usize)
        .filter(|i| *i < def.bricks.len())
        .ok_or_else(|| format!("bad request: no brick \"index\" of volume {}", def.name))
}

fn parse_sockaddr(s: &str) -> Result<SocketAddr, String> {
    s.strip_prefix("tcp:")
        .unwrap_or(s)
        .parse()
        .map_err(|e| format!("bad address {s:?}: {e}"))
}

/// A definition as commands show it (everything but the secret, which is not in it).
fn def_json(def: &VolumeDef) -> Value {
    let mut v = serde_json::to_value(def).expect("a definition serialises");
    v["type"] = match (def.replica > 1, def.bricks.len() > def.replica) {
        (true, true) => "Distributed-Replicate",
        (true, false) => "Replicate",
        (false, true) => "Distribute",
        (false, false) => "Single",
    }
    .into();
    v["state_word"] = def.state.word().into();
    v
}

fn random(buf: &mut [u8]) -> Result<(), String> {
    rustix::rand::getrandom(buf, rustix::rand::GetRandomFlags::empty())
        .map(|_| ())
        .map_err(|e| format!("cannot get random bytes: {e}"))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Writes `dir/name` so that a crash leaves the old or the new contents, never a mix.
fn write_atomic(dir: &Path, name: &str, data: &[u8], mode: u32) -> Result<(), String> {
    let err = |e: io::Error| format!("cannot write {}: {e}", dir.join(name).display());
    fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(data).map_err(err)?;
    f.sync_all().map_err(err)?;
    drop(f);
    fs::rename(&tmp, dir.join(name)).map_err(err)?;
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brick_specs() {
        let b = parse_brick("10.0.0.1:/srv/b1/").unwrap();
        assert_eq!((b.host.as_str(), b.mgmt_port), ("10.0.0.1", None));
        assert_eq!(b.dir, Path::new("/srv/b1"));
        let b = parse_brick("node2:24008:/srv//b2").unwrap();
        assert_eq!((b.host.as_str(), b.mgmt_port), ("node2", Some(24008)));
        assert_eq!(b.spec(), "node2:24008:/srv/b2");
        for bad in [
            "/srv/b",
            "h:srv/b",
            ":/srv/b",
            "h:/",
            "h:/a/../b",
            "h:x:/a",
            "h:0:/a",
        ] {
            assert!(parse_brick(bad).is_err(), "{bad} accepted");
        }
        assert!(check_name("vol_1-a").is_ok());
        for bad in ["", "-x", "a b", "a/b", "é", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    fn def(replica: usize, n: usize) -> VolumeDef {
        VolumeDef {
            name: "v".into(),
            id: "0".into(),
            replica,
            bricks: (0..n)
                .map(|i| BrickDef {
                    host: "127.0.0.1".into(),
                    mgmt_port: None,
                    dir: format!("/b{i}").into(),
                    port: Some(24100 + i as u16),
                    pid: None,
                })
                .collect(),
            state: VolState::Started,
            authority: None,
            allow: Vec::new(),
        }
    }

    #[test]
    fn client_volfile_shapes() {
        let types =
            |v: &Volfile| -> Vec<&str> { v.layers.iter().map(|l| l.kind.type_name()).collect() };
        let v = client_volfile(&def(1, 1)).unwrap();
        assert_eq!(types(&v), ["io-stats", "protocol-client"]);
        let v = client_volfile(&def(3, 3)).unwrap();
        assert_eq!(
            types(&v),
            [
                "io-stats",
                "replicate",
                "protocol-client",
                "protocol-client",
                "protocol-client"
            ]
        );
        assert_eq!(v.layers[1].name, "v-replicate-0");
        let v = client_volfile(&def(2, 4)).unwrap();
        assert_eq!(
            types(&v)[..4],
            ["io-stats", "distribute", "replicate", "replicate"]
        );
        assert_eq!(v.layers[1].subvolumes, ["v-replicate-0", "v-replicate-1"]);
        assert_eq!(v.layers[3].subvolumes, ["v-client-2", "v-client-3"]);
        let v = client_volfile(&def(1, 2)).unwrap();
        assert_eq!(
            types(&v),
            [
                "io-stats",
                "distribute",
                "protocol-client",
                "protocol-client"
            ]
        );
        assert_eq!(Volfile::parse(&v.to_toml()).unwrap(), v);
    }
}
