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

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln_layer::volfile::Volfile;
pub use kiln_proto::auth::Key;
use kiln_proto::{Error, Kind};

mod conn;
pub use conn::{MgmtConn, MgmtError, Proof, CONNECT_TIMEOUT};

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
/// readable. A reply with `"ok": false` becomes an error carrying the server's message and
/// kind; a refusal for want of the secret, or of a wrong one, is [`kiln_proto::Kind::Denied`].
pub fn call(addr: &str, req: &serde_json::Value) -> Result<serde_json::Value, Error> {
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
) -> Result<serde_json::Value, Error> {
    let key = secret.map(Key::from_file_text);
    call_with_key(addr, req, key.as_ref())
}

/// [`call`] proving `key` (a named identity's, or the shared secret), when the kilnd asks for
/// one.
pub fn call_with_key(
    addr: &str,
    req: &serde_json::Value,
    key: Option<&Key>,
) -> Result<serde_json::Value, Error> {
    // Starting a volume may take a while (bricks on several hosts); two minutes bound a hang.
    let mut c = MgmtConn::connect_env(addr, Duration::from_secs(120))?;
    if let Some(key) = key {
        c.authenticate(key, Proof::IfAsked)
            .map_err(|e| cli_error(addr, e))?;
    }
    c.request(req).map_err(|e| cli_error(addr, e))
}

/// A management error as the command line reports it: where it came from, and its kind.
fn cli_error(addr: &str, e: MgmtError) -> Error {
    match e {
        // The errno stays: a caller that can use a brick instead asks for it (ENOSYS, EACCES).
        MgmtError::Status(s) if s == libc::ENOSYS => Error::invalid(format!(
            "{addr} does not manage volumes (a brick server? point --server at a kilnd \
             started without --brick)"
        ))
        .with_errno(s),
        MgmtError::Status(s) => {
            let e = io::Error::from_raw_os_error(s);
            Error::new(Kind::of_io(&e), format!("kilnd at {addr}: {e}")).with_errno(s)
        }
        MgmtError::Refused {
            auth_required: true,
            ..
        } => Error::from(e).context(format_args!("kilnd at {addr}")),
        e => e.into(),
    }
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
/// pool), proving the key [`secret_file`] finds for the volume (a named identity's, or the
/// volume's own secret).
///
/// A kilnd hands a volume's graph only to an identity that may use the volume (or an admin);
/// to anyone else it says the same as for a volume that does not exist. A brick that requires
/// its secret refuses the request (`PermissionDenied`) and one without a management handler
/// says `Unsupported`.
pub fn fetch_graph(server: &str, volume: &str) -> io::Result<Graph> {
    let key = match secret_file(volume, None) {
        Some(p) => Some(Key::from_file_text(&read_secret(&p)?)),
        None => None,
    };
    fetch_graph_with(server, volume, key.as_ref())
}

/// The identity a client's key speaks for at a management port: a named identity as it is;
/// a volume's shared secret as that volume's (`vol.NAME`), which the pool's members admit for
/// fetching its graph.
pub fn volume_key(volume: &str, key: &Key) -> Key {
    match key.identity.as_str() {
        "" => Key {
            identity: format!("vol.{volume}"),
            secret: key.secret.clone(),
        },
        _ => key.clone(),
    }
}

/// [`fetch_graph`] proving `key` (as [`volume_key`] names it), or none. A key the kilnd
/// refuses is asked without, so that the answer is the kilnd's own word for the volume (the
/// same for one that does not exist and one this client may not use).
pub fn fetch_graph_with(server: &str, volume: &str, key: Option<&Key>) -> io::Result<Graph> {
    let key = key.map(|k| volume_key(volume, k));
    let req = serde_json::json!({ "cmd": "volfile", "name": volume });
    let r = match call_with_key(server, &req, key.as_ref()) {
        Err(e) if key.is_some() && e.kind() == kiln_proto::Kind::Denied => {
            call_with_key(server, &req, None)?
        }
        r => r?,
    };
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

/// [`fetch_graph_with`]'s volfile alone.
pub fn fetch_volfile_with(server: &str, volume: &str, key: Option<&Key>) -> io::Result<Volfile> {
    fetch_graph_with(server, volume, key).map(|g| g.volfile)
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

/// The key file a client of `volume`'s bricks proves: `explicit` (a `--secret-file` option),
/// else `KILN_SECRET_FILE`, else the local kilnd's `/var/lib/kiln/vols/VOL/secret` when
/// readable (on a pool host: the pool hosts' own identity for the volume, or its shared secret
/// where that is on).
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
