//! Write-behind for the general mount (without the kernel's writeback cache).
//!
//! The kernel sends each `write(2)` as its own WRITE and waits for the answer; `tar` writes
//! 10 KiB at a time, so a 30 KiB file cost three round trips to a brick. Here a write that
//! continues the one before it on the same file is answered at once and held, up to
//! [`LIMIT`] bytes per file, and sent as one write when anything needs it on the brick: a
//! read, `stat`, `chmod`/`utimes`/truncate, `fallocate`, `fsync`, another open of the file,
//! a write elsewhere in it, and at the latest its `close` (FLUSH, which `close(2)` waits for).
//! So another client's open after this one's close sees the data (close-to-open), and this
//! mount sees its own writes at once.
//!
//! An error of a held write (`ENOSPC`, `EDQUOT`, `EIO`) is reported by the next write,
//! `fsync` or `close` of the handle that wrote it — as NFS does, and as a local file system
//! does for errors found at writeback.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fuser::Errno;
use kiln_client::Fd;
use kiln_proto::sync::MutexExt as _;
use kiln_proto::Cred;
use rustc_hash::FxHashMap as HashMap;

/// Bytes held per file at most: a write past this is sent at once.
pub(crate) const LIMIT: usize = 256 * 1024;

/// Bytes held in all, at most: past this, writes go through.
const TOTAL_MAX: usize = 64 << 20;

/// Writes held, by inode, and errors not yet reported, by file handle.
pub(crate) struct Behind {
    held: Mutex<HashMap<u64, Held>>,
    /// Where held or sending writes end, by inode: the size the kernel must be told at least
    /// (the brick's lags until they land).
    ends: Mutex<HashMap<u64, u64>>,
    /// Inodes with writes held, plus sends under way: reads and stats skip the locks when
    /// both are none.
    count: AtomicUsize,
    /// Bytes held in all.
    bytes: AtomicUsize,
    errors: Mutex<HashMap<u64, Errno>>,
    order: [Mutex<()>; STRIPES],
}

impl Default for Behind {
    fn default() -> Behind {
        Behind {
            held: Mutex::default(),
            ends: Mutex::default(),
            count: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            errors: Mutex::default(),
            order: std::array::from_fn(|_| Mutex::new(())),
        }
    }
}

/// Contiguous bytes for one file, from one handle.
pub(crate) struct Held {
    pub fh: u64,
    pub fd: Fd,
    /// Whom the bytes are written as on the brick (None: the mount itself); see
    /// [`crate::KilnFs::data_write`].
    pub by: Option<Arc<Cred>>,
    pub offset: u64,
    pub data: Vec<u8>,
}

/// What [`Behind::hold`] did with a write.
pub(crate) enum Hold {
    /// Held: answer the write now.
    Held,
    /// Not held: under [`Behind::order`], send what is held for the file, then this write.
    Through,
}

/// Locks that keep the sends of one file in order (striped by inode).
const STRIPES: usize = 64;

impl Behind {
    /// True when some file has writes held.
    pub fn any(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// Held while sending inode `ino`'s writes: what was held is sent before what follows it,
    /// whichever thread sends each.
    pub fn order(&self, ino: u64) -> MutexGuard<'_, ()> {
        self.order[(ino as usize) % STRIPES].locked()
    }

    /// A write of `data` at `offset` to inode `ino` through handle `fh` (`fd` on the
    /// stack): held if it continues what is held from the same handle and fits [`LIMIT`],
    /// or if nothing is held and it is small (and fewer than [`TOTAL_MAX`] bytes are held).
    /// Writes made as different callers (`by`) are never joined.
    pub fn hold(
        &self,
        ino: u64,
        (fh, fd): (u64, &Fd),
        by: &Option<Arc<Cred>>,
        offset: u64,
        data: &[u8],
    ) -> Hold {
        if self.bytes.load(Ordering::Acquire) + data.len() > TOTAL_MAX {
            return Hold::Through;
        }
        let end = offset + data.len() as u64;
        let mut m = self.held.locked();
        match m.get_mut(&ino) {
            Some(h) => {
                let follows = h.fh == fh && h.offset + h.data.len() as u64 == offset && h.by == *by;
                if !follows || h.data.len() + data.len() > LIMIT {
                    return Hold::Through;
                }
                h.data.extend_from_slice(data);
            }
            // Large writes gain nothing from waiting.
            None if data.len() >= LIMIT / 2 => return Hold::Through,
            None => {
                let mut buf = Vec::with_capacity(LIMIT.min(data.len() * 4));
                buf.extend_from_slice(data);
                let held = Held {
                    fh,
                    fd: fd.clone(),
                    by: by.clone(),
                    offset,
                    data: buf,
                };
                m.insert(ino, held);
                self.count.fetch_add(1, Ordering::AcqRel);
            }
        }
        self.bytes.fetch_add(data.len(), Ordering::AcqRel);
        let mut e = self.ends.locked();
        let x = e.entry(ino).or_insert(end);
        *x = (*x).max(end);
        Hold::Held
    }

    /// What is held for inode `ino`, to be sent now (under [`Behind::order`]); call
    /// [`Behind::sent`] when the send is done. Until then the inode counts as held.
    pub fn take(&self, ino: u64) -> Option<Held> {
        if !self.any() {
            return None;
        }
        // The send counts instead of the entry until `sent`.
        let h = self.held.locked().remove(&ino)?;
        self.bytes.fetch_sub(h.data.len(), Ordering::AcqRel);
        Some(h)
    }

    /// The send of what [`Behind::take`] gave for `ino` is done (landed or failed).
    pub fn sent(&self, ino: u64) {
        let m = self.held.locked();
        if !m.contains_key(&ino) {
            self.ends.locked().remove(&ino);
        }
        self.count.fetch_sub(1, Ordering::AcqRel);
    }

    /// Where the writes held or being sent for `ino` end, if any: the kernel must not be
    /// told a smaller size.
    pub fn end(&self, ino: u64) -> Option<u64> {
        if !self.any() {
            return None;
        }
        self.ends.locked().get(&ino).copied()
    }

    /// A held write of handle `fh` failed with `e`: reported by the handle's next write,
    /// fsync or close.
    pub fn failed(&self, fh: u64, e: Errno) {
        self.errors.locked().insert(fh, e);
    }

    /// The error to report on handle `fh` now, if a held write of it failed.
    pub fn error(&self, fh: u64) -> Option<Errno> {
        let mut e = self.errors.locked();
        if e.is_empty() {
            return None;
        }
        e.remove(&fh)
    }
}
