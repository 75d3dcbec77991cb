//! Volume definitions: a volume, its bricks, where each brick lives, and the checks a
//! definition passes before it is stored.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Component, Path, PathBuf};

use kiln_proto::error::Context as _;
use kiln_proto::Error;
use serde::{Deserialize, Serialize};

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
    /// The port of the running brick's `/metrics` endpoint, on the loopback of its host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_port: Option<u16>,
    /// The brick has run in this volume: from now on a directory without the brick's
    /// identity is a new brick, rebuilt before it is read from. Until then (a volume's first
    /// start) the directory takes the identity at once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub settled: bool,
    /// Taken out of the volume by `remove-brick commit`: kept in the list so that every other
    /// brick keeps its index (its identity), but never run and in no graph.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub removed: bool,
}

impl BrickDef {
    /// Records that the brick runs on `port` as `pid`, its `/metrics` on `metrics` (and so
    /// that it has run in this volume).
    pub fn ran(&mut self, port: u16, pid: u32, metrics: Option<u16>) {
        self.port = Some(port);
        self.pid = Some(pid);
        self.metrics_port = metrics;
        self.settled = true;
    }

    /// `HOST:/DIR`, or `HOST:PORT:/DIR` with a management port.
    pub fn spec(&self) -> String {
        match self.mgmt_port {
            Some(p) => format!("{}:{p}:{}", self.host, self.dir.display()),
            None => format!("{}:{}", self.host, self.dir.display()),
        }
    }

    /// The host's address.
    pub fn ip(&self) -> Result<IpAddr, Error> {
        resolve(&self.host)
    }

    /// The management address of the brick's host.
    pub fn mgmt_addr(&self) -> Result<SocketAddr, Error> {
        Ok(SocketAddr::new(
            self.ip()?,
            self.mgmt_port.unwrap_or(DEFAULT_MGMT_PORT),
        ))
    }
}

/// Where a volume is in its life.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum VolState {
    /// Defined, never started.
    #[default]
    Created,
    /// Its bricks should run.
    Started,
    /// Its bricks were stopped.
    Stopped,
}

impl VolState {
    pub(crate) fn word(self) -> &'static str {
        match self {
            VolState::Created => "Created",
            VolState::Started => "Started",
            VolState::Stopped => "Stopped",
        }
    }
}

/// A volume definition (the default: no bricks, every option at its default).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
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
    /// Definitions from before the pool: on a kilnd that held only a copy, the management
    /// address of the one that made it (such copies are not imported). `None` in the store.
    #[serde(default)]
    pub authority: Option<String>,
    /// Address ranges clients of the bricks may connect from (empty: anyone); each brick
    /// gets them as `--allow`.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Clients' root acts as nobody on the bricks (`kiln volume set VOL root-squash on`).
    #[serde(default)]
    pub root_squash: bool,
    /// Seconds a client's I/O waits for its bricks to come back (a quorum of a replica set,
    /// or the one brick) before failing; `None`: 30 (`kiln volume set VOL io-timeout S`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_timeout: Option<u32>,
    /// The options that configure a layer of the graphs (`kiln volume set`; see
    /// [`crate::options::Target::Layer`]), by name, as given: only those not at their
    /// default, so a volume left at the defaults keeps its clients' graph.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub options: BTreeMap<String, String>,
    /// `ping-timeout` as definitions stored it before [`VolumeDef::options`]: read (see
    /// `options::legacy`), dropped when the option is set again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ping_timeout: Option<u32>,
    /// `short-circuit` as stored before [`VolumeDef::options`] (see `ping_timeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_circuit: Option<bool>,
    /// Clients may prove the volume's shared secret (the compatibility identity). New volumes
    /// are made with it off (only named identities, the pool hosts' `local.VOL` and kilnd's
    /// own); `None`, a volume made before identities existed: on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_secret: Option<bool>,
    /// `flush-behind` as stored before [`VolumeDef::options`] (see `ping_timeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_behind: Option<u64>,
    /// Replica sets on their way out (`remove-brick start`): they take no new files, and the
    /// rebalance moves theirs off.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draining: Vec<usize>,
    /// The rebalance the leader runs or ran (`rebalance start`, `remove-brick start`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalanceDef>,
    /// Each replica set's bricks by index, when they are not `replica` consecutive bricks (the
    /// replica count was raised online: a set's new bricks are further down the list). Empty:
    /// consecutive.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sets: Vec<Vec<usize>>,
    /// The replica count was raised from this one and the new bricks are not all rebuilt yet:
    /// a change needs a majority of the old count until then (the old bricks are the only
    /// members). The heal service clears it once every brick is a member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub widening: Option<usize>,
    /// Files are stored in pieces of this many bytes spread over the replica sets (chosen at
    /// create; see `kiln_layer::shard`); None: whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_block: Option<u64>,
}

/// A rebalance as the store records it: asked for, stopped, or finished.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RebalanceDef {
    /// When it was asked for (seconds since the epoch): tells two runs apart.
    pub since: u64,
    /// `running`, `stopped`, `completed` or `failed`.
    pub state: String,
    /// Bytes per second it copies at most (0: no limit).
    #[serde(default)]
    pub rate: u64,
    /// Why it failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl VolumeDef {
    /// Each replica set's bricks, by index (removed sets too).
    pub fn set_bricks(&self) -> Vec<Vec<usize>> {
        if !self.sets.is_empty() {
            return self.sets.clone();
        }
        let r = self.replica.max(1);
        (0..self.bricks.len() / r)
            .map(|k| (k * r..(k + 1) * r).collect())
            .collect()
    }

    /// The replica sets in the volume (removed ones left out), by index.
    pub fn live_sets(&self) -> Vec<usize> {
        self.set_bricks()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.first().is_some_and(|&i| !self.bricks[i].removed))
            .map(|(k, _)| k)
            .collect()
    }

    /// Whether a rebalance should be running now.
    pub fn rebalancing(&self) -> bool {
        self.rebalance
            .as_ref()
            .is_some_and(|r| r.state == "running")
    }
}

/// Checks a volume name: 1 to 64 of `A-Z a-z 0-9 _ -`, not starting with `-`.
pub fn check_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "bad volume name {name:?}: use 1 to 64 letters, digits, '_' or '-' (not first)"
        )))
    }
}

/// Parses `HOST:/DIR` or `HOST:PORT:/DIR` (PORT: the management port of HOST's kilnd).
pub fn parse_brick(s: &str) -> Result<BrickDef, Error> {
    let want = "want HOST:/DIR or HOST:MGMTPORT:/DIR with an absolute directory";
    let i = s
        .find(":/")
        .ok_or_else(|| Error::invalid(format!("bad brick {s:?}: {want}")))?;
    let (hp, dir) = (&s[..i], &s[i + 1..]);
    let (host, mgmt_port) = match hp.rsplit_once(':') {
        Some((h, p)) => (
            h,
            Some(p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                Error::invalid(format!("bad brick {s:?}: {p:?} is not a port; {want}"))
            })?),
        ),
        None => (hp, None),
    };
    if host.is_empty() {
        return Err(Error::invalid(format!("bad brick {s:?}: no host; {want}")));
    }
    let mut clean = PathBuf::from("/");
    for c in Path::new(dir).components() {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => clean.push(n),
            Component::CurDir | Component::ParentDir | Component::Prefix(_) => {
                return Err(Error::invalid(format!(
                    "bad brick {s:?}: the directory may not contain '.' or '..'"
                )))
            }
        }
    }
    if clean == Path::new("/") {
        return Err(Error::invalid(format!(
            "bad brick {s:?}: the root directory cannot be a brick"
        )));
    }
    Ok(BrickDef {
        host: host.to_owned(),
        mgmt_port,
        dir: clean,
        port: None,
        pid: None,
        metrics_port: None,
        settled: false,
        removed: false,
    })
}

/// The first address `host` resolves to (IPv4 preferred).
pub fn resolve(host: &str) -> Result<IpAddr, Error> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    let addrs: Vec<SocketAddr> = (host, 0)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve host {host:?}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .map(|a| a.ip())
        .ok_or_else(|| Error::invalid(format!("host {host:?} has no address")))
}

/// True when this host can bind `ip`: the brick is ours to run.
pub(crate) fn is_local(ip: IpAddr) -> bool {
    kiln_client::protocol::is_local_ip(ip)
}

/// The management port a kilnd listens on by default (the same as glusterd's).
pub const DEFAULT_MGMT_PORT: u16 = 24007;
/// `index` as a brick of `def`, or a bad-request error.
pub(crate) fn check_index(index: usize, def: &VolumeDef) -> Result<usize, Error> {
    if index < def.bricks.len() {
        Ok(index)
    } else {
        Err(Error::not_found(format!(
            "bad request: volume {} has no brick {index}",
            def.name
        )))
    }
}

/// Where `dir` of this host really is: symlinks resolved for its longest existing prefix.
pub(crate) fn real_path(dir: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut at = dir;
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            return rest.iter().rev().fold(real, |p, n| p.join(n));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                at = parent;
            }
            _ => return dir.to_owned(),
        }
    }
}

/// Refuses brick `spec`, really at `dir` on this host, when it is inside kilnd's state
/// directory `state` or contains it: the brick's clients would read `mgmt.secret` and every
/// volume's secret through it. `force` does not override this.
pub(crate) fn check_not_state(spec: &str, dir: &Path, state: &Path) -> Result<(), Error> {
    let state = real_path(state);
    if dir.starts_with(&state) || state.starts_with(dir) {
        let how = if dir.starts_with(&state) {
            "is inside"
        } else {
            "contains"
        };
        return Err(Error::invalid(format!(
            "brick {spec}: {} {how} kilnd's state directory {}, which holds the pool's \
             secrets: its clients could read them (refused even with `force`)",
            dir.display(),
            state.display()
        )));
    }
    Ok(())
}
