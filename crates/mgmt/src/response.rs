//! The MGMT replies, typed on both ends: kilnd builds one of these per command and the CLI (or
//! another kilnd) decodes the one its request names. On the wire a reply is the type's fields
//! in one JSON object with `"ok": true`, or `{"ok": false, "error": SENTENCE}` (see
//! [`Envelope`]), so `--json` shows exactly these shapes.

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::def::{BrickDef, VolState, VolumeDef};
use crate::healing::VolHeal;
pub use crate::rebalancing::{RebalanceView, SetMoves};
use kiln_proto::{Error, Kind};

/// How a volume's bricks are arranged, as `info` names it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeType {
    /// One brick.
    Single,
    /// Files spread over several bricks, one copy each.
    Distribute,
    /// One replica set.
    Replicate,
    /// Files spread over several replica sets.
    #[serde(rename = "Distributed-Replicate")]
    DistributedReplicate,
}

impl VolumeType {
    /// The arrangement of `def`.
    pub fn of(def: &VolumeDef) -> VolumeType {
        match (def.replica > 1, def.bricks.len() > def.replica) {
            (true, true) => VolumeType::DistributedReplicate,
            (true, false) => VolumeType::Replicate,
            (false, true) => VolumeType::Distribute,
            (false, false) => VolumeType::Single,
        }
    }

    /// The name `info` prints.
    pub fn word(self) -> &'static str {
        match self {
            VolumeType::Single => "Single",
            VolumeType::Distribute => "Distribute",
            VolumeType::Replicate => "Replicate",
            VolumeType::DistributedReplicate => "Distributed-Replicate",
        }
    }
}

/// A definition as commands show it (everything but the secret, which is not in it).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct VolumeView {
    /// The definition.
    #[serde(flatten)]
    pub def: VolumeDef,
    /// Its arrangement.
    #[serde(rename = "type")]
    pub kind: VolumeType,
    /// Its state, capitalised as `info` prints it.
    pub state_word: String,
}

impl From<&VolumeDef> for VolumeView {
    fn from(def: &VolumeDef) -> VolumeView {
        VolumeView {
            def: def.clone(),
            kind: VolumeType::of(def),
            state_word: def.state.word().to_owned(),
        }
    }
}

/// `create`, `start`, `stop`, `set`: the volume as it now is.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Changed {
    /// The definition after the change.
    pub volume: VolumeView,
    /// What did not go as asked but did not fail the command (a peer unreachable, …).
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// `delete`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Deleted {
    /// The volume.
    pub volume: String,
    /// Always true: a refusal is an error.
    pub deleted: bool,
    /// What did not go as asked.
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// `info`: one definition, or every one.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Infos {
    /// The definitions.
    pub volumes: Vec<VolumeView>,
    /// The version of the pool's store they were read at (a log index: it only grows).
    #[serde(default)]
    pub version: u64,
}

/// `list`: volume names.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Names {
    /// The names, sorted.
    pub volumes: Vec<String>,
}

/// One brick in `status`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct BrickStatus {
    /// `HOST:/DIR` or `HOST:PORT:/DIR`.
    pub brick: String,
    /// The host as given.
    pub host: String,
    /// The brick directory.
    pub dir: std::path::PathBuf,
    /// The port it serves (or last served) on.
    pub port: Option<u16>,
    /// Its process on its host.
    pub pid: Option<u32>,
    /// The port of its `/metrics` endpoint (Prometheus), on the loopback of the brick's host.
    #[serde(default)]
    pub metrics_port: Option<u16>,
    /// Whether it runs and answers now.
    pub online: bool,
    /// Its file system's size and the bytes free for the brick, when it is on this host.
    #[serde(default)]
    pub space: Option<Space>,
    /// Whether its file system takes writes, when it is on this host.
    #[serde(default)]
    pub health: Option<Health>,
}

/// Whether a brick's file system takes writes: what `status` finds by trying.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct Health {
    /// Mounted read-only (writes fail with EROFS).
    pub read_only: bool,
    /// The error of a one-byte write, fsync and unlink in the brick's `.kiln` directory (or
    /// the brick directory before it has one): EIO from a failing disk, …; a full file
    /// system is [`Space::full`], not this.
    pub write_error: Option<String>,
}

impl Health {
    /// Of the brick directory `dir` (`None` when it does not exist).
    pub fn of(dir: &std::path::Path) -> Option<Health> {
        use std::io::Write;
        if !dir.is_dir() {
            return None;
        }
        let meta = Some(dir.join(".kiln"))
            .filter(|m| m.is_dir())
            .unwrap_or_else(|| dir.to_owned());
        let read_only = rustix::fs::statvfs(dir)
            .map(|s| s.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY))
            .unwrap_or(false);
        let probe = meta.join(format!(".kiln-status-probe-{}", std::process::id()));
        let tried = std::fs::File::create(&probe)
            .and_then(|mut f| {
                f.write_all(b"k")?;
                f.sync_all()
            })
            .and_then(|()| std::fs::remove_file(&probe));
        let _ = std::fs::remove_file(&probe);
        // Full is the FULL line's business, and read-only says itself.
        let known = |e: &std::io::Error| match e.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => true,
            Some(libc::EROFS) => read_only,
            _ => false,
        };
        let write_error = match tried {
            Err(e) if !known(&e) => Some(e.to_string()),
            _ => None,
        };
        Some(Health {
            read_only,
            write_error,
        })
    }

    /// True when writes fail for a reason other than a full file system.
    pub fn failing(&self) -> bool {
        self.read_only || self.write_error.is_some()
    }
}

/// A brick file system's space.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    /// Bytes in all.
    pub size: u64,
    /// Bytes free for unprivileged writers (what a brick's clients can still use).
    pub free: u64,
}

impl Space {
    /// Of the file system holding `dir`, if it can be asked.
    pub fn of(dir: &std::path::Path) -> Option<Space> {
        let s = rustix::fs::statvfs(dir).ok()?;
        Some(Space {
            size: s.f_blocks.saturating_mul(s.f_frsize),
            free: s.f_bavail.saturating_mul(s.f_frsize),
        })
    }

    /// Less than 1% free: writes are failing or about to (ENOSPC).
    pub fn full(&self) -> bool {
        self.free < self.size / 100
    }
}

impl BrickStatus {
    /// `b` as `status` shows it (`space` and `health` when it is on this host).
    pub fn of(
        b: &BrickDef,
        online: bool,
        space: Option<Space>,
        health: Option<Health>,
    ) -> BrickStatus {
        BrickStatus {
            brick: b.spec(),
            host: b.host.clone(),
            dir: b.dir.clone(),
            port: b.port,
            pid: b.pid,
            metrics_port: b.metrics_port.filter(|_| online),
            online,
            space,
            health,
        }
    }
}

/// One volume in `status`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct VolumeStatus {
    /// The volume.
    pub name: String,
    /// Where it is in its life.
    pub state: VolState,
    /// The pool's leader (which makes its changes), when not the kilnd that answered.
    pub authority: Option<String>,
    /// Its bricks, in definition order.
    pub bricks: Vec<BrickStatus>,
    /// The heal service's view, when this kilnd heals it.
    pub heal: Option<VolHeal>,
    /// Its rebalance (running, or the last one), when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalanceView>,
}

/// `status`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Statuses {
    /// One entry per volume asked for.
    pub volumes: Vec<VolumeStatus>,
    /// The answering kilnd's own `/metrics` endpoint (IP:PORT), when it serves one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
}

/// `volfile`: the client graph.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct VolfileText {
    /// The volume.
    pub volume: String,
    /// The graph, as TOML.
    pub volfile: String,
    /// The version of the volume's definition it was made from (a log index of the pool's
    /// store: it only grows). Clients follow the graph by asking again; a higher version
    /// whose graph differs from theirs is one to switch to.
    #[serde(default)]
    pub graph: u64,
    /// The management addresses of the pool's members (`tcp:IP:PORT`): where to ask when
    /// this kilnd does not answer.
    #[serde(default)]
    pub servers: Vec<String>,
}

/// `brick-start`: where the brick runs now.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct BrickStarted {
    /// Its port.
    pub port: u16,
    /// Its process.
    pub pid: u32,
    /// The port of its `/metrics` endpoint (on the brick's address), when it serves one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<u16>,
}

impl BrickStarted {
    /// Where `b` runs, as recorded.
    pub fn of(b: &BrickDef) -> Option<BrickStarted> {
        Some(BrickStarted {
            port: b.port?,
            pid: b.pid?,
            metrics: b.metrics_port,
        })
    }

    /// Records in `b` that it runs here.
    pub fn record_in(&self, b: &mut BrickDef) {
        b.ran(self.port, self.pid, self.metrics);
    }
}

/// `brick-stop`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct BrickStopped {
    /// The brick's index.
    pub stopped: usize,
}

/// `peer-sync`, `peer-forget`, `brick-report`: done.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Ack {
    /// The volume.
    pub volume: String,
    /// What did not go as asked.
    #[serde(default)]
    pub warnings: Vec<String>,
}

pub use crate::pool::types::{Joined, PoolMember, PoolView, RaftReply, Written};

/// `peer detach`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PeerDetached {
    /// The member's address.
    pub detached: String,
    /// What did not go as asked.
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// Every reply kilnd sends; serialised without a tag, since the receiver knows which
/// command it asked.
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum Response {
    /// See [`Changed`].
    Changed(Changed),
    /// See [`Deleted`].
    Deleted(Deleted),
    /// See [`Infos`].
    Infos(Infos),
    /// See [`Names`].
    Names(Names),
    /// See [`Statuses`].
    Statuses(Statuses),
    /// See [`VolfileText`].
    Volfile(VolfileText),
    /// See [`BrickStarted`].
    BrickStarted(BrickStarted),
    /// See [`BrickStopped`].
    BrickStopped(BrickStopped),
    /// See [`Ack`].
    Ack(Ack),
    /// See [`RaftReply`].
    Raft(RaftReply),
    /// See [`Written`].
    Written(Written),
    /// See [`Joined`].
    Joined(Joined),
    /// See [`PoolView`].
    Pool(PoolView),
    /// See [`PeerDetached`].
    PeerDetached(PeerDetached),
    /// See [`RebalanceView`].
    Rebalance(RebalanceView),
    /// See [`IdentityList`].
    Identities(IdentityList),
}

/// `auth`: identities and their capabilities; keys only where the command made or asked
/// for one (`add`, `get`, `rotate`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct IdentityList {
    /// The identities, by name.
    pub identities: Vec<IdentityView>,
}

/// One identity in [`IdentityList`].
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct IdentityView {
    /// Its name.
    pub name: String,
    /// Its key file's line (`NAME HEX`), where asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// What it may do.
    pub caps: kiln_server::identity::Caps,
}

macro_rules! response_from {
    ($($t:ident => $v:ident),* $(,)?) => {$(
        impl From<$t> for Response {
            fn from(r: $t) -> Response {
                Response::$v(r)
            }
        }
    )*};
}
response_from!(
    Changed => Changed,
    Deleted => Deleted,
    Infos => Infos,
    Names => Names,
    Statuses => Statuses,
    VolfileText => Volfile,
    BrickStarted => BrickStarted,
    BrickStopped => BrickStopped,
    Ack => Ack,
    RaftReply => Raft,
    Written => Written,
    Joined => Joined,
    PoolView => Pool,
    PeerDetached => PeerDetached,
    RebalanceView => Rebalance,
    IdentityList => Identities,
);

/// A reply on the wire: the reply's own fields beside `"ok"`, or the error.
#[derive(Serialize, Deserialize, Debug)]
pub struct Envelope<T> {
    /// True when the command succeeded.
    pub ok: bool,
    /// The operator's sentence when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What kind of failure it was ([`kiln_proto::Kind::name`]): `not-found`, `conflict`,
    /// `unavailable`, …; a reply from a kilnd before kinds has none (read as `failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The reply, when it did.
    #[serde(flatten)]
    pub reply: Option<T>,
}

impl Envelope<Response> {
    /// The wire form of `out`.
    pub fn encode(out: Result<Response, Error>) -> Vec<u8> {
        let e = match out {
            Ok(r) => Envelope {
                ok: true,
                error: None,
                kind: None,
                reply: Some(r),
            },
            Err(e) => Envelope {
                ok: false,
                kind: Some(e.kind().name().to_owned()),
                error: Some(e.message().to_owned()),
                reply: None,
            },
        };
        serde_json::to_vec(&e).expect("a reply serialises")
    }
}

/// Decodes a reply of type `T` (the one the request names): its fields, or the error (kind and
/// sentence) of an `"ok": false` reply.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Error> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| Error::failed(format!("bad reply: {e}")))?;
    decode_value(v)
}

/// [`decode`] of a reply already parsed as JSON.
pub fn decode_value<T: DeserializeOwned>(v: serde_json::Value) -> Result<T, Error> {
    if v["ok"] != true {
        let kind = Kind::from_name(v["kind"].as_str().unwrap_or_default());
        return Err(match v["error"].as_str() {
            Some(e) => Error::new(kind, e),
            None => Error::failed("reply without \"ok\""),
        });
    }
    serde_json::from_value(v).map_err(|e| Error::failed(format!("bad reply: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def() -> VolumeDef {
        crate::tests::def(3, 3)
    }

    #[test]
    fn replies_round_trip_through_the_envelope() {
        let c = Changed {
            volume: VolumeView::from(&def()),
            warnings: vec!["w".into()],
        };
        let bytes = Envelope::encode(Ok(c.clone().into()));
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        // The wire keeps the shape the CLI's --json shows: fields beside "ok".
        assert_eq!(v["ok"], true);
        assert_eq!(v["volume"]["type"], "Replicate");
        assert_eq!(v["volume"]["state"], "started");
        assert_eq!(v["volume"]["state_word"], "Started");
        assert_eq!(decode::<Changed>(&bytes).unwrap(), c);
        let bytes = Envelope::encode(Err(Error::conflict("volume v is not started")));
        // The kind crosses the wire with the sentence.
        assert_eq!(
            decode::<Changed>(&bytes).unwrap_err(),
            Error::conflict("volume v is not started")
        );
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["kind"], "conflict", "{v}");
        // A kilnd from before kinds sends none: the failure is still one, of no particular kind.
        let old = br#"{"ok": false, "error": "volume v is not started"}"#;
        assert_eq!(decode::<Changed>(old).unwrap_err().kind(), Kind::Failed);
        // The wrong reply type is an error naming the missing field, not a panic.
        let bytes = Envelope::encode(Ok(BrickStopped { stopped: 1 }.into()));
        assert!(decode::<BrickStarted>(&bytes)
            .unwrap_err()
            .message()
            .contains("missing field"));
        assert!(decode::<Names>(b"{")
            .unwrap_err()
            .message()
            .starts_with("bad reply"));
    }

    #[test]
    fn volume_types() {
        let mut d = def();
        assert_eq!(VolumeType::of(&d), VolumeType::Replicate);
        d.replica = 1;
        assert_eq!(VolumeType::of(&d), VolumeType::Distribute);
        d.bricks.truncate(1);
        assert_eq!(VolumeType::of(&d), VolumeType::Single);
    }
}
