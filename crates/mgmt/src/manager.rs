//! The volume manager of one kilnd: its state directory, its secret, the brick processes it
//! spawned, and the heal service's view. What it does is spread by job over the sibling
//! modules (store, commands, peers, bricks, dispatch), each an `impl Manager` of its own.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex};

use kiln_proto::sync::MutexExt as _;
use kiln_server::control::Handler;

use crate::def::DEFAULT_MGMT_PORT;
use crate::healing::Healer;
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// The name of the management secret in the state directory.
pub const MGMT_SECRET_FILE: &str = "mgmt.secret";

/// The first port tried for a brick.
pub const FIRST_BRICK_PORT: u16 = 24100;
/// Brick processes this kilnd spawned (so it can reap them) — everything else it knows about
/// bricks is on disk.
#[derive(Default)]
pub(crate) struct Procs {
    pub(crate) children: HashMap<u32, Child>,
}

/// The volume manager of one kilnd.
pub struct Manager {
    pub(crate) state: PathBuf,
    /// The program and leading arguments that run a brick.
    pub(crate) exe: Vec<OsString>,
    /// This kilnd's management port.
    pub(crate) mgmt_port: Mutex<u16>,
    /// Serialises commands: one change at a time, and the children table.
    pub(crate) procs: Mutex<Procs>,
    /// The management secret: clients and other kilnds prove it, and this kilnd proves it to
    /// other kilnds.
    pub(crate) secret: Arc<[u8]>,
    /// The named identities the management port admits (see `crate::identities`).
    pub(crate) ids: Arc<kiln_server::identity::Identities>,
    /// The heal service's state (see `crate::healer`).
    pub(crate) healer: Healer,
    /// The rebalances this kilnd runs (see `crate::rebalancer`).
    pub(crate) runs: crate::rebalancing::Runs,
    /// Where brick ports start (`--brick-port-base`).
    pub(crate) first_brick_port: Mutex<u16>,
    /// The pool this kilnd is a member of (set once the management port is bound).
    pub(crate) pool: std::sync::OnceLock<Arc<crate::pool::Pool>>,
    /// `STATE_DIR/kilnd.lock`, locked while this kilnd runs: one kilnd per state directory.
    _lock: fs::File,
    /// This kilnd's TLS identity as a client of other kilnds (`--tls`).
    pub(crate) tls: std::sync::OnceLock<Arc<kiln_tls::ClientConfig>>,
}

/// Locks `state/kilnd.lock` for this process, or says which kilnd holds it.
fn lock_state(state: &Path) -> Result<fs::File, Error> {
    use std::io::{Read, Seek, Write};
    let p = state.join("kilnd.lock");
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&p)
        .with_context(|| format!("cannot open {}", p.display()))?;
    if rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
        let mut pid = String::new();
        let _ = f.read_to_string(&mut pid);
        return Err(Error::conflict(format!(
            "another kilnd (pid {}) uses the state directory {}: stop it first, or give this \
             one its own --state-dir",
            pid.trim(),
            state.display()
        )));
    }
    let _ = f.set_len(0);
    let _ = f.rewind();
    let _ = writeln!(f, "{}", std::process::id());
    Ok(f)
}

/// The process's umask, unchanged (reading it means setting it: set and set back).
pub fn current_umask() -> u32 {
    let m = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
    rustix::process::umask(m);
    m.bits()
}

/// Gives the management daemon its umask (`was`, from [`current_umask`] at start; at least
/// 022) back after its placeholder brick opened: a brick clears the process's umask to store
/// modes exactly as clients ask, but what kilnd itself makes — state directories, brick logs,
/// new brick directories (a volume's root) — must not be writable by everyone.
pub fn restore_umask(was: u32) {
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(was | 0o022));
}

/// Takes write permission for group and others off what kilnd keeps in `state`: every entry
/// below it owned by root (kilnd's own; not following symlinks; the directory itself keeps
/// its mode). Older kilnds ran with umask 0 (their placeholder brick's) and left their state
/// world-writable — brick volfiles root runs, the pool's log, the logs — and an upgrade must
/// not keep that. Bricks (directories holding `.kiln`), here or elsewhere, are the volumes'
/// data and keep their modes.
///
/// The walk holds what it looks at open: each directory is read through a descriptor opened
/// beneath its parent's without following links, and each entry is examined and changed
/// through one `O_PATH` descriptor (`/proc/self/fd/N`), so an entry swapped for a symlink
/// meanwhile is never followed out of the tree.
fn tighten(state: &Path) {
    use rustix::fs::{Mode, OFlags};
    let Ok(top) = rustix::fs::open(
        state,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    let mut fixed = 0usize;
    tighten_below(&top, 0, &mut fixed);
    if fixed > 0 {
        tracing::warn!(
            "{fixed} entries in {} were writable by group or others (left by an older kilnd): \
             made writable by their owner only",
            state.display()
        );
    }
}

/// [`tighten`] for the entries of the open directory `dir`, `depth` levels down.
fn tighten_below(dir: &std::os::fd::OwnedFd, depth: u32, fixed: &mut usize) {
    use rustix::fs::{AtFlags, FileType, Mode, OFlags};
    use std::os::fd::AsRawFd;
    if depth > 32 {
        return;
    }
    let Ok(mut entries) = rustix::fs::Dir::read_from(dir) else {
        return;
    };
    while let Some(Ok(e)) = entries.next() {
        let name = e.file_name();
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let Ok(fd) = rustix::fs::openat(dir, name, flags, Mode::empty()) else {
            continue;
        };
        let Ok(st) = rustix::fs::fstat(&fd) else {
            continue;
        };
        let kind = FileType::from_raw_mode(st.st_mode);
        if kind == FileType::Symlink || st.st_uid != 0 {
            continue;
        }
        // A directory is read through its own descriptor: the same directory as examined
        // (not one swapped in since), and not a brick (a volume's data, marked by `.kiln`:
        // the placeholder brick, or a brick an admin put here), whose modes are its users'.
        let mut below = None;
        if kind == FileType::Directory {
            let sub = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let Ok(d) = rustix::fs::openat(dir, name, sub, Mode::empty()) else {
                continue;
            };
            let same =
                rustix::fs::fstat(&d).is_ok_and(|s| s.st_ino == st.st_ino && s.st_dev == st.st_dev);
            let brick = rustix::fs::statat(&d, ".kiln", AtFlags::SYMLINK_NOFOLLOW).is_ok();
            if !same || brick {
                continue;
            }
            below = Some(d);
        }
        let mode = st.st_mode & 0o7777;
        if mode & 0o022 != 0 {
            let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
            if rustix::fs::chmod(path.as_str(), Mode::from_raw_mode(mode & !0o022)).is_ok() {
                *fixed += 1;
            }
        }
        if let Some(d) = below {
            tighten_below(&d, depth + 1, fixed);
        }
    }
}

impl Manager {
    /// Opens (creating) the state directory, and loads the management secret from
    /// `secret_file`, default `STATE_DIR/mgmt.secret` — a missing file is created with a new
    /// random secret (mode 0600). `exe` runs a brick (see `brick_command`).
    pub fn open(
        state: &Path,
        exe: Vec<OsString>,
        secret_file: Option<&Path>,
    ) -> Result<Arc<Manager>, Error> {
        // A new state directory is root's alone: it holds the secrets, the pool's log and
        // the volfiles kilnd runs bricks from.
        if !state.exists() {
            use std::os::unix::fs::DirBuilderExt;
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(state)
                .with_context(|| format!("cannot create state directory {}", state.display()))?;
        }
        for d in [state.join("vols"), state.join("mgmt-root")] {
            fs::create_dir_all(&d)
                .with_context(|| format!("cannot create state directory {}", d.display()))?;
        }
        let lock = lock_state(state)?;
        tighten(state);
        let path = secret_file
            .map(Path::to_owned)
            .unwrap_or_else(|| state.join(MGMT_SECRET_FILE));
        let existed = path.exists();
        let secret = kiln_server::auth::load_or_create(&path)
            .with_context(|| format!("management secret {}", path.display()))?;
        if !existed {
            tracing::info!(
                "{} is this kilnd's management secret: `kiln volume` reads it as root on this \
                 host; every other kilnd of the cluster needs a copy",
                path.display()
            );
        }
        if let Ok(m) = fs::metadata(&path) {
            use std::os::unix::fs::PermissionsExt;
            if m.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    "management secret {} is readable by others (mode {:o}): chmod 600 it",
                    path.display(),
                    m.permissions().mode() & 0o777
                );
            }
        }
        Ok(Arc::new(Manager {
            state: state.to_owned(),
            exe,
            mgmt_port: Mutex::new(DEFAULT_MGMT_PORT),
            procs: Mutex::default(),
            secret: secret.into(),
            ids: Arc::default(),
            healer: Healer::default(),
            runs: Default::default(),
            first_brick_port: Mutex::new(FIRST_BRICK_PORT),
            pool: std::sync::OnceLock::new(),
            _lock: lock,
            tls: std::sync::OnceLock::new(),
        }))
    }

    /// Speak TLS to other kilnds with the identity in `dir` (`kiln tls issue`; the same one
    /// the management port serves with).
    pub fn set_tls(&self, dir: &Path) -> Result<(), Error> {
        let cfg =
            kiln_tls::client_config(dir).with_context(|| format!("--tls {}", dir.display()))?;
        let _ = self.tls.set(cfg);
        Ok(())
    }

    /// The heal service's state.
    pub fn healer(&self) -> &Healer {
        &self.healer
    }

    /// The rebalances this kilnd runs.
    pub fn runs(&self) -> &crate::rebalancing::Runs {
        &self.runs
    }

    /// The management secret, for the server's handshake (`Server::with_secret`).
    pub fn secret(&self) -> Vec<u8> {
        self.secret.to_vec()
    }

    /// Brick ports are allocated from `port` up (default [`FIRST_BRICK_PORT`]).
    pub fn set_first_brick_port(&self, port: u16) {
        *self.first_brick_port.locked() = port;
    }

    /// Records the port the management server bound.
    pub fn set_mgmt_port(&self, port: u16) {
        *self.mgmt_port.locked() = port;
    }

    /// The handler to attach to the management server (together with [`Manager::secret`]).
    pub fn handler(self: &Arc<Self>) -> Handler {
        self.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &std::path::Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// State an older kilnd left world-writable loses group and other write; the state
    /// directory itself, and what a symlink in it points to, keep their modes.
    #[test]
    fn tighten_takes_write_off_group_and_others_below_the_state_dir() {
        let top = tempfile::tempdir().unwrap();
        let state = top.path().join("state");
        let outside = top.path().join("brick-root");
        std::fs::create_dir_all(state.join("vols/v/bricks")).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(state.join("vols/v/bricks/0.toml"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, state.join("vols/v/link")).unwrap();
        let set = |p: &std::path::Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        for d in ["", "vols", "vols/v", "vols/v/bricks"] {
            set(&state.join(d), 0o777);
        }
        set(&state.join("vols/v/bricks/0.toml"), 0o666);
        set(&outside, 0o1777);
        // A brick inside the state directory (marked by .kiln): the volume's data, left alone.
        std::fs::create_dir_all(state.join("inner-brick/.kiln")).unwrap();
        std::fs::write(state.join("inner-brick/shared"), "x").unwrap();
        set(&state.join("inner-brick"), 0o777);
        set(&state.join("inner-brick/shared"), 0o666);
        // Not kilnd's (a user's file): left as it is.
        std::fs::write(state.join("vols/v/users"), "x").unwrap();
        set(&state.join("vols/v/users"), 0o666);
        std::os::unix::fs::chown(state.join("vols/v/users"), Some(1000), Some(1000)).unwrap();
        super::tighten(&state);
        assert_eq!(mode(&state), 0o777, "the directory itself is the admin's");
        assert_eq!(mode(&state.join("vols")), 0o755);
        assert_eq!(mode(&state.join("vols/v/bricks")), 0o755);
        assert_eq!(mode(&state.join("vols/v/bricks/0.toml")), 0o644);
        assert_eq!(mode(&outside), 0o1777, "a symlink's target is not followed");
        assert_eq!(
            mode(&state.join("vols/v/users")),
            0o666,
            "only root's entries change"
        );
        assert_eq!(
            mode(&state.join("inner-brick")),
            0o777,
            "a brick keeps its modes"
        );
        assert_eq!(
            mode(&state.join("inner-brick/shared")),
            0o666,
            "and its files theirs"
        );
    }
}
