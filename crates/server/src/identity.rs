//! Who a connection speaks for, and what it may do. Every client proves the key of a named
//! identity (see `kiln_proto::auth`); the identity's capabilities are checked here, on the
//! brick, for every fop:
//!
//! - **volumes**: the volumes it may use (`*`: all); a brick admits only identities of its
//!   volume;
//! - **read-only**: fops that change anything fail with `EROFS`;
//! - **subtree**: a path prefix it is confined to (outside it, only the attributes of the
//!   directories on the way there);
//! - **users**: `as-caller` (a trusted host whose mounts send each caller's credentials; uid 0
//!   and gid 0 are squashed to nobody unless the identity holds `root`) or `as UID:GID` (every
//!   request runs as that user, whatever it says, like NFS `all_squash`); a request without
//!   credentials runs as root only for an identity that holds `root`;
//! - **devices**: may make device nodes; **admin**: may run management commands;
//! - **from**: the networks it may connect from (empty: anywhere; a Unix socket is this host
//!   and always admitted) — a key copied elsewhere is refused.
//!
//! The table comes from a file kilnd writes for each brick (`--identities FILE`, JSON, mode
//! 0600) and is read again on SIGHUP; a connection whose identity is removed or whose key
//! changes is closed then, and one whose capabilities change takes the new ones at its next
//! request.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use kiln_proto::sync::RwLockExt as _;
use kiln_proto::{Cred, Error};
use serde::{Deserialize, Serialize};

/// Whose credentials a request runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Users {
    /// The caller's own, as the client sends them (root squashed unless `root` is held).
    #[default]
    AsCaller,
    /// Always this user and group, whatever the request says.
    As {
        /// The user id.
        uid: u32,
        /// The group id.
        gid: u32,
    },
}

impl std::fmt::Display for Users {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Users::AsCaller => f.write_str("as-caller"),
            Users::As { uid, gid } => write!(f, "as {uid}:{gid}"),
        }
    }
}

impl std::str::FromStr for Users {
    type Err = Error;
    fn from_str(s: &str) -> Result<Users, Error> {
        if s == "as-caller" {
            return Ok(Users::AsCaller);
        }
        let bad = || Error::invalid(format!("bad user mapping {s:?}: want as-caller or UID:GID"));
        let (u, g) = s.split_once(':').ok_or_else(bad)?;
        Ok(Users::As {
            uid: u.parse().map_err(|_| bad())?,
            gid: g.parse().map_err(|_| bad())?,
        })
    }
}

/// What an identity may do.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Caps {
    /// The volumes it may use; `*` stands for all.
    pub volumes: Vec<String>,
    /// Nothing that changes a file, a name or an attribute.
    pub read_only: bool,
    /// The subtree it is confined to, relative to the volume's root (empty: all of it).
    pub subtree: String,
    /// Whose credentials its requests run with.
    pub users: Users,
    /// Its requests may run as root (uid 0, gid 0, or without credentials).
    pub root: bool,
    /// It may make character and block device nodes.
    pub devices: bool,
    /// It may run management commands (on a management port).
    pub admin: bool,
    /// The networks it may connect from, as CIDRs (empty: anywhere; a Unix socket is this
    /// host and always admitted). Left out of files when empty, so that bricks of the build
    /// before it still read them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub from: Vec<String>,
}

impl Caps {
    /// Checks the capabilities' own consistency: volume names, a subtree in wire form.
    pub fn check(&self) -> Result<(), Error> {
        if !self.subtree.is_empty() {
            let ok = !self.subtree.starts_with('/')
                && self
                    .subtree
                    .split('/')
                    .all(|c| !c.is_empty() && c != "." && c != ".." && c != ".kiln");
            if !ok {
                return Err(Error::invalid(format!(
                    "bad subtree {:?}: a path below the volume root, like /t1 or /vms/a",
                    self.subtree
                )));
            }
        }
        for n in &self.from {
            n.parse::<crate::access::Cidr>()
                .map_err(|e| Error::invalid(format!("bad network {n:?} to connect from: {e}")))?;
        }
        Ok(())
    }

    /// True when a client at `ip` may speak for the identity (`None`: over a Unix socket, on
    /// this host).
    pub fn admits_from(&self, ip: Option<std::net::IpAddr>) -> bool {
        let Some(ip) = ip else { return true };
        self.from.is_empty()
            || self.from.iter().any(|n| {
                n.parse::<crate::access::Cidr>()
                    .is_ok_and(|c| c.contains(ip))
            })
    }

    /// True when the identity may use `volume`.
    pub fn has_volume(&self, volume: &str) -> bool {
        self.volumes.iter().any(|v| v == "*" || v == volume)
    }

    /// The credentials a request runs with, given what the client sent (`sent`); None means
    /// the brick's own (root).
    pub fn map_cred(&self, sent: Option<&Cred>) -> Option<Cred> {
        let nobody = || Cred {
            uid: NOBODY,
            gid: NOBODY,
            groups: Vec::new(),
        };
        match (self.users, sent) {
            (Users::As { uid, gid }, _) => Some(Cred {
                uid,
                gid,
                groups: Vec::new(),
            }),
            (Users::AsCaller, None) if self.root => None,
            (Users::AsCaller, None) => Some(nobody()),
            (Users::AsCaller, Some(c)) if self.root => Some(c.clone()),
            (Users::AsCaller, Some(c)) if c.uid == 0 => Some(nobody()),
            (Users::AsCaller, Some(c)) => Some(Cred {
                uid: c.uid,
                gid: if c.gid == 0 { NOBODY } else { c.gid },
                groups: c.groups.iter().copied().filter(|g| *g != 0).collect(),
            }),
        }
    }

    /// Where `path` (a wire path) stands against the subtree.
    pub fn place(&self, path: &str) -> Place {
        let sub = self.subtree.as_str();
        if sub.is_empty()
            || path == sub
            || (path.starts_with(sub) && path.as_bytes().get(sub.len()) == Some(&b'/'))
        {
            Place::Inside
        } else if path.is_empty()
            || (sub.starts_with(path) && sub.as_bytes().get(path.len()) == Some(&b'/'))
        {
            Place::OnTheWay
        } else {
            Place::Outside
        }
    }
}

/// The user and group squashed callers become.
pub const NOBODY: u32 = 65534;

/// A path's place against an identity's subtree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// In the subtree (or no subtree).
    Inside,
    /// A directory on the way to the subtree: its attributes may be looked up, nothing more.
    OnTheWay,
    /// Elsewhere.
    Outside,
}

/// One identity: its name, its key, its capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The name it authenticates as.
    pub name: String,
    /// Its key, as its key file holds it (text).
    pub key: String,
    /// What it may do.
    #[serde(default)]
    pub caps: Caps,
}

/// The identities file a brick reads.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentitiesFile {
    /// The volume the brick serves (identities without it are not admitted).
    pub volume: String,
    /// Every identity the brick admits.
    pub identities: Vec<Identity>,
}

impl IdentitiesFile {
    /// Reads and checks `path`.
    pub fn read(path: &Path) -> Result<IdentitiesFile, Error> {
        let text = std::fs::read(path).map_err(|e| Error::io(path.display(), &e))?;
        let f: IdentitiesFile = serde_json::from_slice(&text)
            .map_err(|e| Error::invalid(format!("{}: bad identities file: {e}", path.display())))?;
        for i in &f.identities {
            kiln_proto::auth::check_identity(&i.name)
                .and_then(|()| i.caps.check())
                .map_err(|e| e.context(format_args!("{}: identity {}", path.display(), i.name)))?;
            if i.key.trim().is_empty() {
                return Err(Error::invalid(format!(
                    "{}: identity {}: no key",
                    path.display(),
                    i.name
                )));
            }
        }
        Ok(f)
    }
}

/// The identities a server admits, reloadable.
pub struct Identities {
    path: Option<PathBuf>,
    volume: RwLock<String>,
    table: RwLock<Arc<HashMap<String, Arc<Identity>>>>,
    /// Bumped at every reload: connections look their identity up again.
    version: tokio::sync::watch::Sender<u64>,
}

impl Identities {
    /// No identities but those of [`Identities::set`].
    pub fn new() -> Identities {
        Identities {
            path: None,
            volume: RwLock::default(),
            table: RwLock::default(),
            version: tokio::sync::watch::channel(0).0,
        }
    }

    /// The identities of `path` (read now; [`Identities::reload`] reads it again).
    pub fn from_file(path: &Path) -> Result<Identities, Error> {
        let ids = Identities {
            path: Some(path.to_owned()),
            ..Identities::new()
        };
        ids.reload()?;
        Ok(ids)
    }

    /// Reads the file again and replaces the table; on an error the old table stays.
    pub fn reload(&self) -> Result<(), Error> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let f = IdentitiesFile::read(path)?;
        let n = f.identities.len();
        self.set(&f.volume, f.identities);
        tracing::info!("identities: {n} from {}", path.display());
        Ok(())
    }

    /// Replaces the table with `identities` of `volume`.
    pub fn set(&self, volume: &str, identities: Vec<Identity>) {
        let table: HashMap<String, Arc<Identity>> = identities
            .into_iter()
            .filter(|i| {
                let ok = volume.is_empty() || i.caps.has_volume(volume);
                if !ok {
                    tracing::warn!(
                        identity = i.name,
                        "not admitted: not an identity of {volume}"
                    );
                }
                ok
            })
            .map(|i| (i.name.clone(), Arc::new(i)))
            .collect();
        *self.volume.write_locked() = volume.to_owned();
        *self.table.write_locked() = Arc::new(table);
        self.version.send_modify(|v| *v += 1);
    }

    /// The identity named `name`, if admitted.
    pub fn get(&self, name: &str) -> Option<Arc<Identity>> {
        self.table.read_locked().get(name).cloned()
    }

    /// Told of every reload.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.version.subscribe()
    }
}

impl Default for Identities {
    fn default() -> Identities {
        Identities::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(users: Users, root: bool) -> Caps {
        Caps {
            volumes: vec!["v".into()],
            users,
            root,
            ..Caps::default()
        }
    }

    #[test]
    fn users_map_as_documented() {
        let sent = Cred {
            uid: 0,
            gid: 0,
            groups: vec![0, 5],
        };
        let user = Cred {
            uid: 1000,
            gid: 0,
            groups: vec![0, 100],
        };
        let c = caps(Users::AsCaller, false);
        assert_eq!(
            c.map_cred(None).unwrap().uid,
            NOBODY,
            "no credentials: nobody"
        );
        assert_eq!(c.map_cred(Some(&sent)).unwrap().uid, NOBODY);
        let u = c.map_cred(Some(&user)).unwrap();
        assert_eq!(
            (u.uid, u.gid, u.groups),
            (1000, NOBODY, vec![100]),
            "gid 0 squashed"
        );
        let r = caps(Users::AsCaller, true);
        assert_eq!(r.map_cred(None), None, "root held: the brick's own");
        assert_eq!(r.map_cred(Some(&sent)), Some(sent.clone()));
        let a = caps(Users::As { uid: 7, gid: 8 }, true);
        assert_eq!(a.map_cred(Some(&sent)).unwrap().uid, 7);
        assert_eq!(a.map_cred(None).unwrap().gid, 8);
        assert_eq!(
            "12:34".parse::<Users>().unwrap(),
            Users::As { uid: 12, gid: 34 }
        );
        assert!("12".parse::<Users>().is_err() && "x:1".parse::<Users>().is_err());
    }

    #[test]
    fn networks_admit_their_addresses_and_unix_sockets() {
        let c = Caps {
            from: vec!["10.1.0.0/16".into(), "::1".into()],
            ..Caps::default()
        };
        assert!(c.check().is_ok());
        for (ip, ok) in [
            ("10.1.2.3", true),
            ("10.2.0.1", false),
            ("::1", true),
            ("::2", false),
        ] {
            assert_eq!(c.admits_from(Some(ip.parse().unwrap())), ok, "{ip}");
        }
        assert!(c.admits_from(None), "a Unix socket is this host");
        assert!(
            Caps::default().admits_from(Some("192.0.2.1".parse().unwrap())),
            "anywhere"
        );
        for bad in ["10.0.0.0/33", "10.0.0.0/+8", "host", ""] {
            let c = Caps {
                from: vec![bad.into()],
                ..Caps::default()
            };
            assert!(c.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn subtrees_confine() {
        let c = Caps {
            subtree: "t1/a".into(),
            ..Caps::default()
        };
        assert_eq!(c.place("t1/a"), Place::Inside);
        assert_eq!(c.place("t1/a/x"), Place::Inside);
        assert_eq!(c.place("t1/ab"), Place::Outside);
        assert_eq!(c.place("t1"), Place::OnTheWay);
        assert_eq!(c.place(""), Place::OnTheWay);
        assert_eq!(c.place("t2"), Place::Outside);
        assert_eq!(c.place("t"), Place::Outside);
        assert_eq!(Caps::default().place("anything"), Place::Inside);
        for bad in ["/t1", "t1/../t2", "t1//x", ".kiln", "a/./b"] {
            let c = Caps {
                subtree: bad.into(),
                ..Caps::default()
            };
            assert!(c.check().is_err(), "{bad}");
        }
    }
}
