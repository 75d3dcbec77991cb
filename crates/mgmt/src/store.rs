//! The state directory: definitions, secrets and brick volfiles on disk, written so that a
//! crash leaves the old or the new contents, never a mix.

use std::fs;
use std::path::PathBuf;

use crate::def::{check_name, is_local, VolumeDef};
use crate::manager::Manager;
use crate::pool::{Cmd, Outcome, Versioned};
use crate::volfiles::client_volfile;
use kiln_layer::volfile::{LayerKind, Volfile};
use kiln_proto::sync::MutexExt as _;
use kiln_proto::Error;

impl Manager {
    pub(crate) fn vol_dir(&self, name: &str) -> PathBuf {
        self.state.join("vols").join(name)
    }

    pub(crate) fn secret_path(&self, name: &str) -> PathBuf {
        self.vol_dir(name).join("secret")
    }

    /// Brick `i`'s Unix socket (`STATE_DIR/run/NAME-i.sock`), unless the path is too long
    /// for one.
    pub(crate) fn brick_socket(&self, name: &str, i: usize) -> Option<PathBuf> {
        let p = self.state.join("run").join(format!("{name}-{i}.sock"));
        (p.as_os_str().len() < 100).then_some(p)
    }

    /// The client volfile, where each brick of this host is offered at its Unix socket first
    /// (clients use it when the TCP address names their own host; see
    /// `kiln_client::Volume::from_volfile`).
    pub(crate) fn client_volfile_here(&self, def: &VolumeDef) -> Result<Volfile, Error> {
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
                if let LayerKind::ProtocolClient(p) = &mut l.kind {
                    p.remote = format!("unix:{},{}", sock.display(), p.remote);
                }
            }
        }
        Ok(v)
    }

    pub(crate) fn brick_volfile_path(&self, name: &str, i: usize) -> PathBuf {
        self.vol_dir(name).join("bricks").join(format!("{i}.toml"))
    }

    /// The definition of `name` as this kilnd's copy of the pool's store holds it, with the
    /// version (log index) that last changed it.
    pub(crate) fn load_versioned(&self, name: &str) -> Result<(VolumeDef, u64), Error> {
        match self.pool()?.get(&vol_key(name)).0 {
            Some(v) => serde_json::from_value(v.value)
                .map(|d| (d, v.version))
                .map_err(|e| {
                    Error::failed(format!(
                        "volume {name}: bad definition in the pool's store: {e}"
                    ))
                }),
            None => Err(Error::not_found(format!("volume {name} does not exist"))),
        }
    }

    pub(crate) fn load(&self, name: &str) -> Result<VolumeDef, Error> {
        self.load_versioned(name).map(|(d, _)| d)
    }

    /// Every definition in the pool's store, by name.
    pub(crate) fn load_all(&self) -> Vec<VolumeDef> {
        let Ok(pool) = self.pool() else {
            return Vec::new();
        };
        pool.scan(VOL)
            .0
            .into_iter()
            .filter_map(|(k, v)| match serde_json::from_value(v.value) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::warn!("skipping {k} in the pool's store: {e}");
                    None
                }
            })
            .collect()
    }

    /// Writes the definition to the pool's store (on the leader, made by a majority).
    pub(crate) fn save(&self, def: &VolumeDef) -> Result<(), Error> {
        let value = serde_json::to_value(def).expect("a definition serialises");
        self.change(Cmd::Put {
            key: vol_key(&def.name),
            value,
            expect: None,
        })
    }

    /// Applies `cmd` to the pool's store; a conflict is an error.
    pub(crate) fn change(&self, cmd: Cmd) -> Result<(), Error> {
        match self.pool()?.write(cmd)?.outcome {
            Outcome::Done { .. } => {
                self.sync_files();
                Ok(())
            }
            Outcome::Conflict { have } => Err(Error::conflict(format!(
                "changed by another command meanwhile (now at version {have}): try again"
            ))),
        }
    }

    /// The shared secret of volume `name`'s bricks.
    pub(crate) fn read_secret(&self, name: &str) -> Result<String, Error> {
        match self.pool()?.get(&secret_key(name)).0 {
            Some(Versioned {
                value: serde_json::Value::String(s),
                ..
            }) => Ok(s),
            _ => Err(Error::not_found(format!(
                "volume {name} has no secret in the pool's store"
            ))),
        }
    }

    /// Makes this host's files a view of the pool's store: each volume's directory and the
    /// key this host's clients of it prove, `secret` (mode 0600; `kiln mount`, `kiln nbd` and
    /// root's `kiln volume` read it there): the volume's shared secret where that is on, else
    /// the pool's local identity for the volume ([`crate::identities::LOCAL`]); and no
    /// directory for a volume the store no longer holds. Called after each change this kilnd
    /// makes or applies.
    pub fn sync_files(&self) {
        // The apply hook and a command's own change may both call this: one at a time (they
        // would race on the same temporary files).
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE.locked();
        let Ok(pool) = self.pool() else { return };
        let secrets: std::collections::BTreeMap<String, String> = pool
            .scan(SECRET)
            .0
            .into_iter()
            .filter_map(|(k, v)| Some((k[SECRET.len()..].to_owned(), v.value.as_str()?.to_owned())))
            .filter(|(name, _)| check_name(name).is_ok())
            .collect();
        let defs: Vec<VolumeDef> = self
            .load_all()
            .into_iter()
            .filter(|d| secrets.contains_key(&d.name))
            .collect();
        // Shared secrets that are on, by volume.
        let on: std::collections::BTreeMap<String, String> = defs
            .iter()
            .filter(|d| d.shared_secret != Some(false))
            .map(|d| (d.name.clone(), secrets[&d.name].clone()))
            .collect();
        for def in &defs {
            let name = &def.name;
            let key = match on.get(name) {
                Some(secret) => secret.clone(),
                None => self.local_key(name),
            };
            let have = fs::read_to_string(self.secret_path(name)).unwrap_or_default();
            if have.trim() != key {
                let r = fs::create_dir_all(self.vol_dir(name).join("bricks"))
                    .map_err(Error::from)
                    .and_then(|_| {
                        write_atomic(
                            &self.vol_dir(name),
                            "secret",
                            format!("{key}\n").as_bytes(),
                            0o600,
                        )
                    });
                if let Err(e) = r {
                    tracing::warn!(volume = %name, "cannot write its key here: {e}");
                }
            }
        }
        self.sync_identities(&defs, &on);
        let dirs = fs::read_dir(self.state.join("vols"))
            .into_iter()
            .flatten()
            .flatten();
        for d in dirs {
            let name = d.file_name().to_string_lossy().into_owned();
            if check_name(&name).is_ok() && !secrets.contains_key(&name) {
                let _ = fs::remove_dir_all(d.path());
            }
        }
    }

    /// Moves the definitions a kilnd kept on its own before it had a pool (`vols/NAME/
    /// volume.json` and `secret`, where it was the authority) into the pool's store, once.
    pub fn import_local(&self) -> Result<usize, Error> {
        let pool = self.pool()?;
        if !pool.scan(VOL).0.is_empty() {
            return Ok(0);
        }
        let mut n = 0;
        let names = fs::read_dir(self.state.join("vols"))
            .into_iter()
            .flatten()
            .flatten();
        for d in names {
            let name = d.file_name().to_string_lossy().into_owned();
            let p = d.path().join("volume.json");
            let Ok(text) = fs::read(&p) else { continue };
            let def: VolumeDef = match serde_json::from_slice(&text) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!("not importing {}: {e}", p.display());
                    continue;
                }
            };
            if def.authority.is_some() || def.name != name {
                // A copy of another kilnd's volume: that kilnd imports it.
                continue;
            }
            let secret = fs::read_to_string(d.path().join("secret")).unwrap_or_default();
            let ops = vec![
                Cmd::Put {
                    key: vol_key(&name),
                    value: serde_json::to_value(&def).expect("a definition serialises"),
                    expect: Some(0),
                },
                Cmd::Put {
                    key: secret_key(&name),
                    value: secret.trim().into(),
                    expect: Some(0),
                },
            ];
            self.change(Cmd::Batch { ops })?;
            let _ = fs::remove_file(&p);
            n += 1;
            tracing::info!(volume = %name, "moved into the pool's store");
        }
        Ok(n)
    }
}

/// The store's key of a volume's definition.
pub(crate) fn vol_key(name: &str) -> String {
    format!("{VOL}{name}")
}

/// The store's key of a volume's secret.
pub(crate) fn secret_key(name: &str) -> String {
    format!("{SECRET}{name}")
}

const VOL: &str = "vol/";
const SECRET: &str = "secret/";

pub(crate) use crate::files::{hex, random, write_atomic};
