//! The state directory: definitions, secrets and brick volfiles on disk, written so that a
//! crash leaves the old or the new contents, never a mix.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::def::{check_name, is_local, VolumeDef};
use crate::manager::Manager;
use crate::volfiles::client_volfile;
use kiln_layer::volfile::{LayerKind, Volfile};

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
    pub(crate) fn client_volfile_here(&self, def: &VolumeDef) -> Result<Volfile, String> {
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
                if let LayerKind::ProtocolClient { remote, .. } = &mut l.kind {
                    *remote = format!("unix:{},{remote}", sock.display());
                }
            }
        }
        Ok(v)
    }

    pub(crate) fn brick_volfile_path(&self, name: &str, i: usize) -> PathBuf {
        self.vol_dir(name).join("bricks").join(format!("{i}.toml"))
    }

    pub(crate) fn load(&self, name: &str) -> Result<VolumeDef, String> {
        let p = self.vol_dir(name).join("volume.json");
        let text = match fs::read(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(format!("volume {name} does not exist"))
            }
            Err(e) => return Err(format!("cannot read {}: {e}", p.display())),
        };
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", p.display()))
    }

    /// Every definition (and cached copy) this kilnd holds, by name.
    pub(crate) fn load_all(&self) -> Vec<VolumeDef> {
        let mut names: Vec<String> = fs::read_dir(self.state.join("vols"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| check_name(n).is_ok())
            .collect();
        names.sort();
        names
            .iter()
            .filter_map(|n| match self.load(n) {
                Ok(d) => Some(d),
                Err(e) => {
                    if self.vol_dir(n).join("volume.json").exists() {
                        tracing::warn!("skipping volume {n}: {e}");
                    }
                    None
                }
            })
            .collect()
    }

    /// Writes the definition: temp file, fsync, rename, fsync of the directory.
    pub(crate) fn save(&self, def: &VolumeDef) -> Result<(), String> {
        let dir = self.vol_dir(&def.name);
        let text = serde_json::to_vec_pretty(def).expect("a definition serialises");
        write_atomic(&dir, "volume.json", &text, 0o644)
    }

    pub(crate) fn write_secret(&self, name: &str, hex: &str) -> Result<(), String> {
        write_atomic(
            &self.vol_dir(name),
            "secret",
            format!("{hex}\n").as_bytes(),
            0o600,
        )
    }

    pub(crate) fn read_secret(&self, name: &str) -> Result<String, String> {
        let p = self.secret_path(name);
        fs::read_to_string(&p)
            .map(|s| s.trim().to_owned())
            .map_err(|e| {
                format!(
                    "cannot read the secret of volume {name} ({}): {e}",
                    p.display()
                )
            })
    }
}

pub(crate) fn random(buf: &mut [u8]) -> Result<(), String> {
    rustix::rand::getrandom(buf, rustix::rand::GetRandomFlags::empty())
        .map(|_| ())
        .map_err(|e| format!("cannot get random bytes: {e}"))
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Writes `dir/name` so that a crash leaves the old or the new contents, never a mix.
pub(crate) fn write_atomic(dir: &Path, name: &str, data: &[u8], mode: u32) -> Result<(), String> {
    let err = |e: io::Error| format!("cannot write {}: {e}", dir.join(name).display());
    fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(data).map_err(err)?;
    f.sync_all().map_err(err)?;
    drop(f);
    fs::rename(&tmp, dir.join(name)).map_err(err)?;
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
