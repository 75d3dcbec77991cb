//! Named identities in the pool's store (`auth/NAME`: a key and its capabilities, see
//! `kiln_server::identity`), the `auth` command that manages them, and the files that carry
//! them to this host's bricks (`vols/NAME/identities.json`, mode 0600, read again on SIGHUP).
//! Every member writes its bricks' files from its own copy of the store as it applies a
//! change, so a key added, rotated or removed anywhere reaches every brick of the pool.
//!
//! kilnd's own services (heal, rebalance) speak for the internal identity `kilnd`: root on
//! the volume's bricks, with a key every member derives from the management secret
//! ([`Manager::service_key`]), so it is never stored or sent.

use std::collections::BTreeMap;

use kiln_server::identity::{Caps, Identities, IdentitiesFile, Identity};
use serde::{Deserialize, Serialize};

use crate::manager::Manager;
use crate::pool::Cmd;
pub use crate::request::AuthOp;
use crate::response::{IdentityList, IdentityView, Response};
use crate::store::{hex, random, write_atomic};

/// The name kilnd's own services authenticate as.
pub const INTERNAL: &str = "kilnd";

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

fn new_key() -> Result<String, String> {
    let mut raw = [0u8; 32];
    random(&mut raw)?;
    Ok(hex(&raw))
}

/// Capabilities as a command gives them: present, consistent, naming a volume.
fn checked(c: Option<Caps>) -> Result<Caps, String> {
    let c = c.ok_or("give the identity's capabilities")?;
    c.check()?;
    if c.volumes.is_empty() {
        return Err("name the volumes the identity may use (or *)".into());
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

impl Manager {
    /// The key line (`kilnd HEX`) of kilnd's own services on `volume`'s bricks.
    pub(crate) fn service_key(&self, volume: &str) -> String {
        service_key(&self.secret, volume)
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
            .collect()
    }

    /// Runs `kiln auth OP`.
    pub(crate) fn auth(
        &self,
        op: AuthOp,
        name: Option<&str>,
        caps: Option<Caps>,
    ) -> Result<Response, String> {
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
        let n = name.ok_or("name the identity")?;
        kiln_proto::auth::check_identity(n)?;
        if n == INTERNAL || n.starts_with("vol.") {
            return Err(format!(
                "{n} is a name kilnd keeps for its own identities: choose another"
            ));
        }
        match op {
            AuthOp::List => unreachable!("answered above"),
            AuthOp::Get => Ok(one(view(n, &self.existing(n)?.0, true))),
            AuthOp::Add => {
                if self.existing(n).is_ok() {
                    return Err(format!("identity {n} exists: `kiln auth caps` changes it"));
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
    fn existing(&self, n: &str) -> Result<(Stored, u64), String> {
        let (v, _) = self.pool()?.get(&format!("{AUTH}{n}"));
        let v = v.ok_or_else(|| format!("no identity {n}"))?;
        let s = serde_json::from_value(v.value)
            .map_err(|e| format!("identity {n}: bad record in the pool's store: {e}"))?;
        Ok((s, v.version))
    }

    /// Stores identity `n` if the store still has it at `expect` (0: not at all).
    fn put(&self, n: &str, s: &Stored, expect: u64) -> Result<(), String> {
        self.change(Cmd::Put {
            key: format!("{AUTH}{n}"),
            value: serde_json::to_value(s).expect("an identity serialises"),
            expect: Some(expect),
        })
    }

    /// The identities file of `volume`'s bricks: kilnd's own, and every stored identity that
    /// may use the volume.
    pub(crate) fn identities_file(&self, volume: &str) -> IdentitiesFile {
        let mut identities = vec![Identity {
            name: INTERNAL.into(),
            key: self
                .service_key(volume)
                .split_once(' ')
                .map(|(_, k)| k.to_owned())
                .unwrap_or_default(),
            caps: Caps {
                volumes: vec![volume.to_owned()],
                root: true,
                devices: true,
                ..Caps::default()
            },
        }];
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

    /// Writes `volume`'s identities file when it differs from the store; true when it did.
    pub(crate) fn write_identities(&self, volume: &str) -> Result<bool, String> {
        let text =
            serde_json::to_vec_pretty(&self.identities_file(volume)).expect("identities serialise");
        let dir = self.vol_dir(volume);
        if std::fs::read(dir.join("identities.json")).is_ok_and(|t| t == text) {
            return Ok(false);
        }
        write_atomic(&dir, "identities.json", &text, 0o600)?;
        Ok(true)
    }

    /// After a change of the store: every volume's identities file here, bricks told of a
    /// new one (SIGHUP), and the management port's own table.
    pub(crate) fn sync_identities(&self, volumes: impl Iterator<Item = (String, Option<String>)>) {
        let stored = self.stored();
        let mut ids: Vec<Identity> = stored
            .iter()
            .map(|(n, s)| Identity {
                name: n.clone(),
                key: s.key.clone(),
                caps: s.caps.clone(),
            })
            .collect();
        let volumes: Vec<(String, Option<String>)> = volumes.collect();
        // A volume's shared secret (where it is on), here, only fetches that volume's graph.
        ids.extend(volumes.iter().filter_map(|(v, secret)| {
            Some(Identity {
                name: format!("vol.{v}"),
                key: secret.clone()?,
                caps: Caps {
                    volumes: vec![v.clone()],
                    ..Caps::default()
                },
            })
        }));
        self.ids.set("", ids);
        for (v, _) in volumes {
            match self.write_identities(&v) {
                Ok(true) => {
                    crate::orphans::signal_bricks(&self.state, &v, rustix::process::Signal::HUP)
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(volume = %v, "identities not written: {e}"),
            }
        }
    }
}
