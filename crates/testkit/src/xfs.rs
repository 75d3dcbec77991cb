//! An XFS file system with reflink on a loop device, for the tests of snapshots and clones.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `cmd`; its stdout, or what it said on failure.
pub fn sh(cmd: &mut Command) -> io::Result<String> {
    let out = cmd
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("{cmd:?}: {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(io::Error::other(format!(
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// XFS made with `reflink=1` on a loop device over a sparse file of `size` bytes in `tmp`,
/// mounted at `tmp/xfs`; unmounted and detached when dropped.
pub struct Xfs {
    dev: String,
    /// Where it is mounted.
    pub mnt: PathBuf,
}

impl Xfs {
    /// Makes and mounts it; `Err` says why not (no mkfs.xfs, no loop device, not root).
    pub fn make(tmp: &Path, size: u64) -> io::Result<Xfs> {
        let file = tmp.join("xfs.img");
        std::fs::File::create(&file).and_then(|f| f.set_len(size))?;
        let dev = sh(Command::new("losetup").args(["-f", "--show"]).arg(&file))?;
        let mnt = tmp.join("xfs");
        std::fs::create_dir(&mnt)?;
        let x = Xfs { dev, mnt };
        sh(Command::new("mkfs.xfs").args(["-q", "-m", "reflink=1", &x.dev]))?;
        sh(Command::new("mount").arg(&x.dev).arg(&x.mnt))?;
        Ok(x)
    }

    /// Bytes free on it.
    pub fn free(&self) -> u64 {
        let st = rustix::fs::statvfs(&self.mnt).unwrap();
        st.f_bavail * st.f_frsize
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = sh(Command::new("umount").arg("-l").arg(&self.mnt));
        let _ = sh(Command::new("losetup").args(["-d", &self.dev]));
    }
}
