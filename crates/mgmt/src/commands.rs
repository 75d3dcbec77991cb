//! The commands that change or show volumes: create, start, stop, set, delete, info, list,
//! status and volfile.

use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use crate::bricks::port_answers;
use crate::def::{
    check_name, check_not_state, is_local, parse_brick, real_path, BrickDef, VolState, VolumeDef,
};
use crate::manager::{Manager, Procs};
use crate::pool::Cmd;
use crate::request::Request;
use crate::response::{
    BrickStatus, BrickStopped, Changed, Deleted, Health, Infos, Names, Response, Space, Statuses,
    VolfileText, VolumeStatus, VolumeView,
};
use crate::store::{hex, random, secret_key, vol_key};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

impl Manager {
    pub(crate) fn create(
        &self,
        name: &str,
        replica: Option<u64>,
        specs: &[String],
        allow: &[String],
        shard: Option<u64>,
        force: bool,
    ) -> Result<Response, Error> {
        check_name(name)?;
        if let Some(b) = shard.filter(|b| !kiln_layer::shard::valid_block(*b)) {
            return Err(Error::invalid(format!(
                "volume {name}: shard block size {b} is not a power of two from 1 MiB to 1 TiB"
            )));
        }
        let replica = match replica {
            None => 1,
            Some(r) if (1..=64).contains(&r) => r as usize,
            Some(r) => {
                return Err(Error::invalid(format!(
                    "bad replica count {r}: want a number from 1 to 64"
                )))
            }
        };
        if specs.is_empty() {
            return Err(Error::invalid(format!(
                "volume {name}: no bricks given (want HOST:/DIR, at least {replica})"
            )));
        }
        if !specs.len().is_multiple_of(replica) {
            return Err(Error::invalid(format!(
                "volume {name}: {} brick(s) do not make replica sets of {replica}: give a \
                 multiple of {replica} bricks",
                specs.len()
            )));
        }
        if self.load(name).is_ok() {
            return Err(Error::exists(format!("volume {name} already exists")));
        }
        let allow = crate::options::check_allow(allow)?;
        let (bricks, ips) = self.check_bricks(specs, force)?;
        for (b, ip) in bricks.iter().zip(&ips) {
            if is_local(*ip) {
                fs::create_dir_all(&b.dir).map_err(|e| {
                    Error::io(
                        format_args!("cannot create brick directory {}", b.dir.display()),
                        &e,
                    )
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
            // New volumes admit named identities only (see `kiln auth`).
            shared_secret: Some(false),
            shard_block: shard,
            ..VolumeDef::default()
        };
        // Every other host with a brick is in the pool, and creates its brick directories
        // now: a host that cannot is found before the volume exists.
        for addr in self.peers(&def) {
            self.check_member(addr)
                .and_then(|_| self.sync_to(addr, &def))
                .with_context(|| format!("volume {name} not created"))?;
        }
        // The definition and its secret, in one change: both or neither.
        let ops = vec![
            Cmd::Put {
                key: vol_key(name),
                value: serde_json::to_value(&def).expect("a definition serialises"),
                expect: Some(0),
            },
            Cmd::Put {
                key: secret_key(name),
                value: secret.into(),
                expect: Some(0),
            },
        ];
        self.change(Cmd::Batch { ops })
            .with_context(|| format!("volume {name} not created"))?;
        tracing::info!(volume = %name, "volume created ({} bricks)", def.bricks.len());
        Ok(Changed {
            volume: VolumeView::from(&def),
            warnings: replica_warning(replica),
        }
        .into())
    }

    /// Parses `specs` and refuses a brick given twice, bricks that nest, a brick that overlaps
    /// a brick of another volume or this kilnd's state directory — compared where they really
    /// are on this host (a symlink resolved), even with `force` — and, unless `force`, a
    /// system or home directory; returns the bricks and their hosts' addresses.
    pub(crate) fn check_bricks(
        &self,
        specs: &[String],
        force: bool,
    ) -> Result<(Vec<BrickDef>, Vec<IpAddr>), Error> {
        let mut bricks = Vec::new();
        let mut ips = Vec::new();
        let mut real: Vec<PathBuf> = Vec::new();
        for s in specs {
            let b = parse_brick(s)?;
            let ip = b.ip().with_context(|| format!("brick {s}"))?;
            let r = real_dir(&b.dir, ip);
            if is_local(ip) {
                check_not_state(s, &r, &self.state)?;
            }
            if !force {
                if let Some(what) = system_dir_kind(&r) {
                    return Err(Error::invalid(format!(
                        "brick {s}: {} is {what}, not a place for a brick: clients could \
                         read and change what the system keeps there (add `force` to use it \
                         anyway)",
                        r.display()
                    )));
                }
            }
            ips.push(ip);
            bricks.push(b);
            real.push(r);
        }
        // Same host (by address), same or nested directory: refuse.
        for j in 0..bricks.len() {
            for i in 0..j {
                if ips[i] != ips[j] {
                    continue;
                }
                let (a, b) = (&bricks[i], &bricks[j]);
                let (ad, bd) = (&real[i], &real[j]);
                if ad == bd {
                    return Err(Error::invalid(format!("brick {} is given twice", b.spec())));
                }
                if bd.starts_with(ad) || ad.starts_with(bd) {
                    return Err(Error::invalid(format!(
                        "bricks {} and {} nest: a brick may not be inside another",
                        a.spec(),
                        b.spec()
                    )));
                }
            }
        }
        for other in self.load_all() {
            for ob in other.bricks.iter().filter(|b| !b.removed) {
                let Ok(oip) = ob.ip() else { continue };
                let od = real_dir(&ob.dir, oip);
                for ((b, ip), bd) in bricks.iter().zip(&ips).zip(&real) {
                    if *ip == oip && (bd.starts_with(&od) || od.starts_with(bd)) {
                        return Err(Error::conflict(format!(
                            "brick {} overlaps brick {} of volume {}: the clients of each \
                             could read and change the other's files (refused even with \
                             `force`)",
                            b.spec(),
                            ob.spec(),
                            other.name
                        )));
                    }
                }
            }
        }
        Ok((bricks, ips))
    }

    pub(crate) fn start(
        &self,
        procs: &mut Procs,
        name: &str,
        force: bool,
    ) -> Result<Response, Error> {
        let mut def = self.load(name)?;
        if def.state == VolState::Started && !force {
            return Err(Error::conflict(format!(
                "volume {name} is already started (`start {name} force` restarts bricks that \
                 are down)"
            )));
        }
        let secret = self.read_secret(name)?;
        let mut errors = Vec::new();
        let mut up = 0;
        for i in 0..def.bricks.len() {
            let b = def.bricks[i].clone();
            if b.removed {
                continue;
            }
            let r = match b.ip() {
                Ok(ip) if is_local(ip) => self.ensure_brick(procs, &def, i),
                Ok(_) => self.remote_brick_start(&def, i, &secret),
                Err(e) => Err(e),
            };
            match r {
                Ok(r) => {
                    r.record_in(&mut def.bricks[i]);
                    up += 1;
                }
                Err(e) => errors.push(format!("brick {}: {e}", b.spec())),
            }
        }
        if up > 0 {
            def.state = VolState::Started;
        }
        self.save(&def)?;
        let warnings = Vec::new();
        if !errors.is_empty() {
            return Err(Error::failed(format!(
                "volume {name}: {} of {} bricks did not start: {}",
                errors.len(),
                def.bricks.len(),
                errors.join("; ")
            )));
        }
        tracing::info!(volume = %name, "volume started");
        Ok(Changed {
            volume: VolumeView::from(&def),
            warnings,
        }
        .into())
    }

    pub(crate) fn stop(&self, procs: &mut Procs, name: &str) -> Result<Response, Error> {
        let mut def = self.load(name)?;
        if def.state != VolState::Started {
            return Err(Error::conflict(format!("volume {name} is not started")));
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
                    self.call_peer::<BrickStopped>(
                        a,
                        &Request::BrickStop {
                            name: name.to_owned(),
                            index: i,
                        },
                    )
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
        let warnings = Vec::new();
        if !errors.is_empty() {
            return Err(Error::failed(format!(
                "volume {name} stopped, but {} brick(s) may still run: {}",
                errors.len(),
                errors.join("; ")
            )));
        }
        tracing::info!(volume = %name, "volume stopped");
        Ok(Changed {
            volume: VolumeView::from(&def),
            warnings,
        }
        .into())
    }

    /// Changes the options given (the others stay), all or none. A started volume's bricks
    /// are restarted to take a brick option (see [`crate::options::OPTIONS`]); clients
    /// reconnect by themselves. The others are in the clients' graph: running clients
    /// switch to them.
    pub(crate) fn set(
        &self,
        procs: &mut Procs,
        name: &str,
        options: &[(String, String)],
    ) -> Result<Response, Error> {
        let mut def = self.load(name)?;
        if options.is_empty() {
            return Err(Error::invalid(format!(
                "volume {name}: no option given to set"
            )));
        }
        let mut restart = false;
        for (option, value) in options {
            restart |= crate::options::apply(&mut def, option, value)?;
        }
        self.save(&def)?;
        let mut warnings = Vec::new();
        if def.state == VolState::Started && restart {
            let secret = self.read_secret(name)?;
            for i in 0..def.bricks.len() {
                let b = def.bricks[i].clone();
                if b.removed {
                    continue;
                }
                let r = match b.ip() {
                    Ok(ip) if is_local(ip) => {
                        self.stop_brick(procs, &def, i);
                        def.bricks[i].pid = None;
                        self.ensure_brick(procs, &def, i)
                    }
                    Ok(_) => b
                        .mgmt_addr()
                        .and_then(|a| {
                            self.call_peer::<BrickStopped>(
                                a,
                                &Request::BrickStop {
                                    name: name.to_owned(),
                                    index: i,
                                },
                            )
                        })
                        .and_then(|_| {
                            def.bricks[i].pid = None;
                            self.remote_brick_start(&def, i, &secret)
                        }),
                    Err(e) => Err(e),
                };
                match r {
                    Ok(r) => r.record_in(&mut def.bricks[i]),
                    Err(e) => warnings.push(format!("brick {}: not restarted: {e}", b.spec())),
                }
            }
            self.save(&def)?;
        }
        tracing::info!(volume = name, allow = ?def.allow, "volume options set");
        Ok(Changed {
            volume: VolumeView::from(&def),
            warnings,
        }
        .into())
    }

    pub(crate) fn delete(&self, name: &str) -> Result<Response, Error> {
        let def = self.load(name)?;
        if def.state == VolState::Started {
            return Err(Error::conflict(format!(
                "volume {name} is started: stop it first"
            )));
        }
        let warnings = Vec::new();
        // Every member removes its files of the volume when it applies this.
        let ops = vec![
            Cmd::Delete {
                key: vol_key(name),
                expect: None,
            },
            Cmd::Delete {
                key: secret_key(name),
                expect: None,
            },
        ];
        self.change(Cmd::Batch { ops })
            .with_context(|| format!("cannot remove volume {name}"))?;
        tracing::info!(volume = %name, "volume deleted (brick data left in place)");
        Ok(Deleted {
            volume: name.to_owned(),
            deleted: true,
            warnings,
        }
        .into())
    }

    pub(crate) fn info(&self, name: Option<&str>) -> Result<Response, Error> {
        // Read first: the definitions below are at least this new.
        let version = self.pool()?.version();
        let defs = match name {
            Some(n) => {
                check_name(n)?;
                vec![self.load(n)?]
            }
            None => self.load_all(),
        };
        Ok(Infos {
            volumes: defs.iter().map(VolumeView::from).collect(),
            version,
        }
        .into())
    }

    pub(crate) fn list(&self) -> Result<Response, Error> {
        let names: Vec<String> = self.load_all().into_iter().map(|d| d.name).collect();
        Ok(Names { volumes: names }.into())
    }

    pub(crate) fn status(&self, procs: &mut Procs, name: Option<&str>) -> Result<Response, Error> {
        let defs = match name {
            Some(n) => {
                check_name(n)?;
                vec![self.load(n)?]
            }
            None => self.load_all(),
        };
        // The member that makes changes, when not this one.
        let pool = self.pool()?;
        let leader = pool
            .leader()
            .filter(|(id, _)| *id != pool.id())
            .map(|(_, a)| a);
        let mut vols = Vec::new();
        for def in &defs {
            let mut bricks = Vec::new();
            for (i, b) in def.bricks.iter().enumerate().filter(|(_, b)| !b.removed) {
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
                let (space, health) = if local {
                    (Space::of(&b.dir), Health::of(&b.dir))
                } else {
                    (None, None)
                };
                bricks.push(BrickStatus::of(b, online, space, health));
            }
            vols.push(VolumeStatus {
                name: def.name.clone(),
                state: def.state,
                authority: leader.clone(),
                bricks,
                heal: self.healer.view(&def.name),
                rebalance: def.rebalance.as_ref().map(|_| self.rebalance_view(def)),
            });
        }
        Ok(Statuses {
            volumes: vols,
            metrics: kiln_metrics::local_endpoint().map(|a| a.to_string()),
        }
        .into())
    }

    pub(crate) fn volfile(&self, name: &str) -> Result<Response, Error> {
        check_name(name)?;
        let (def, graph) = self.load_versioned(name)?;
        if def.state != VolState::Started {
            return Err(Error::conflict(format!("volume {name} is not started")));
        }
        let v = self.client_volfile_here(&def)?;
        let servers = self
            .pool()?
            .view(false)
            .members
            .into_iter()
            .map(|m| match m.addr.starts_with("tcp:") {
                true => m.addr,
                false => format!("tcp:{}", m.addr),
            })
            .collect();
        Ok(VolfileText {
            volume: name.to_owned(),
            volfile: v.to_toml(),
            graph,
            servers,
        }
        .into())
    }
}

/// Where `dir` really is, when its host is this one: symlinks resolved, for the part of it
/// that exists. A brick elsewhere is taken as given.
fn real_dir(dir: &Path, ip: IpAddr) -> PathBuf {
    if !is_local(ip) {
        return dir.to_owned();
    }
    real_path(dir)
}

/// What `dir` is when it is one of the host's own directories, where a brick would mix
/// volume data with the system's or a user's (or be the whole file system): `/`, `/etc`,
/// `/usr` and the like and anything under those that only the system uses, `/var/lib`,
/// `/root`, `/home` and each home directory in it.
fn system_dir_kind(dir: &Path) -> Option<&'static str> {
    const TOP: &[&str] = &[
        "/",
        "/home",
        "/mnt",
        "/media",
        "/opt",
        "/srv",
        "/tmp",
        "/var",
        "/var/cache",
        "/var/lib",
        "/var/log",
        "/var/mail",
        "/var/spool",
        "/var/tmp",
    ];
    const TREES: &[&str] = &[
        "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
        "/sbin", "/sys", "/usr",
    ];
    if dir == Path::new("/root") || dir.parent() == Some(Path::new("/home")) {
        return Some("a home directory");
    }
    (TOP.iter().any(|t| dir == Path::new(t)) || TREES.iter().any(|t| dir.starts_with(t)))
        .then_some("a system directory")
}

/// What a new volume of `replica` copies warns of: replica 2 is prone to split-brain.
fn replica_warning(replica: usize) -> Vec<String> {
    if replica != 2 {
        return Vec::new();
    }
    vec![
        "replica 2 volumes are prone to split-brain: when the two copies of a file change \
          apart (each brick cut off from the other while clients write), no majority says \
          which is right. Replica 3 avoids it."
            .to_owned(),
    ]
}
