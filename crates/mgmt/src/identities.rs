//! Named identities in the pool's store (`auth/NAME`: a key and its capabilities, see
//! `kiln_server::identity`), the `auth` command that manages them, and the files that carry
//! them to this host's bricks (`vols/NAME/identities.json`, mode 0600, read again on SIGHUP).
//! Every member writes its bricks' files from its own copy of the store as it applies a
//! change, so a key added, rotated or removed anywhere reaches every brick of the pool.
//!
//! kilnd's own services (heal, rebalance) speak for the internal identity `kilnd`: root on
//! the volume's bricks, with a key every member derives from the management secret
//! ([`Manager::service_key`]), so it is never stored or sent.
//!
//! Clients on the pool's own hosts (a mount on a brick host, `kiln nbd` beside kilnd) speak
//! for `local.VOLUME`: as-caller, root squashed as the volume says, admitted only from the
//! members' addresses and loopback. Its key is derived the same way and written for them to
//! `vols/VOLUME/secret` (where the volume's shared secret is on, that file holds the shared
//! secret instead), so a pool host needs no key of its own and the key is no use elsewhere.

use std::collections::BTreeMap;

use kiln_server::identity::{Caps, Identities, IdentitiesFile, Identity};
use serde::{Deserialize, Serialize};

use crate::def::VolumeDef;
use crate::manager::Manager;
use crate::pool::Cmd;
pub use crate::request::AuthOp;
use crate::response::{IdentityList, IdentityView, Response};
use crate::store::{hex, random, write_atomic};
use kiln_proto::Error;

/// The name kilnd's own services authenticate as.
pub const INTERNAL: &str = "kilnd";

/// The prefix of the identity of clients on the pool's own hosts (`local.VOLUME`).
pub const LOCAL: &str = "local.";

const AUTH: &str = "auth/";

/// What the store keeps of an identity.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Stored {
    key: String,
    caps: Caps,
}

fn view(name: &str, s: &Stored, key: bool) -> IdentityView {
    IdentityView {
        name: name.to_owned(),
        key: key.then(|| format!("{name} {}", s.key)),
        caps: s.caps.clone(),
    }
}

fn new_key() -> Result<String, Error> {
    let mut raw = [0u8; 32];
    random(&mut raw)?;
    Ok(hex(&raw))
}

/// Capabilities as a command gives them: present, consistent, naming a volume.
fn checked(c: Option<Caps>) -> Result<Caps, Error> {
    let c = c.ok_or(Error::invalid("give the identity's capabilities"))?;
    c.check()?;
    if c.volumes.is_empty() {
        return Err(Error::invalid(
            "name the volumes the identity may use (or *)",
        ));
    }
    Ok(c)
}

/// The key line (`kilnd HEX`) of kilnd's own services on `volume`'s bricks, derived from the
/// pool's management secret: whoever holds that (a pool member's root) can heal as kilnd does.
pub fn service_key(mgmt_secret: &[u8], volume: &str) -> String {
    let label = format!("kiln internal identity of volume {volume}");
    format!(
        "{INTERNAL} {}",
        hex(&kiln_proto::auth::mac(mgmt_secret, label.as_bytes()))
    )
}

/// The key line (`local.VOLUME HEX`) of clients of `volume` on the pool's hosts, derived from
/// the management secret like [`service_key`].
pub fn local_key(mgmt_secret: &[u8], volume: &str) -> String {
    let label = format!("kiln local client identity of volume {volume}");
    format!(
        "{LOCAL}{volume} {}",
        hex(&kiln_proto::auth::mac(mgmt_secret, label.as_bytes()))
    )
}

/// What the clients of `def` on the pool's hosts may do: the volume, as their callers (root
/// squashed, and no device nodes, when the volume squashes root), from `from` only.
fn local_caps(def: &VolumeDef, from: Vec<String>) -> Caps {
    Caps {
        volumes: vec![def.name.clone()],
        root: !def.root_squash,
        devices: !def.root_squash,
        from,
        ..Caps::default()
    }
}

/// An identity from a key line (`NAME HEX`).
fn derived(line: String, caps: Caps) -> Identity {
    let (name, key) = line.split_once(' ').unwrap_or_default();
    Identity {
        name: name.to_owned(),
        key: key.to_owned(),
        caps,
    }
}

impl Manager {
    /// The key line (`kilnd HEX`) of kilnd's own services on `volume`'s bricks.
    pub(crate) fn service_key(&self, volume: &str) -> String {
        service_key(&self.secret, volume)
    }

    /// The key line (`local.VOLUME HEX`) of `volume`'s clients on the pool's hosts.
    pub(crate) fn local_key(&self, volume: &str) -> String {
        local_key(&self.secret, volume)
    }

    /// Where the pool's hosts connect from: every member's management address, every
    /// brick's address (a storage network of their own), and loopback.
    fn pool_networks(&self) -> Vec<String> {
        let mut nets: std::collections::BTreeSet<String> =
            ["127.0.0.0/8".to_owned(), "::1".to_owned()].into();
        if let Ok(pool) = self.pool() {
            for m in pool.view(false).members {
                if let Ok(a) = m.addr.parse::<std::net::SocketAddr>() {
                    nets.insert(a.ip().to_canonical().to_string());
                }
            }
        }
        for def in self.load_all() {
            for b in &def.bricks {
                if let Ok(ip) = b.ip() {
                    nets.insert(ip.to_canonical().to_string());
                }
            }
        }
        nets.into_iter().collect()
    }

    /// True for the names kilnd keeps for its own identities.
    fn reserved(name: &str) -> bool {
        name == INTERNAL || name.starts_with("vol.") || name.starts_with(LOCAL)
    }

    /// The identities the management port admits (those with the admin capability may run
    /// commands).
    pub fn identities(&self) -> std::sync::Arc<Identities> {
        self.ids.clone()
    }

    fn stored(&self) -> BTreeMap<String, Stored> {
        let Ok(pool) = self.pool() else {
            return BTreeMap::new();
        };
        pool.scan(AUTH)
            .0
            .into_iter()
            .filter_map(|(k, v)| {
                let s: Stored = serde_json::from_value(v.value).ok()?;
                Some((k[AUTH.len()..].to_owned(), s))
            })
            // A name kilnd now keeps for itself, stored before it did, never stands for one
            // of kilnd's identities.
            .filter(|(n, _)| !Self::reserved(n))
            .collect()
    }

    /// Runs `kiln auth OP`.
    pub(crate) fn auth(
        &self,
        op: AuthOp,
        name: Option<&str>,
        caps: Option<Caps>,
    ) -> Result<Response, Error> {
        let one = |v: IdentityView| -> Response {
            IdentityList {
                identities: vec![v],
            }
            .into()
        };
        if op == AuthOp::List {
            return Ok(IdentityList {
                identities: self
                    .stored()
                    .iter()
                    .map(|(n, s)| view(n, s, false))
                    .collect(),
            }
            .into());
        }
        let n = name.ok_or(Error::invalid("name the identity"))?;
        kiln_proto::auth::check_identity(n)?;
        if Self::reserved(n) {
            return Err(Error::invalid(format!(
                "{n} is a name kilnd keeps for its own identities: choose another"
            )));
        }
        match op {
            AuthOp::List => unreachable!("answered above"),
            AuthOp::Get => Ok(one(view(n, &self.existing(n)?.0, true))),
            AuthOp::Add => {
                if self.existing(n).is_ok() {
                    return Err(Error::exists(format!(
                        "identity {n} exists: `kiln auth caps` changes it"
                    )));
                }
                let s = Stored {
                    key: new_key()?,
                    caps: checked(caps)?,
                };
                self.put(n, &s, 0)?;
                tracing::info!(identity = n, "identity added");
                Ok(one(view(n, &s, true)))
            }
            AuthOp::Caps => {
                let (mut s, version) = self.existing(n)?;
                s.caps = checked(caps)?;
                self.put(n, &s, version)?;
                tracing::info!(identity = n, "identity's capabilities changed");
                Ok(one(view(n, &s, false)))
            }
            AuthOp::Rotate => {
                let (mut s, version) = self.existing(n)?;
                s.key = new_key()?;
                self.put(n, &s, version)?;
                tracing::info!(identity = n, "identity's key rotated");
                Ok(one(view(n, &s, true)))
            }
            AuthOp::Rm => {
                let (s, version) = self.existing(n)?;
                self.change(Cmd::Delete {
                    key: format!("{AUTH}{n}"),
                    expect: Some(version),
                })?;
                tracing::info!(identity = n, "identity removed");
                Ok(one(view(n, &s, false)))
            }
        }
    }

    /// Identity `n` as the store holds it, and the version to change it at.
    fn existing(&self, n: &str) -> Result<(Stored, u64), Error> {
        let (v, _) = self.pool()?.get(&format!("{AUTH}{n}"));
        let v = v.ok_or_else(|| Error::not_found(format!("no identity {n}")))?;
        let s = serde_json::from_value(v.value).map_err(|e| {
            Error::failed(format!("identity {n}: bad record in the pool's store: {e}"))
        })?;
        Ok((s, v.version))
    }

    /// Stores identity `n` if the store still has it at `expect` (0: not at all).
    fn put(&self, n: &str, s: &Stored, expect: u64) -> Result<(), Error> {
        self.change(Cmd::Put {
            key: format!("{AUTH}{n}"),
            value: serde_json::to_value(s).expect("an identity serialises"),
            expect: Some(expect),
        })
    }

    /// The identities file of `def`'s bricks: kilnd's own, its local clients', and every
    /// stored identity that may use the volume.
    pub(crate) fn identities_file(&self, def: &VolumeDef) -> IdentitiesFile {
        let volume = def.name.as_str();
        let own = Caps {
            volumes: vec![volume.to_owned()],
            root: true,
            devices: true,
            ..Caps::default()
        };
        let mut identities = vec![
            derived(self.service_key(volume), own),
            derived(
                self.local_key(volume),
                local_caps(def, self.pool_networks()),
            ),
        ];
        identities.extend(
            self.stored()
                .into_iter()
                .filter(|(_, s)| s.caps.has_volume(volume))
                .map(|(name, s)| Identity {
                    name,
                    key: s.key,
                    caps: s.caps,
                }),
        );
        IdentitiesFile {
            volume: volume.to_owned(),
            identities,
        }
    }

    /// Writes `def`'s identities file when it differs from the store; true when it did.
    pub(crate) fn write_identities(&self, def: &VolumeDef) -> Result<bool, Error> {
        let text =
            serde_json::to_vec_pretty(&self.identities_file(def)).expect("identities serialise");
        let dir = self.vol_dir(&def.name);
        if std::fs::read(dir.join("identities.json")).is_ok_and(|t| t == text) {
            return Ok(false);
        }
        write_atomic(&dir, "identities.json", &text, 0o600)?;
        Ok(true)
    }

    /// After a change of the store: every volume's identities file here, bricks told of a
    /// new one (SIGHUP), and the management port's own table. `secrets` holds each volume's
    /// shared secret where it is on.
    pub(crate) fn sync_identities(&self, defs: &[VolumeDef], secrets: &BTreeMap<String, String>) {
        let stored = self.stored();
        let mut ids: Vec<Identity> = stored
            .iter()
            .map(|(n, s)| Identity {
                name: n.clone(),
                key: s.key.clone(),
                caps: s.caps.clone(),
            })
            .collect();
        let from = self.pool_networks();
        for def in defs {
            let v = &def.name;
            // Here, a volume's shared secret (where it is on) and its local clients' key only
            // fetch that volume's graph.
            let fetch = Caps {
                volumes: vec![v.clone()],
                ..Caps::default()
            };
            if let Some(secret) = secrets.get(v) {
                ids.push(Identity {
                    name: format!("vol.{v}"),
                    key: secret.clone(),
                    caps: fetch.clone(),
                });
            }
            ids.push(derived(
                self.local_key(v),
                Caps {
                    from: from.clone(),
                    ..fetch
                },
            ));
        }
        self.ids.set("", ids);
        for def in defs {
            match self.write_identities(def) {
                Ok(true) => crate::orphans::signal_bricks(
                    &self.state,
                    &def.name,
                    rustix::process::Signal::HUP,
                ),
                Ok(false) => {}
                Err(e) => tracing::warn!(volume = %def.name, "identities not written: {e}"),
            }
        }
    }
}
