//! What the brick may reach of what a client names: only regular files and directories are
//! ever opened for I/O, and nothing in the brick's own `.kiln` directory is reached at all.
//!
//! An open first resolves the path to an `O_PATH` descriptor (which opens nothing: no FIFO
//! waits, no device driver runs), checks the inode's type with `fstat`, and only then opens it
//! for I/O *through that descriptor* (`/proc/self/fd/N`), so a rename cannot swap a FIFO or a
//! device in between. Devices, FIFOs and sockets are refused with `ENXIO`, what open(2) gives
//! for a FIFO without a reader or a socket, and what NFS servers answer for special files.
//!
//! `.kiln` is reachable by name only as a brick root's first component, which
//! [`super::brick::check_path`] refuses; through a symlink it is refused here, by the path
//! the kernel reports for the resolved descriptor (see [`in_state_dir`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::OnceLock;

use kiln_proto::errno;
use rustix::fs::{self as rfs, Mode, OFlags};
use rustix::path::DecInt;

use crate::{Errno, FopResult};

/// The directory inside a brick that holds Kiln's own records (the marks layer's log):
/// clients cannot name it.
pub const STATE_DIR: &str = ".kiln";

fn err(e: rustix::io::Errno) -> Errno {
    e.raw_os_error() as u32
}

/// `/proc/self/fd` (of the thread group, whose descriptor table every thread shares), opened
/// once and checked to be procfs; `None` where it cannot be (then nothing is opened for I/O).
fn proc_fds() -> FopResult<BorrowedFd<'static>> {
    static FDS: OnceLock<Option<OwnedFd>> = OnceLock::new();
    let fds = FDS.get_or_init(|| {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
        let opened = rfs::open("/proc/self/fd", flags, Mode::empty()).and_then(|fd| {
            let fs = rfs::fstatfs(&fd)?;
            if fs.f_type == rfs::PROC_SUPER_MAGIC {
                Ok(fd)
            } else {
                Err(rustix::io::Errno::NODEV)
            }
        });
        match opened {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::error!(
                    "cannot open /proc/self/fd ({e}): the brick opens no file for I/O without it"
                );
                None
            }
        }
    });
    fds.as_ref().map(|fd| fd.as_fd()).ok_or(errno::EIO)
}

/// Refuses to open for I/O anything but a regular file or a directory: `ELOOP` for a symlink
/// (what `O_NOFOLLOW` gives today), `ENXIO` for a device, FIFO or socket.
pub(super) fn openable(st: &rfs::Stat, path: &str) -> FopResult<()> {
    match rfs::FileType::from_raw_mode(st.st_mode) {
        rfs::FileType::RegularFile | rfs::FileType::Directory => Ok(()),
        rfs::FileType::Symlink => Err(libc::ELOOP as u32),
        kind => {
            tracing::info!(path, ?kind, "refused to open a special file");
            Err(libc::ENXIO as u32)
        }
    }
}

/// Opens the inode behind the `O_PATH` descriptor `node` for I/O with `flags`, through
/// `/proc/self/fd` (the kernel checks the caller's access as for any open).
pub(super) fn reopen(node: &OwnedFd, flags: OFlags) -> FopResult<OwnedFd> {
    // Following the magic link is the point; a name-level flag would refuse it.
    let flags = (flags - (OFlags::NOFOLLOW | OFlags::CREATE | OFlags::EXCL | OFlags::PATH))
        | OFlags::CLOEXEC
        | OFlags::NOCTTY;
    rfs::openat(proc_fds()?, DecInt::from_fd(node), flags, Mode::empty()).map_err(err)
}

/// True if `fd` (resolved beneath `root`, maybe through symlinks) is the root's `.kiln` or
/// something beneath it, by the paths the kernel reports for both descriptors (one mount
/// namespace, one view). Only resolutions that met a symlink ask, so the fast path pays nothing.
pub(super) fn in_state_dir(root: &OwnedFd, fd: &OwnedFd) -> FopResult<bool> {
    beneath(root, fd, STATE_DIR)
}

/// True if `fd` is the root's `rel` (a relative path) or something beneath it.
fn beneath(root: &OwnedFd, fd: &OwnedFd, rel: &str) -> FopResult<bool> {
    let fds = proc_fds()?;
    let at = |fd: &OwnedFd| {
        rfs::readlinkat(fds, DecInt::from_fd(fd), Vec::new())
            .map(|p| p.into_bytes())
            .map_err(err)
    };
    let mut want = at(root)?;
    if !want.ends_with(b"/") {
        want.push(b'/');
    }
    want.extend_from_slice(rel.as_bytes());
    let p = at(fd)?;
    Ok(p.strip_prefix(&want[..])
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(b"/")))
}

thread_local! {
    /// The subtree this thread's storage calls are confined to (see [`Confined`]).
    static SUBTREE: std::cell::RefCell<Option<std::sync::Arc<str>>> =
        const { std::cell::RefCell::new(None) };
}

/// Confines this thread's resolutions to a subtree of the brick until dropped: a path that
/// meets a symlink must end inside it (one that meets none was checked by name already).
pub(super) struct Confined {
    was: Option<std::sync::Arc<str>>,
}

impl Confined {
    pub(super) fn new(subtree: Option<std::sync::Arc<str>>) -> Confined {
        Confined {
            was: SUBTREE.with(|s| s.replace(subtree)),
        }
    }
}

impl Drop for Confined {
    fn drop(&mut self) {
        let was = self.was.take();
        SUBTREE.with(|s| *s.borrow_mut() = was);
    }
}

/// True if this thread is confined to a subtree and `fd` (resolved through symlinks) ended
/// outside it.
pub(super) fn outside_subtree(root: &OwnedFd, fd: &OwnedFd) -> FopResult<bool> {
    match SUBTREE.with(|s| s.borrow().clone()) {
        Some(sub) if !sub.is_empty() => Ok(!beneath(root, fd, &sub)?),
        _ => Ok(false),
    }
}
