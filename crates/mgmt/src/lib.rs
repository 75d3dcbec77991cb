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

use std::ffi::OsString;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use kiln_server::control::refusal;
pub use kiln_server::control::{Caller, Handler, MgmtHandler};

mod bricks;
mod commands;
mod def;
pub mod healer;
mod peers;
mod request;
mod store;
mod volfiles;

pub use bricks::brick_command;
use bricks::*;
pub use def::*;
pub use peers::call_peer;
pub use request::Request;
use store::*;
pub use volfiles::{brick_volfile, client_volfile, placeholder_volfile};

/// The commands an unauthenticated connection may send (see the module documentation).
pub const OPEN_COMMANDS: &[&str] = &["volfile"];

/// The name of the management secret in the state directory.
pub const MGMT_SECRET_FILE: &str = "mgmt.secret";

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
        let secret = kiln_server::auth::load_or_create(&path)
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
    fn call_peer(&self, addr: SocketAddr, req: &Request) -> Result<Value, String> {
        call_peer(addr, &self.secret, &req.to_json())
    }

    /// Answers one request from `caller`: only [`OPEN_COMMANDS`] without authentication.
    pub fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        let out = match serde_json::from_slice::<Value>(req) {
            Ok(v) if v.is_object() => {
                // Authentication is checked on the command's name before anything else of the
                // request is looked at.
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
                    return refusal(&what).into_bytes();
                }
                match serde_json::from_value::<Request>(v) {
                    Ok(r) => self.dispatch(r),
                    Err(e) => Err(format!("bad request: {e}")),
                }
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
    fn dispatch(&self, req: Request) -> Result<Value, String> {
        tracing::debug!(cmd = req.cmd(), "mgmt request");
        // A change to a volume this kilnd only caches goes to the authority — without holding
        // our lock, since the authority will call back (brick-start) to this kilnd.
        if let Some(name) = req.forwarded_volume() {
            check_name(name)?;
            if let Ok(def) = self.load(name) {
                if let Some(auth) = &def.authority {
                    let addr = parse_sockaddr(auth)?;
                    return self
                        .call_peer(addr, &req)
                        .map_err(|e| format!("volume {name} (authority {auth}): {e}"));
                }
            }
        }
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        let procs = &mut procs;
        match req {
            Request::Create {
                name,
                replica,
                bricks,
                allow,
            } => self.create(&name, replica, &bricks, &allow),
            Request::Start { name, force } => self.start(procs, &name, force),
            Request::Stop { name } => self.stop(procs, &name),
            Request::Set { name, allow } => self.set(procs, &name, &allow),
            Request::Delete { name } => self.delete(&name),
            Request::Info { name } => self.info(name.as_deref()),
            Request::List => self.list(),
            Request::Status { name } => self.status(procs, name.as_deref()),
            Request::Volfile { name } => self.volfile(&name),
            Request::BrickStart { def, index, secret } => {
                self.brick_start(procs, def, index, secret.as_deref())
            }
            Request::BrickStop { name, index } => self.brick_stop(procs, &name, index),
            Request::BrickReport {
                name,
                id,
                index,
                port,
                pid,
            } => self.brick_report(&name, &id, index, port, pid),
            Request::PeerSync { def, secret } => self.peer_sync(def, secret.as_deref()),
            Request::PeerForget { name } => self.peer_forget(&name),
        }
    }
}

impl MgmtHandler for Manager {
    fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        Manager::handle(self, req, caller)
    }
}

/// `index` as a brick of `def`, or a bad-request error.
fn check_index(index: usize, def: &VolumeDef) -> Result<usize, String> {
    if index < def.bricks.len() {
        Ok(index)
    } else {
        Err(format!(
            "bad request: volume {} has no brick {index}",
            def.name
        ))
    }
}

fn parse_sockaddr(s: &str) -> Result<SocketAddr, String> {
    s.strip_prefix("tcp:")
        .unwrap_or(s)
        .parse()
        .map_err(|e| format!("bad address {s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_layer::volfile::Volfile;

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
