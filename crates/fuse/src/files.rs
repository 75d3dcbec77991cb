//! The mount's open files: each FUSE file handle's stack handle or, for a small file opened
//! read-only in general mode, the file's whole content.
//!
//! A small-file open (`--small-file-max`, 64 KiB by default) asks the stack for the file's
//! content with the open (OPEN with `peek`): one round trip, and nothing is left open on the
//! brick, so the release costs none either. Reads of such a handle come from that content, the
//! file as it was when opened — the close-to-open rule: what another client wrote and closed
//! before the open is there. A write, truncate or fallocate of the same inode through this
//! mount makes the content stale; a stale handle, or one asked for something only a brick
//! handle does (fsync, fallocate), is opened on the brick then, read-only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fuser::{Errno, FileHandle, ReplyData};
use kiln_client::{block_on, Fd};

use crate::convert::errno;
use crate::KilnFs;

/// What a FUSE file handle holds.
#[derive(Clone)]
pub(crate) enum Held {
    /// A handle of the stack's.
    Fd(Fd),
    /// The whole file, read with the open.
    Whole(Arc<Whole>),
}

/// A small file's content as of its open.
pub(crate) struct Whole {
    data: Vec<u8>,
    /// Written, truncated or allocated through this mount since.
    stale: AtomicBool,
}

/// An open file: what it holds and the FUSE inode it was opened as.
pub(crate) struct OpenFile {
    pub ino: u64,
    pub held: Held,
    /// Opened with the inode's backing file ([`crate::passthrough`]).
    pub backed: bool,
}

/// Open files by FUSE file handle.
#[derive(Default)]
pub(crate) struct Files {
    map: Mutex<HashMap<u64, OpenFile>>,
    last: AtomicU64,
    /// How many hold a whole file: writes skip looking for them when there are none.
    wholes: AtomicUsize,
}

impl Files {
    fn map(&self) -> MutexGuard<'_, HashMap<u64, OpenFile>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new file handle for inode `ino` holding `held`.
    pub fn add(&self, ino: u64, held: Held) -> u64 {
        if matches!(held, Held::Whole(_)) {
            self.wholes.fetch_add(1, Ordering::Relaxed);
        }
        let fh = self.last.fetch_add(1, Ordering::Relaxed) + 1;
        let f = OpenFile {
            ino,
            held,
            backed: false,
        };
        self.map().insert(fh, f);
        fh
    }

    /// The inode and what handle `fh` holds.
    pub fn get(&self, fh: u64) -> Option<(u64, Held)> {
        self.map().get(&fh).map(|f| (f.ino, f.held.clone()))
    }

    /// Handle `fh` is done with.
    pub fn remove(&self, fh: u64) -> Option<OpenFile> {
        let f = self.map().remove(&fh)?;
        if matches!(f.held, Held::Whole(_)) {
            self.wholes.fetch_sub(1, Ordering::Relaxed);
        }
        Some(f)
    }

    /// Handle `fh` reads through the brick's file now; false when it is already released.
    pub fn set_fd(&self, fh: u64, fd: Fd) -> bool {
        let mut m = self.map();
        let Some(f) = m.get_mut(&fh) else {
            return false;
        };
        if matches!(f.held, Held::Whole(_)) {
            self.wholes.fetch_sub(1, Ordering::Relaxed);
        }
        f.held = Held::Fd(fd);
        true
    }

    /// Handle `fh`'s reads go to the brick's file.
    pub fn mark_backed(&self, fh: u64) {
        if let Some(f) = self.map().get_mut(&fh) {
            f.backed = true;
        }
    }

    /// A stack handle of some open file of inode `ino`.
    pub fn any_fd(&self, ino: u64) -> Option<Fd> {
        self.map().values().find_map(|f| match &f.held {
            Held::Fd(fd) if f.ino == ino => Some(fd.clone()),
            _ => None,
        })
    }

    /// The handles holding a whole file of inode `ino`.
    fn wholes_of(&self, ino: u64) -> Vec<u64> {
        if self.wholes.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let m = self.map();
        m.iter()
            .filter(|(_, f)| f.ino == ino && matches!(f.held, Held::Whole(_)))
            .map(|(fh, _)| *fh)
            .collect()
    }

    /// Inode `ino` changes through this mount: whole files held of it are stale.
    pub fn changed(&self, ino: u64) {
        if self.wholes.load(Ordering::Relaxed) == 0 {
            return;
        }
        for f in self.map().values() {
            if let Held::Whole(w) = &f.held {
                if f.ino == ino {
                    w.stale.store(true, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Held {
    /// A whole file's content.
    pub fn whole(mut data: Vec<u8>) -> Held {
        data.shrink_to_fit();
        Held::Whole(Arc::new(Whole {
            data,
            stale: AtomicBool::new(false),
        }))
    }
}

impl KilnFs {
    /// The stack's handle for a FUSE file handle; a whole file is opened on the brick now.
    pub(crate) fn fd(&self, fh: FileHandle) -> Result<Fd, Errno> {
        match self.files.get(fh.0) {
            Some((_, Held::Fd(fd))) => Ok(fd),
            Some((ino, Held::Whole(_))) => self.reopen(fh.0, ino),
            None => Err(Errno::EBADF),
        }
    }

    /// The stack's handle for `fh`, or None for a whole file (whose attributes are asked by
    /// path instead of opening it).
    pub(crate) fn open_fd(&self, fh: FileHandle) -> Result<Option<Fd>, Errno> {
        match self.files.get(fh.0) {
            Some((_, Held::Fd(fd))) => Ok(Some(fd)),
            Some((_, Held::Whole(_))) => Ok(None),
            None => Err(Errno::EBADF),
        }
    }

    /// `path` is about to lose its name (unlink, or replaced by a rename) through this mount:
    /// whole-file handles of its inode are opened on the brick first, so that `fstat` of
    /// them still works once no name leads to the file (it is asked by handle then).
    pub(crate) fn keep_whole_files_open(&self, req: &fuser::Request, path: &str) {
        if self.files.wholes.load(Ordering::Relaxed) == 0 {
            return;
        }
        let Ok(a) = block_on(self.caller(req).lookup(path)) else {
            return;
        };
        let ino = self.table().fuse_ino(a.ino);
        for fh in self.files.wholes_of(ino) {
            let _ = self.reopen(fh, ino);
        }
    }

    /// Opens whole-file handle `fh` of inode `ino` on the brick, read-only (access was
    /// checked at its open).
    fn reopen(&self, fh: u64, ino: u64) -> Result<Fd, Errno> {
        let path = self.path(fuser::INodeNo(ino))?;
        let fd = block_on(self.vol.open(&path, libc::O_RDONLY)).map_err(errno)?;
        if self.files.set_fd(fh, fd.clone()) {
            Ok(fd)
        } else {
            let _ = block_on(self.vol.close(fd));
            Err(Errno::EBADF)
        }
    }

    /// Answers a read of `fh` from the whole file it holds, if it holds a current one; else
    /// hands the reply back.
    pub(crate) fn read_whole(
        &self,
        fh: FileHandle,
        offset: u64,
        size: usize,
        reply: ReplyData,
    ) -> Option<ReplyData> {
        let Some((_, Held::Whole(w))) = self.files.get(fh.0) else {
            return Some(reply);
        };
        if w.stale.load(Ordering::Relaxed) {
            return Some(reply);
        }
        let start = (offset.min(w.data.len() as u64)) as usize;
        let end = start.saturating_add(size).min(w.data.len());
        reply.data(&w.data[start..end]);
        None
    }
}
