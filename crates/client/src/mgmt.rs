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
//! The management port takes no secret (it listens on loopback by default; see kilnd
//! `--mgmt`). The bricks of a volume do: each volume has its own, which [`secret_file`] finds.

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

/// Sends one management request (a JSON object with `"cmd"`) to the kilnd at `addr`
/// (`tcp:HOST:PORT` or `HOST:PORT`) and returns its reply. A reply with `"ok": false` becomes
/// an error carrying the server's message.
pub fn call(addr: &str, req: &serde_json::Value) -> io::Result<serde_json::Value> {
    let hostport = addr.strip_prefix("tcp:").unwrap_or(addr);
    let sa = hostport
        .to_socket_addrs()
        .map_err(|e| io::Error::new(e.kind(), format!("bad management address {addr}: {e}")))?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{addr}: no address")))?;
    let ctx = |e: io::Error| io::Error::new(e.kind(), format!("kilnd at {addr}: {e}"));
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(5)).map_err(ctx)?;
    // Starting a volume may take a while (bricks on several hosts); a minute bounds a hang.
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(ctx)?;
    let args = MgmtReq {
        json: req.to_string().into_bytes(),
    }
    .to_wire();
    if args.len() > kiln_proto::MAX_ARGS_LEN as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "management request above 64 KiB",
        ));
    }
    let mut frame = Header::request(Op::Mgmt as u16, 1, args.len() as u32, 0)
        .to_bytes()
        .to_vec();
    frame.extend_from_slice(&args);
    s.write_all(&frame).map_err(ctx)?;
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).map_err(ctx)?;
    let h = Header::parse(&h)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("kilnd at {addr}: {e}")))?;
    let (alen, plen) = (h.args_len.get() as usize, h.payload_len.get() as usize);
    let mut rest = vec![0u8; alen + plen];
    s.read_exact(&mut rest).map_err(ctx)?;
    match h.status.get() {
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
        e => return Err(ctx(io::Error::from_raw_os_error(e as i32))),
    }
    let v: serde_json::Value = serde_json::from_slice(&rest[alen..]).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("kilnd at {addr}: bad reply: {e}"),
        )
    })?;
    if v["ok"] == true {
        Ok(v)
    } else {
        Err(io::Error::other(
            v["error"]
                .as_str()
                .unwrap_or("the server refused without saying why")
                .to_owned(),
        ))
    }
}

/// Fetches the client volume graph of `volume` from the kilnd at `server` (any kilnd with a
/// brick of the volume, or the one where it was created).
pub fn fetch_volfile(server: &str, volume: &str) -> io::Result<Volfile> {
    let r = call(
        server,
        &serde_json::json!({ "cmd": "volfile", "name": volume }),
    )?;
    let text = r["volfile"].as_str().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "volfile reply without \"volfile\"",
        )
    })?;
    Volfile::parse(text)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("volume {volume}: {e}")))
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
