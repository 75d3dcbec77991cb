//! Local short-circuit reads: the brick's side.
//!
//! A client on this host (a Unix-socket connection) may ask for a read-only descriptor of a
//! file it has open ([`kiln_proto::Op::Grant`]) and then read with `preadv` on it, without a
//! round trip. Every connection that holds grants gets a *generation table*: a sealed memfd of
//! `u64` slots that the brick maps writable and the client maps read-only. A grant names a
//! slot and the value it held when given; the brick bumps the slot *before* anything that could
//! make a direct read differ from what a read through the brick would return — a write or size
//! change through another connection, a change of the file's name, a heal or migration session
//! beginning, the handle's release. The client checks the slot before and after each direct
//! read (a seqlock): unchanged means the bytes read are what the brick would have sent.
//!
//! Writes never take this path: they go through the brick, which replicates them.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kiln_proto::sync::MutexExt as _;

/// Slots in one connection's table: 32 KiB, the files one client reads at once and then some.
pub const SLOTS: usize = 4096;

/// A file, as the kernel names it.
pub type Inode = (u64, u64);

/// One connection's generation table.
pub struct Table {
    memfd: OwnedFd,
    /// `SLOTS` atomics in a shared mapping of `memfd`.
    base: *const AtomicU64,
    /// Slots not in use.
    free: Mutex<Vec<u32>>,
}

// SAFETY: `base` points at a shared mapping that lives as long as the table and is only ever
// accessed through atomics.
unsafe impl Send for Table {}
// SAFETY: as above: every access is atomic.
unsafe impl Sync for Table {}

impl Table {
    /// A new table: a memfd of [`SLOTS`] zeroed `u64`s, mapped here, sealed so that no one can
    /// resize it or map it writable again (the client maps it read-only).
    pub fn new() -> io::Result<Arc<Table>> {
        let len = SLOTS * 8;
        // SAFETY: a NUL-terminated name and valid flags; the result is checked.
        let raw = unsafe {
            libc::memfd_create(
                c"kiln-grants".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor we just created and own.
        let memfd = unsafe { OwnedFd::from_raw_fd(raw) };
        rustix::fs::ftruncate(&memfd, len as u64)?;
        // SAFETY: a fresh shared mapping of a file of `len` bytes; checked for failure.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE;
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            let e = io::Error::last_os_error();
            // SAFETY: unmapping the mapping made above, which nothing else refers to yet.
            unsafe { libc::munmap(base, len) };
            return Err(e);
        }
        Ok(Arc::new(Table {
            memfd,
            base: base as *const AtomicU64,
            free: Mutex::new((0..SLOTS as u32).rev().collect()),
        }))
    }

    /// The memfd, to send to the client.
    pub fn memfd(&self) -> &OwnedFd {
        &self.memfd
    }

    fn slot(&self, i: u32) -> &AtomicU64 {
        assert!((i as usize) < SLOTS);
        // SAFETY: `i` is in bounds of the mapping, which lives as long as `self`.
        unsafe { &*self.base.add(i as usize) }
    }

    /// Makes every grant of slot `i` stale. The value only grows, so a slot reused for another
    /// file can never match a value given out for the one before.
    pub fn bump(&self, i: u32) {
        self.slot(i).fetch_add(1, Ordering::SeqCst);
    }

    /// The slot's value now.
    pub fn value(&self, i: u32) -> u64 {
        self.slot(i).load(Ordering::SeqCst)
    }

    fn take(&self) -> Option<u32> {
        self.free.locked().pop()
    }

    fn put(&self, i: u32) {
        self.bump(i);
        self.free.locked().push(i);
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer referenced (we are its only owner).
        unsafe { libc::munmap(self.base as *mut libc::c_void, SLOTS * 8) };
    }
}

/// One grant: a connection's slot for a file.
struct Holder {
    conn: u64,
    table: Arc<Table>,
    slot: u32,
}

/// The brick's grants, by file.
#[derive(Default)]
pub struct Grants {
    by_inode: Mutex<HashMap<Inode, Vec<Holder>>>,
    /// Files whose readers bypass every check (FUSE passthrough), by `st_ino`: how many
    /// handles hold them. They may not move meanwhile.
    pins: Mutex<HashMap<u64, usize>>,
    /// Grants alive: with none, writes skip every lookup here.
    live: AtomicUsize,
}

impl Grants {
    /// True when some grant is alive (one relaxed load).
    pub fn any(&self) -> bool {
        self.live.load(Ordering::Relaxed) > 0
    }

    /// Records that connection `conn` may read `ino` through slot `slot` of `table`.
    pub fn add(&self, ino: Inode, conn: u64, table: &Arc<Table>, slot: u32) {
        let mut m = self.by_inode.locked();
        let v = m.entry(ino).or_default();
        if !v.iter().any(|h| h.conn == conn && h.slot == slot) {
            v.push(Holder {
                conn,
                table: table.clone(),
                slot,
            });
            self.live.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Forgets connection `conn`'s grant of `ino` in `slot` (its handle was released).
    pub fn remove(&self, ino: Inode, conn: u64, slot: u32) {
        let mut m = self.by_inode.locked();
        if let Some(v) = m.get_mut(&ino) {
            let before = v.len();
            v.retain(|h| !(h.conn == conn && h.slot == slot));
            self.live.fetch_sub(before - v.len(), Ordering::SeqCst);
            if v.is_empty() {
                m.remove(&ino);
            }
        }
    }

    /// Pins file `ino` (one more handle bypasses every check).
    pub fn pin(&self, ino: Inode) {
        *self.pins.locked().entry(ino.1).or_default() += 1;
    }

    /// Drops one pin of `ino`.
    pub fn unpin(&self, ino: Inode) {
        let mut p = self.pins.locked();
        if let Some(n) = p.get_mut(&ino.1) {
            *n -= 1;
            if *n == 0 {
                p.remove(&ino.1);
            }
        }
    }

    /// Whether any file is pinned.
    pub fn any_pins(&self) -> bool {
        !self.pins.locked().is_empty()
    }

    /// Whether the file with inode number `st_ino` is pinned.
    pub fn pinned(&self, st_ino: u64) -> bool {
        self.pins.locked().contains_key(&st_ino)
    }

    /// Makes stale the grants of `ino` held by connections other than `by`.
    pub fn changing(&self, ino: Inode, by: u64) {
        let m = self.by_inode.locked();
        for h in m.get(&ino).into_iter().flatten() {
            if h.conn != by {
                h.table.bump(h.slot);
            }
        }
    }

    /// Makes every grant stale: a name changed, or a heal or migration session begins, and
    /// which file it touches is not known without a lookup.
    pub fn changing_all(&self) {
        let m = self.by_inode.locked();
        for h in m.values().flatten() {
            h.table.bump(h.slot);
        }
    }
}

/// A connection's grants: its table (made at its first grant) and, per handle, the slot and
/// file.
#[derive(Default)]
pub struct ConnGrants {
    /// The table, once a grant was given.
    pub table: Option<Arc<Table>>,
    /// Handles granted: slot and file.
    pub by_fh: HashMap<u64, (u32, Inode)>,
    /// Files of other handles, learned when one first writes while grants exist.
    pub inodes: HashMap<u64, Inode>,
    /// Handles that pinned their file.
    pub pinned: HashMap<u64, Inode>,
}

impl ConnGrants {
    /// A slot for handle `fh` of file `ino`: its own if it has one (re-granted after a bump),
    /// else a free one. `None` when the table is full.
    pub fn slot_for(&mut self, fh: u64, ino: Inode) -> Option<(Arc<Table>, u32)> {
        let table = self.table.clone()?;
        if let Some(&(slot, i)) = self.by_fh.get(&fh) {
            if i == ino {
                return Some((table, slot));
            }
        }
        let slot = table.take()?;
        self.by_fh.insert(fh, (slot, ino));
        Some((table, slot))
    }

    /// Handle `fh` was released: its grant ends (its slot is bumped before reuse).
    pub fn release(&mut self, grants: &Grants, conn: u64, fh: u64) {
        self.inodes.remove(&fh);
        if let Some(ino) = self.pinned.remove(&fh) {
            grants.unpin(ino);
        }
        if let (Some((slot, ino)), Some(t)) = (self.by_fh.remove(&fh), &self.table) {
            grants.remove(ino, conn, slot);
            t.put(slot);
        }
    }

    /// The connection ended: all its grants end.
    pub fn hangup(&mut self, grants: &Grants, conn: u64) {
        for (_, ino) in self.pinned.drain() {
            grants.unpin(ino);
        }
        for (_, (slot, ino)) in self.by_fh.drain() {
            grants.remove(ino, conn, slot);
            if let Some(t) = &self.table {
                t.bump(slot);
            }
        }
    }
}

/// `(st_dev, st_ino)` of an open file.
pub fn inode_of(f: &std::fs::File) -> io::Result<Inode> {
    let st = rustix::fs::fstat(f)?;
    Ok((st.st_dev, st.st_ino))
}

/// A new read-only open file description of `f` (never the brick's own, which may be
/// writable): through `/proc/self/fd`, so the name it has now does not matter.
pub fn reopen_read_only(f: &std::fs::File) -> io::Result<OwnedFd> {
    // Regular files only, checked before the open: opening a FIFO would wait for a writer.
    let regular = |st: rustix::fs::Stat| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile
    };
    if !regular(rustix::fs::fstat(f)?) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let path = format!("/proc/self/fd/{}", f.as_raw_fd());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    // The same check on what was opened (the first one's file cannot change type, but the
    // name in /proc is resolved again).
    if !regular(rustix::fs::fstat(&file)?) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(file.into())
}
