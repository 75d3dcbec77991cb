//! A real FUSE mount of a real brick server, both in this process, for the mount tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::Volume;
use kiln_fuse::Mode;
use kiln_server::{Listen, Stats};
#[allow(unused_imports)] // each test binary uses some of it
pub use kiln_testkit::rng::{seed, Rng};

pub struct Mounted {
    pub dir: tempfile::TempDir,
    pub stats: Arc<Stats>,
    /// The mount's own counts (READs it was sent, small files it stored in the page cache).
    pub counters: Arc<kiln_fuse::Counters>,
    session: Option<fuser::BackgroundSession>,
}

impl Mounted {
    pub fn new(mode: Mode) -> Mounted {
        Mounted::with_passthrough(mode, true)
    }

    /// A mount with FUSE passthrough on (the default in vm-image mode) or off.
    pub fn with_passthrough(mode: Mode, passthrough: bool) -> Mounted {
        Mounted::with_options(mode, passthrough, Duration::from_secs(1))
    }

    /// A mount with passthrough on or off and this attribute timeout.
    pub fn with_options(mode: Mode, passthrough: bool, attr_timeout: Duration) -> Mounted {
        Mounted::start(mode, passthrough, attr_timeout, false)
    }

    /// A general-mode mount with POSIX ACLs on (`kiln mount --acl`).
    pub fn with_acl() -> Mounted {
        Mounted::start(Mode::General, true, Duration::from_secs(1), true)
    }

    /// A general-mode mount with this `--small-file-max`.
    pub fn with_small_file_max(max: u32) -> Mounted {
        Mounted::start_with(
            Mode::General,
            true,
            Duration::from_secs(1),
            false,
            Some(max),
        )
    }

    fn start(mode: Mode, passthrough: bool, attr_timeout: Duration, acl: bool) -> Mounted {
        Mounted::start_with(mode, passthrough, attr_timeout, acl, None)
    }

    fn start_with(
        mode: Mode,
        passthrough: bool,
        attr_timeout: Duration,
        acl: bool,
        small_file_max: Option<u32>,
    ) -> Mounted {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("brick")).expect("brick");
        std::fs::create_dir(dir.path().join("mnt")).expect("mnt");
        let sock = dir.path().join("kilnd.sock");
        let server =
            kiln_server::spawn_background(&dir.path().join("brick"), &[Listen::Unix(sock.clone())])
                .expect("brick server");
        let stats = server.stats;
        let vol = Volume::connect(&format!("unix:{}", sock.display())).expect("connect");
        let fs = kiln_fuse::KilnFs::new(Arc::new(vol), mode, attr_timeout)
            .expect("the volume's root")
            .with_passthrough(passthrough)
            .with_acl(acl);
        let fs = match small_file_max {
            Some(max) => fs.with_small_file_max(max),
            None => fs,
        };
        let counters = fs.counters();
        let session = kiln_fuse::serve_background(fs, "test:/vol", &dir.path().join("mnt"), 4)
            .expect("mount");
        Mounted {
            dir,
            stats,
            counters,
            session: Some(session),
        }
    }

    /// Another general-mode mount of the same brick (another client), on `mnt2`.
    pub fn second(&self, attr_timeout: Duration) -> Second {
        let dir = self.dir.path().join("mnt2");
        std::fs::create_dir_all(&dir).expect("mnt2");
        let sock = self.dir.path().join("kilnd.sock");
        let vol = Volume::connect(&format!("unix:{}", sock.display())).expect("connect");
        let fs = kiln_fuse::KilnFs::new(Arc::new(vol), Mode::General, attr_timeout)
            .expect("the volume's root");
        let counters = fs.counters();
        let session = kiln_fuse::serve_background(fs, "test2:/vol", &dir, 4).expect("mount");
        Second {
            dir,
            counters,
            session: Some(session),
        }
    }

    pub fn mnt(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }

    pub fn brick(&self) -> PathBuf {
        self.dir.path().join("brick")
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.mnt().join(p)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
    }
}

pub fn exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

/// A second mount of a [`Mounted`]'s brick.
pub struct Second {
    pub dir: PathBuf,
    /// The second mount's own counts.
    pub counters: Arc<kiln_fuse::Counters>,
    session: Option<fuser::BackgroundSession>,
}

impl Second {
    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.join(p)
    }
}

impl Drop for Second {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
    }
}

/// Content of `len` bytes that differs for each `seed`.
pub fn content(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Asserts `got` is `want` (lengths and the first difference, not the bytes, on failure).
pub fn same_bytes(got: &[u8], want: &[u8], what: &str) {
    let first = got.iter().zip(want).position(|(g, w)| g != w);
    assert!(
        got == want,
        "{what}: {} bytes read, want {}; first difference at {first:?}",
        got.len(),
        want.len()
    );
}
