//! Close-to-open for the general mount: an open sees what another client wrote and closed
//! before it, even while the kernel still trusts attributes it was given (`--attr-timeout`).
//!
//! The kernel drops a file's cached pages at every open (no keep-cache), so the content read
//! afterwards is fresh; but it reads only up to the size it has cached. So at an open the mount
//! tells the kernel to forget the file's attributes (`FUSE_NOTIFY_INVAL_INODE`, attributes
//! only), and the next read past the cached size or `stat` asks again — unless the open brought
//! the whole file (see [`crate::files`]) and its length is the size the mount last gave the
//! kernel, the common case, which costs nothing. Sent before the open is answered, so the
//! opener's first read already sees it.

use kiln_proto::sync::MutexExt as _;
use rustc_hash::FxHashMap as HashMap;
use std::sync::{Mutex, OnceLock};

use fuser::{INodeNo, Notifier};

/// What the kernel was last told of each inode's size, and the way to tell it to forget.
#[derive(Default)]
pub struct Fresh {
    notifier: OnceLock<Notifier>,
    told: Mutex<HashMap<u64, u64>>,
}

impl Fresh {
    /// Sizes remembered at most; the table is emptied when it grows past this (an emptied
    /// entry only costs one attribute refresh).
    const KEEP: usize = 1 << 20;

    /// The session's notifier, once it exists.
    pub fn set_notifier(&self, n: Notifier) {
        let _ = self.notifier.set(n);
    }

    /// The session's notifier, if it exists yet.
    pub fn notifier(&self) -> Option<&Notifier> {
        self.notifier.get()
    }

    /// Whatever the kernel was told of `ino`'s size is to be told again.
    pub fn forget(&self, ino: u64) {
        self.told.locked().remove(&ino);
    }

    /// The kernel was given these sizes (inode, size).
    pub fn told(&self, sizes: impl Iterator<Item = (u64, u64)>) {
        let mut t = self.told.locked();
        for (ino, size) in sizes {
            if t.len() >= Self::KEEP {
                t.clear();
            }
            t.insert(ino, size);
        }
    }

    /// Whether the kernel was last told that inode `ino` is `size` bytes long.
    pub fn told_is(&self, ino: u64, size: u64) -> bool {
        let t = self.told.locked();
        t.get(&ino).copied() == Some(size)
    }

    /// Inode `ino` is being opened; `size` is its size now, if the open learned it. Unless that
    /// is what the kernel already has (then true), the kernel forgets the inode's attributes.
    pub fn opened(&self, ino: u64, size: Option<u64>) -> bool {
        let mut t = self.told.locked();
        if size.is_some() && t.get(&ino).copied() == size {
            return true;
        }
        t.remove(&ino);
        drop(t);
        if let Some(n) = self.notifier.get() {
            // ENOENT: the kernel holds no such inode (nothing cached to forget).
            let _ = n.inval_inode(INodeNo(ino), -1, 0);
        }
        false
    }
}
