//! The mount's open files: each FUSE file handle's stack handle or, for a small file opened
//! read-only in general mode, the file's whole content.
//!
//! A small-file open (`--small-file-max`, 256 KiB by default) asks the stack for the file's
//! content with the open (OPEN with `peek`): one round trip, and nothing is left open on the
//! brick, so the release costs none either. Reads of such a handle come from that content, the
//! file as it was when opened — the close-to-open rule: what another client wrote and closed
//! before the open is there. A write, truncate or fallocate of the same inode through this
//! mount makes the content stale; a stale handle, or one asked for something only a brick
//! handle does (fsync, fallocate), is opened on the brick then, read-only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fuser::{Errno, FileHandle, FopenFlags, ReplyData, ReplyOpen};
use kiln_client::{Fd, Opened, Volume};
use kiln_proto::sync::MutexExt as _;

use crate::gate::block_on;

use crate::convert::errno;
use crate::KilnFs;

/// Counts of the mount's own work on file data, for tests and operators.
#[derive(Default, Debug)]
pub struct Counters {
    /// READ requests the kernel sent this mount.
    pub reads: AtomicU64,
    /// Small files put into the kernel's page cache with their open (no READ follows).
    pub stored: AtomicU64,
    /// Small-file opens answered with content fetched ahead (no wait on a brick).
    pub fetched_ahead: AtomicU64,
    /// Small files put into the page cache as they came, fetched ahead of their open.
    pub stored_ahead: AtomicU64,
    /// Of the files stored, those whose open kept the pages stored ahead (not stored again).
    pub kept_ahead: AtomicU64,
    /// Small files fetched ahead and ready for their open (not dropped as spoiled).
    pub ahead_ready: AtomicU64,
    /// Lookups (and the getattrs that may follow them) answered with the attributes of a
    /// small file fetched ahead (no brick asked).
    pub looked_up_ahead: AtomicU64,
    /// READs answered by splice from a brick's socket (see `splice`).
    pub spliced: AtomicU64,
    /// FLUSH requests the kernel sent (write-behind sends what it holds). With write-behind
    /// or the writeback cache on, the kernel sends one for every close of a descriptor of a
    /// file, copies included, such as those a fork duplicated and the child's exec closed;
    /// without either the mount answers the first ENOSYS and the kernel sends no more.
    pub flushes: AtomicU64,
}

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
    /// Written, truncated or allocated through this mount since, or opened again (the newer
    /// open's content is the one the shared page cache may hold).
    stale: AtomicBool,
    /// The opener: a reopen acts as the opener.
    caller: Volume,
}

/// What [`Files::set_fd`] did.
pub(crate) enum SetFd {
    /// The handle holds the new `Fd` now.
    Stored,
    /// Another reopen won: the handle holds this one.
    Already(Fd),
    /// The handle was released meanwhile.
    Gone,
}

/// An open file: what it holds and the FUSE inode it was opened as.
pub(crate) struct OpenFile {
    pub ino: u64,
    pub held: Held,
    /// Opened with the inode's backing file ([`crate::passthrough`]).
    pub backed: bool,
}

/// A small file's content put into the kernel's page cache as it came, fetched ahead of its
/// open: the changes through this mount, and the opens of the inode's slot, counted when its
/// fetch began ([`Files::before_fetch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stored {
    changes: u64,
    opens: u64,
}

/// Slots counting the opens begun, by inode (two inodes may share one: a false alarm only
/// costs storing the content again at the open).
const OPEN_SLOTS: usize = 256;

struct Opens(Box<[AtomicU64]>);

impl Default for Opens {
    fn default() -> Opens {
        Opens((0..OPEN_SLOTS).map(|_| AtomicU64::new(0)).collect())
    }
}

impl Opens {
    fn of(&self, ino: u64) -> &AtomicU64 {
        &self.0[ino as usize % OPEN_SLOTS]
    }
}

/// Open files by FUSE file handle.
#[derive(Default)]
pub(crate) struct Files {
    map: Mutex<HashMap<u64, OpenFile>>,
    last: AtomicU64,
    /// How many hold a whole file: writes skip looking for them when there are none.
    wholes: AtomicUsize,
    /// Bumped as each change through this mount (write, truncate, fallocate) begins and
    /// ends: an open that saw it move may have read the file mid-change.
    changes: AtomicU64,
    /// Opens begun, by inode slot: content stored ahead of an open is kept only if no open of
    /// its inode began since its fetch did.
    opens: Opens,
    /// Opens in progress, by inode slot, and creates in progress (whose inode is not known
    /// until the brick answers): nothing is stored ahead while one may be about to hand the
    /// kernel a handle of the file. (A handle's reads or writes lock the file's pages until
    /// the brick answers, and the store runs in the thread that receives those answers.)
    busy: Opens,
    creating: AtomicU64,
}

/// An open in progress ([`Files::opening`]): ends when dropped, once its handle is registered.
pub(crate) struct Opening<'a> {
    files: &'a Files,
    ino: u64,
    /// Its slot's count of opens begun, this one included.
    pub count: u64,
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        self.files.busy.of(self.ino).fetch_sub(1, Ordering::AcqRel);
    }
}

/// A create in progress ([`Files::creating`]).
pub(crate) struct Creating<'a>(&'a Files);

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        self.0.creating.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Files {
    /// An open of inode `ino` begins (any open), in progress until the returned guard drops.
    pub fn opening(&self, ino: u64) -> Opening<'_> {
        self.busy.of(ino).fetch_add(1, Ordering::AcqRel);
        let count = self.opens.of(ino).fetch_add(1, Ordering::AcqRel) + 1;
        Opening {
            files: self,
            ino,
            count,
        }
    }

    /// A create begins (it may open an existing file), in progress until the guard drops.
    pub fn creating(&self) -> Creating<'_> {
        self.creating.fetch_add(1, Ordering::AcqRel);
        Creating(self)
    }

    /// What a fetch of inode `ino` ahead of its open notes as it begins.
    pub fn before_fetch(&self, ino: u64) -> Stored {
        Stored {
            changes: self.changes(),
            opens: self.opens.of(ino).load(Ordering::Acquire),
        }
    }

    /// Nothing happened to inode `ino` through this mount since `at`: no change began, no
    /// open began, none is in progress but the caller's own (`own`: 0 or 1), no create is in
    /// progress, and no handle of it is open.
    fn quiet(&self, ino: u64, at: Stored, own: u64) -> bool {
        self.changes() == at.changes
            && self.opens.of(ino).load(Ordering::Acquire) == at.opens
            && self.busy.of(ino).load(Ordering::Acquire) == own
            && self.creating.load(Ordering::Acquire) == 0
            && !self.open_of(ino)
    }

    fn map(&self) -> MutexGuard<'_, HashMap<u64, OpenFile>> {
        self.map.locked()
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

    /// Handle `fh` reads through the brick's file `fd` now (unless it already does).
    pub fn set_fd(&self, fh: u64, fd: Fd) -> SetFd {
        let mut m = self.map();
        let Some(f) = m.get_mut(&fh) else {
            return SetFd::Gone;
        };
        if let Held::Fd(other) = &f.held {
            return SetFd::Already(other.clone());
        }
        self.wholes.fetch_sub(1, Ordering::Relaxed);
        f.held = Held::Fd(fd);
        SetFd::Stored
    }

    /// The change count, read before an open (see [`Files::add_whole`]).
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// A change through this mount of inode `ino` begins: whole files held of it are stale.
    pub fn changing(&self, ino: u64) {
        self.changes.fetch_add(1, Ordering::AcqRel);
        self.changed(ino);
    }

    /// That change is done.
    pub fn changed_done(&self) {
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// A new file handle for inode `ino` holding a whole file read by an open that began
    /// when the change count was `seen`: stale from the start if a change ran meanwhile.
    /// Older whole files of the inode become stale (this open's content is the newer).
    pub fn add_whole(&self, ino: u64, whole: Whole, seen: u64) -> u64 {
        self.changed(ino);
        if self.changes() != seen {
            whole.stale.store(true, Ordering::Relaxed);
        }
        self.add(ino, Held::Whole(Arc::new(whole)))
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

    /// Whether some handle of inode `ino` is open here.
    pub fn open_of(&self, ino: u64) -> bool {
        self.map().values().any(|f| f.ino == ino)
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

    /// Whole files held of inode `ino` are stale.
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

impl Whole {
    /// A whole file's content, opened by `caller`.
    pub fn new(mut data: Vec<u8>, caller: Volume) -> Whole {
        // Fetched ahead, the room asked for was the listed size in pages: a page's slack is
        // not worth a reallocation (and the lock of the allocating thread's arena).
        if data.capacity() - data.len() > 4096 {
            data.shrink_to_fit();
        }
        Whole {
            data,
            stale: AtomicBool::new(false),
            caller,
        }
    }
}

impl KilnFs {
    /// Answers an open of inode `ino` at `path` with `flags` by `caller`, which the stack
    /// answered with `opened`: a whole small file is stored in the page cache first when it
    /// can be (the open then keeps the cache); a handle may be backed by the brick's file
    /// ([`crate::passthrough`]). `seen` is [`Files::changes`] from before the stack was
    /// asked; `ff` the open's flags.
    pub(crate) fn opened(
        &self,
        ino: u64,
        (path, flags): (&str, i32),
        caller: &Volume,
        opened: (Opened, u64, Option<Stored>),
        (seen, ff): (u64, FopenFlags),
        reply: ReplyOpen,
    ) {
        let (opened, opens, stored) = opened;
        match opened {
            Opened::Whole(data, _) => {
                let sized = self.fresh.opened(ino, Some(data.len() as u64));
                let ahead = sized && self.stored_ahead(ino, opens, stored);
                let cached = ahead || (sized && self.store_whole(ino, &data, seen));
                if cached {
                    self.counters.stored.fetch_add(1, Ordering::Relaxed);
                }
                if ahead {
                    self.counters.kept_ahead.fetch_add(1, Ordering::Relaxed);
                }
                let ff = match cached {
                    true => ff | FopenFlags::FOPEN_KEEP_CACHE,
                    false => ff,
                };
                let whole = Whole::new(data, caller.clone());
                let fh = self.files.add_whole(ino, whole, seen);
                reply.opened(FileHandle(fh), ff)
            }
            Opened::Fd(fd) => {
                if self.mode == crate::Mode::General && !self.writeback {
                    let _ = self.fresh.opened(ino, None);
                }
                // Older whole-file handles must not fill the shared page cache now.
                self.files.changed(ino);
                let fh = FileHandle(self.files.add(ino, Held::Fd(fd.clone())));
                let at = (ino, path, flags, &fd);
                // Marked before the answer goes: its release may come at once.
                let backed = || self.files.mark_backed(fh.0);
                self.pass.open(&self.vol, at, fh, ff, reply, backed);
            }
        }
    }

    /// Puts the whole content `data` of inode `ino`, read by an open that began at change
    /// count `seen`, into the kernel's page cache (`FUSE_NOTIFY_STORE`) before the open is
    /// answered, so that the opener's reads need no READ: true if it is there, and the open
    /// may keep the cache (`FOPEN_KEEP_CACHE`).
    ///
    /// Only when the kernel already has the inode's size as `data`'s length (the store may
    /// grow the size the kernel has, never shrink it), and no other handle of the inode is
    /// open here (general mode). Then no read of the inode holds a page locked while it waits
    /// on this mount, so the store cannot wait on it, and no write through this mount is under
    /// way. A handle opened meanwhile, or a change through this mount begun meanwhile, could
    /// have put newer pages there that the store overwrote: then the inode's pages are dropped
    /// again and the open does not keep them.
    pub(crate) fn store_whole(&self, ino: u64, data: &[u8], seen: u64) -> bool {
        if self.mode != crate::Mode::General || data.is_empty() || self.files.open_of(ino) {
            return false;
        }
        let Some(n) = self.fresh.notifier() else {
            return false;
        };
        if n.store(fuser::INodeNo(ino), 0, data).is_err() {
            return false;
        }
        if self.files.changes() == seen && !self.files.open_of(ino) {
            return true;
        }
        let _ = n.inval_inode(fuser::INodeNo(ino), 0, 0);
        false
    }

    /// Whether the open counted `opens` ([`Files::opening`]) of inode `ino` may keep the pages
    /// stored ahead of it (`stored`): it is the only open of the inode's slot since the fetch
    /// began, and nothing changed or opened the inode through this mount meanwhile.
    fn stored_ahead(&self, ino: u64, opens: u64, stored: Option<Stored>) -> bool {
        let Some(at) = stored else {
            return false;
        };
        let only = Stored {
            changes: at.changes,
            opens: at.opens + 1,
        };
        opens == only.opens && self.files.quiet(ino, only, 1)
    }

    /// The stack's handle for a FUSE file handle; a whole file is opened on the brick now.
    pub(crate) fn fd(&self, fh: FileHandle) -> Result<Fd, Errno> {
        match self.files.get(fh.0) {
            Some((_, Held::Fd(fd))) => Ok(fd),
            Some((_, Held::Whole(w))) => self.reopen(fh.0, &w),
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
        let ino = self.fuse_ino(a.ino);
        for fh in self.files.wholes_of(ino) {
            if let Some((_, Held::Whole(w))) = self.files.get(fh) {
                let _ = self.reopen(fh, &w);
            }
        }
    }

    /// Opens whole-file handle `fh` on the brick, read-only, as its opener; `ESTALE` when
    /// its name leads to another file now. Two reopens of one handle keep one brick handle.
    fn reopen(&self, fh: u64, w: &Whole) -> Result<Fd, Errno> {
        let ino = self.files.get(fh).map(|(ino, _)| ino).ok_or(Errno::EBADF)?;
        let path = self.path(fuser::INodeNo(ino))?;
        let fd = block_on(w.caller.open(&path, libc::O_RDONLY)).map_err(errno)?;
        // The same file, or the name leads elsewhere now (another client renamed over it).
        let same = block_on(w.caller.fstat(&fd)).map(|a| self.fuse_ino(a.ino) == ino);
        if !matches!(same, Ok(true)) {
            let _ = block_on(self.vol.close(fd));
            return Err(same.err().map_or(Errno::ESTALE, errno));
        }
        match self.files.set_fd(fh, fd.clone()) {
            SetFd::Stored => Ok(fd),
            SetFd::Already(other) => {
                let _ = block_on(self.vol.close(fd));
                Ok(other)
            }
            SetFd::Gone => {
                let _ = block_on(self.vol.close(fd));
                Err(Errno::EBADF)
            }
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

/// Content of inode `ino` fetched ahead of its open by a fetch that began at `at`: put into the
/// kernel's page cache now, off the opener's path, if nothing changed or opened the inode
/// through this mount since (checked again after: else the pages are dropped). The open that
/// finds it keeps the pages without storing them again ([`KilnFs::opened`]).
pub(crate) fn store_ahead(
    (files, fresh, counters): (&Files, &crate::fresh::Fresh, &Counters),
    ino: u64,
    data: &[u8],
    at: Stored,
) -> Option<Stored> {
    // Only where the open could keep it: the kernel already has this size (a store could
    // grow it, never shrink it).
    if data.is_empty() || !fresh.told_is(ino, data.len() as u64) || !files.quiet(ino, at, 0) {
        return None;
    }
    let n = fresh.notifier()?;
    n.store(fuser::INodeNo(ino), 0, data).ok()?;
    if files.quiet(ino, at, 0) {
        counters.stored_ahead.fetch_add(1, Ordering::Relaxed);
        return Some(at);
    }
    let _ = n.inval_inode(fuser::INodeNo(ino), 0, 0);
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_stored_ahead_are_kept_only_while_nothing_touched_the_file() {
        let f = Files::default();
        let at = f.before_fetch(7);
        assert!(f.quiet(7, at, 0), "nothing happened");
        drop(f.opening(7 + OPEN_SLOTS as u64 + 1));
        assert!(f.quiet(7, at, 0), "an open of an inode of another slot");

        drop(f.opening(7));
        assert!(
            !f.quiet(7, at, 0),
            "an open of the inode began since the fetch did"
        );

        // One begun before the fetch, still in progress.
        let before = f.opening(7);
        let at = f.before_fetch(7);
        assert!(!f.quiet(7, at, 0), "an open of the inode is in progress");
        drop(before);
        assert!(f.quiet(7, at, 0));
        let c = f.creating();
        assert!(!f.quiet(7, at, 0), "a create is in progress");
        drop(c);

        // The open that takes the content: its own progress is allowed, another's is not.
        let mine = f.opening(7);
        let only = Stored {
            changes: at.changes,
            opens: at.opens + 1,
        };
        assert_eq!(mine.count, only.opens);
        assert!(f.quiet(7, only, 1));
        let other = f.opening(7);
        assert!(!f.quiet(7, only, 1), "and no other");
        drop((mine, other));

        let at = f.before_fetch(7);
        f.changing(9);
        assert!(!f.quiet(7, at, 0), "a change through the mount began");
        f.changed_done();

        let at = f.before_fetch(7);
        let fh = f.add(7, Held::Fd(Fd::new(())));
        assert!(!f.quiet(7, at, 0), "a handle of the inode is open");
        f.remove(fh);
        assert!(f.quiet(7, at, 0));
    }
}
