//! Block checksums of a brick's files: a crc32c of every 4 KiB block, written with the data and
//! checked before a read is answered.
//!
//! **What a sum covers.** Block `i` of a file is its bytes `[i·4096, (i+1)·4096)`, read as
//! zeros past the end of the file, so growing a file (a write further on, a truncate up) never
//! changes the sum of the block it ended in. An entry holds the block's crc32c ([`seal`]ed away
//! from the two reserved values) or [`NONE`] — no sum: a hole, a block never written since
//! sums were kept, or one whose bytes changed behind the layer's back — or [`DIRTY`]: a change
//! of the block was under way. A read checks every block it touches that has a sum; a block
//! whose sum does not match, checked again under the file's write lock (a write racing the
//! read is not damage), fails the read with [`errno::ECKSUM`], is logged and counted.
//!
//! **Where sums live.** One sidecar file per inode, `.kiln/sums/<inode number>` in the brick:
//! a 4 KiB header (magic, inode number, birth time: a sidecar left by a removed file whose
//! number was reused is recognised and started afresh) and then 4 bytes per block. It is
//! sparse like the data (entries of holes are holes) and mapped shared, so an entry is one
//! store to the page cache. Keyed by inode, sums follow renames and hard links; the sidecar
//! goes with the file's last name (unlink, rename over it). Every handle of one inode shares
//! one [`Sums`] (the [`Registry`]).
//!
//! **Crash consistency.** A change first turns the entries of the blocks it will touch that
//! hold a sum into [`DIRTY`] (or, for blocks it empties, [`NONE`]), then changes the data, then
//! stores the new sums. A brick process killed in between leaves `DIRTY` entries in the page
//! cache, never a stale sum: a read meeting one takes the block's bytes as they are and seals
//! them (which replica's bytes are right is the replica marks' business: the client that lost
//! its answer marked the range on the other replicas). Sums reach the disk with the data on
//! `fsync`. After a crash of the host the two may have been written back in either order; a
//! block whose sum then does not match is reported like damage and read from another replica.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock, Weak};

use kiln_proto::iov::RawIov;
use kiln_proto::sync::{MutexExt as _, RwLockExt as _};
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};

use crate::{errno, FopResult};

/// Bytes one sum covers.
pub const BLOCK: u64 = 4096;
/// The sidecar's header; entries follow it.
const HEADER: u64 = 4096;
const MAGIC: [u8; 8] = *b"kilnsum1";
/// No sum for the block.
pub const NONE: u32 = 0;
/// A change of the block was under way.
pub const DIRTY: u32 = u32::MAX;
/// Entries a sidecar has room for at least (its file is sparse: room costs no disk).
const MIN_ENTRIES: u64 = 16 * 1024;
/// The sidecars' directory under the brick's state directory.
const DIR: &str = "sums";

/// The crc32c (Castagnoli) of `data`.
pub fn crc(data: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// The entry that stores sum `c`: the two reserved values are folded onto their neighbours.
pub fn seal(c: u32) -> u32 {
    c.clamp(NONE + 1, DIRTY - 1)
}

/// A descriptor to read `file`'s blocks through when `file` itself is open for writing only
/// (sums of partial blocks need their bytes): the same file opened again read-only, as the
/// caller; `None` when the caller may not read it (those blocks then stay marked mid-change
/// until a read seals them).
pub fn read_side(file: &File) -> Option<File> {
    use std::os::fd::AsRawFd;
    // The magic link names the open file itself, whatever its name is now.
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    rfs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .ok()
        .map(File::from)
}

/// Blocks checked, damage found and interrupted changes sealed, for `/metrics`.
static CHECKED: AtomicU64 = AtomicU64::new(0);
static DAMAGED: AtomicU64 = AtomicU64::new(0);
static RESEALED: AtomicU64 = AtomicU64::new(0);

/// Adds the counters to a `/metrics` scrape.
pub fn render(out: &mut crate::metrics::Scrape) {
    out.counter(
        "kiln_brick_checksum_blocks_checked",
        "Blocks whose checksum a read on the brick checked.",
    )
    .count(&[], CHECKED.load(Relaxed));
    out.counter(
        "kiln_brick_checksum_errors",
        "Blocks whose bytes did not match their checksum when read (damaged copies).",
    )
    .count(&[], DAMAGED.load(Relaxed));
    out.counter(
        "kiln_brick_checksum_resealed",
        "Blocks left mid-change by a brick that stopped, sealed as found when next read.",
    )
    .count(&[], RESEALED.load(Relaxed));
}

/// Counters so far: blocks checked, damaged, resealed.
pub fn counts() -> (u64, u64, u64) {
    (
        CHECKED.load(Relaxed),
        DAMAGED.load(Relaxed),
        RESEALED.load(Relaxed),
    )
}

/// Who an inode is: its number and birth time (a reused number has another birth time).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Key {
    ino: u64,
    born: (i64, u32),
}

/// Where the sidecars live: `.kiln/sums` beneath the brick root, found (or made, on the
/// first write that keeps a sum) when first needed — a brick that was only read makes none.
#[derive(Debug)]
struct Dirs {
    root: OwnedFd,
    found: Mutex<Option<Arc<OwnedFd>>>,
}

impl Dirs {
    /// The sidecars' directory; with `make`, made if missing. `None`: not there (or not a
    /// plain directory: a symlink planted at `.kiln` is never followed).
    fn get(&self, make: bool) -> Option<Arc<OwnedFd>> {
        let mut found = self.found.locked();
        if let Some(d) = &*found {
            return Some(d.clone());
        }
        let open = |at: &OwnedFd, name: &str| -> rustix::io::Result<OwnedFd> {
            let flags = OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::RDONLY;
            match rfs::openat(at, name, flags, Mode::empty()) {
                Err(rustix::io::Errno::NOENT) if make => {
                    match rfs::mkdirat(at, name, Mode::from_raw_mode(0o700)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(e),
                    }
                    rfs::openat(at, name, flags, Mode::empty())
                }
                r => r,
            }
        };
        let r = open(&self.root, super::reach::STATE_DIR).and_then(|state| open(&state, DIR));
        match r {
            Ok(d) => {
                let d = Arc::new(d);
                *found = Some(d.clone());
                Some(d)
            }
            Err(e) => {
                if make && super::trouble::first_in_a_minute("sums:dir") {
                    tracing::error!("cannot open the brick's checksum directory: {e}");
                }
                None
            }
        }
    }
}

/// The [`Sums`] of a brick's open inodes, and the directory of their sidecars.
#[derive(Debug)]
pub struct Registry {
    /// The brick root's device: files elsewhere (a file system mounted inside the brick) keep
    /// no sums, their inode numbers are another space.
    dev: u64,
    dirs: Arc<Dirs>,
    open: Mutex<HashMap<u64, Weak<Sums>>>,
}

impl Registry {
    /// The sums of the brick whose root is `root`.
    pub fn new(root: &OwnedFd) -> std::io::Result<Registry> {
        let dev = rfs::fstat(root)?.st_dev;
        #[allow(clippy::unnecessary_cast)] // st_dev's type differs between architectures
        Ok(Registry {
            dev: dev as u64,
            dirs: Arc::new(Dirs {
                root: root.try_clone()?,
                found: Mutex::new(None),
            }),
            open: Mutex::default(),
        })
    }

    /// The sums of the regular file open as `file` (`None`: it keeps none — not a regular
    /// file, on another device, or its file system tells no birth time).
    pub fn of(&self, file: &File) -> Option<Arc<Sums>> {
        let key = self.key_of(file.as_fd())?;
        let mut open = self.open.locked();
        if let Some(s) = open.get(&key.ino).and_then(Weak::upgrade) {
            if s.key == key {
                return Some(s);
            }
        }
        if open.len() >= 4096 {
            open.retain(|_, w| w.strong_count() > 0);
        }
        let s = Arc::new(Sums {
            key,
            dirs: self.dirs.clone(),
            side: RwLock::new(Side::Unknown),
            writing: Mutex::new(()),
        });
        open.insert(key.ino, Arc::downgrade(&s));
        Some(s)
    }

    fn key_of(&self, fd: impl AsFd) -> Option<Key> {
        let want = rfs::StatxFlags::TYPE | rfs::StatxFlags::INO | rfs::StatxFlags::BTIME;
        let st = rfs::statx(fd, "", AtFlags::EMPTY_PATH, want).ok()?;
        let dev = rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor);
        let regular = u32::from(st.stx_mode) & libc::S_IFMT == libc::S_IFREG;
        let born = st.stx_mask & rfs::StatxFlags::BTIME.bits() != 0;
        #[allow(clippy::unnecessary_cast)]
        (regular && born && dev as u64 == self.dev).then_some(Key {
            ino: st.stx_ino,
            born: (st.stx_btime.tv_sec, st.stx_btime.tv_nsec),
        })
    }

    /// Forgets the sums of the inode numbered `ino`, whose last name is gone.
    pub fn removed(&self, ino: u64) {
        if let Some(dir) = self.dirs.get(false) {
            match rfs::unlinkat(&*dir, ino.to_string(), AtFlags::empty()) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => tracing::warn!(ino, "cannot remove a checksum file: {e}"),
            }
        }
    }
}

/// A mapped sidecar.
struct Map {
    file: File,
    base: NonNull<u8>,
    /// Bytes mapped (the sidecar's size).
    len: usize,
}

// SAFETY: the mapping is plain shared memory, reached only through `AtomicU32`s and the
// header bytes read once; nothing in it is tied to a thread.
unsafe impl Send for Map {}
// SAFETY: as above: every access to the entries is atomic.
unsafe impl Sync for Map {}

impl Map {
    /// Entries it has room for.
    fn room(&self) -> u64 {
        (self.len as u64 - HEADER) / 4
    }

    /// Entry `i`, if within the room.
    fn entry(&self, i: u64) -> Option<&AtomicU32> {
        if i >= self.room() {
            return None;
        }
        let at = (HEADER + 4 * i) as usize;
        // SAFETY: `at + 4 <= len`, the mapping is live while `self` is, page-aligned so `at` is
        // 4-aligned, and shared memory is only ever reached atomically.
        Some(unsafe { &*self.base.as_ptr().add(at).cast::<AtomicU32>() })
    }

    fn new(file: File, len: usize) -> std::io::Result<Map> {
        // SAFETY: a new shared mapping of a file we own the descriptor of, sized to the file
        // (the sidecar is never shrunk while mapped: entries are cleared by punching holes),
        // so no access through it can fault past the end.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &file,
                0,
            )?
        };
        let base = NonNull::new(p.cast::<u8>()).ok_or(std::io::ErrorKind::Other)?;
        Ok(Map { file, base, len })
    }

    /// Clears entries `[from, to)`: whole pages of them by punching a hole in the sidecar,
    /// the rest one by one.
    fn clear(&self, from: u64, to: u64) {
        let to = to.min(self.room());
        if from >= to {
            return;
        }
        let per_page = 4096 / 4;
        let first_page = from.div_ceil(per_page) * per_page;
        let last_page = to / per_page * per_page;
        if last_page > first_page {
            let flags = rfs::FallocateFlags::PUNCH_HOLE | rfs::FallocateFlags::KEEP_SIZE;
            let (at, n) = (HEADER + first_page * 4, (last_page - first_page) * 4);
            if rfs::fallocate(&self.file, flags, at, n).is_ok() {
                for i in (from..first_page).chain(last_page..to) {
                    if let Some(e) = self.entry(i) {
                        e.store(NONE, Relaxed);
                    }
                }
                return;
            }
        }
        for i in from..to {
            if let Some(e) = self.entry(i) {
                if e.load(Relaxed) != NONE {
                    e.store(NONE, Relaxed);
                }
            }
        }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, with its length; no reference into it outlives
        // `self` (entries are borrowed from `&self`).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

enum Side {
    /// Not looked for yet.
    Unknown,
    /// The inode has no sidecar (no sums).
    Absent,
    Present(Map),
}

/// The sums of one inode.
pub struct Sums {
    key: Key,
    dirs: Arc<Dirs>,
    side: RwLock<Side>,
    /// Held across every change of the file's bytes (and its sums) through this layer, and by
    /// a read that checks a block again.
    writing: Mutex<()>,
}

impl Sums {
    fn name(&self) -> String {
        self.key.ino.to_string()
    }

    fn header(&self) -> [u8; 32] {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&MAGIC);
        h[8..16].copy_from_slice(&self.key.ino.to_le_bytes());
        h[16..24].copy_from_slice(&self.key.born.0.to_le_bytes());
        h[24..28].copy_from_slice(&self.key.born.1.to_le_bytes());
        h
    }

    /// Opens the sidecar if it exists and is this inode's.
    fn load(&self) -> Side {
        let flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let Some(dir) = self.dirs.get(false) else {
            return Side::Absent;
        };
        let Ok(fd) = rfs::openat(&*dir, self.name(), flags, Mode::empty()) else {
            return Side::Absent;
        };
        let file = File::from(fd);
        let mut h = [0u8; 32];
        let len = file.metadata().map_or(0, |m| m.len());
        if len <= HEADER || file.read_exact_at(&mut h, 0).is_err() || h != self.header() {
            return Side::Absent;
        }
        match Map::new(file, len as usize) {
            Ok(m) => Side::Present(m),
            Err(e) => {
                tracing::warn!(ino = self.key.ino, "cannot map a checksum file: {e}");
                Side::Absent
            }
        }
    }

    /// Makes sure the sidecar exists with room for `entries`, under the write lock. Returns
    /// false when it cannot (the change then keeps no sums beyond the room there is).
    fn make_room(&self, entries: u64) -> bool {
        {
            let side = self.side.read_locked();
            if let Side::Present(m) = &*side {
                if m.room() >= entries {
                    return true;
                }
            }
        }
        let mut side = self.side.write_locked();
        if matches!(*side, Side::Unknown) {
            *side = self.load();
        }
        let have = match &*side {
            Side::Present(m) if m.room() >= entries => return true,
            Side::Present(m) => Some(m.file.try_clone()),
            _ => None,
        };
        let room = entries.max(MIN_ENTRIES).next_power_of_two();
        let len = HEADER + room * 4;
        let r = (|| -> std::io::Result<Map> {
            let file = match have {
                Some(f) => f?,
                None => {
                    // A sidecar of another inode that had this number, or none: start afresh,
                    // in a new file (a reader may still have the old one mapped: it is never
                    // cut short under it).
                    let dir = self.dirs.get(true).ok_or(std::io::ErrorKind::NotFound)?;
                    match rfs::unlinkat(&*dir, self.name(), AtFlags::empty()) {
                        Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                        Err(e) => return Err(e.into()),
                    }
                    let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW;
                    let fd = rfs::openat(
                        &*dir,
                        self.name(),
                        flags | OFlags::CLOEXEC,
                        Mode::from_raw_mode(0o600),
                    )?;
                    let f = File::from(fd);
                    f.write_all_at(&self.header(), 0)?;
                    f
                }
            };
            file.set_len(len)?;
            Map::new(file, len as usize)
        })();
        match r {
            Ok(m) => {
                *side = Side::Present(m);
                true
            }
            Err(e) => {
                tracing::error!(ino = self.key.ino, "cannot grow a checksum file: {e}");
                false
            }
        }
    }

    /// Runs `f` on the mapped sidecar, if there is one.
    fn with_map<T>(&self, f: impl FnOnce(&Map) -> T) -> Option<T> {
        {
            let side = self.side.read_locked();
            match &*side {
                Side::Present(m) => return Some(f(m)),
                Side::Absent => return None,
                Side::Unknown => {}
            }
        }
        let mut side = self.side.write_locked();
        if matches!(*side, Side::Unknown) {
            *side = self.load();
        }
        match &*side {
            Side::Present(m) => Some(f(m)),
            _ => None,
        }
    }

    /// Writes `len` bytes from `iov` at `offset` by `write` (which returns the bytes
    /// written), keeping the sums of the blocks it touches.
    pub fn write(
        &self,
        file: &File,
        offset: u64,
        iov: &[RawIov],
        len: usize,
        write: impl FnOnce() -> FopResult<usize>,
    ) -> FopResult<usize> {
        if len == 0 {
            return write();
        }
        let _w = self.writing.locked();
        let (first, end) = (offset / BLOCK, (offset + len as u64).div_ceil(BLOCK));
        self.make_room(end);
        self.with_map(|m| dirty(m, first, end));
        let n = write()?;
        let end = (offset + n as u64).div_ceil(BLOCK);
        self.with_map(|m| {
            let mut blocks = Blocks::new(iov, n);
            for b in first..end {
                let Some(e) = m.entry(b) else { break };
                let (start, stop) = (b * BLOCK, (b + 1) * BLOCK);
                let sum = if start >= offset && stop <= offset + n as u64 {
                    blocks.crc_at((start - offset) as usize)
                } else {
                    block_crc(file, b)
                };
                if let Some(c) = sum {
                    e.store(seal(c), Relaxed);
                }
            }
        });
        Ok(n)
    }

    /// Sets the file's size by `cut` (a truncate), keeping the sums: none past the new end,
    /// the block it ends in sealed again.
    pub fn truncate<T>(
        &self,
        file: &File,
        size: u64,
        cut: impl FnOnce() -> FopResult<T>,
    ) -> FopResult<T> {
        let _w = self.writing.locked();
        let edge = size / BLOCK;
        let partial = !size.is_multiple_of(BLOCK);
        self.with_map(|m| {
            m.clear(size.div_ceil(BLOCK), m.room());
            if partial {
                dirty(m, edge, edge + 1);
            }
        });
        let r = cut()?;
        if partial {
            self.reseal(file, edge, edge + 1);
        }
        Ok(r)
    }

    /// Zeroes `[offset, offset + len)` by `zero` (a punch or a zero range): blocks wholly
    /// inside lose their sums (holes stay free), the two at the edges are sealed again.
    pub fn zero(
        &self,
        file: &File,
        offset: u64,
        len: u64,
        zero: impl FnOnce() -> FopResult<()>,
    ) -> FopResult<()> {
        if len == 0 {
            return zero();
        }
        let _w = self.writing.locked();
        let end = offset.saturating_add(len);
        let (inner, inner_end) = (offset.div_ceil(BLOCK), end / BLOCK);
        let (first, last) = (offset / BLOCK, end.div_ceil(BLOCK));
        self.with_map(|m| {
            m.clear(inner, inner_end.max(inner));
            dirty(m, first, inner.min(last));
            dirty(m, inner_end.max(first), last);
        });
        zero()?;
        self.reseal(file, first, inner.min(last));
        self.reseal(file, inner_end.max(first), last);
        Ok(())
    }

    /// Forgets every sum from `offset` on, before `op` moves the file's bytes (a collapse or
    /// insert range) or changes them behind this layer.
    pub fn forget_from<T>(&self, offset: u64, op: impl FnOnce() -> FopResult<T>) -> FopResult<T> {
        let _w = self.writing.locked();
        self.with_map(|m| m.clear(offset / BLOCK, m.room()));
        op()
    }

    /// Seals blocks `[from, to)` as their bytes are now (those that held a sum).
    fn reseal(&self, file: &File, from: u64, to: u64) {
        self.with_map(|m| {
            for b in from..to {
                let Some(e) = m.entry(b) else { break };
                if e.load(Relaxed) != NONE {
                    match block_crc(file, b) {
                        Some(c) => e.store(seal(c), Relaxed),
                        None => e.store(NONE, Relaxed),
                    }
                }
            }
        });
    }

    /// Checks what a read returned: `data`, read at `offset`, where a read of `wanted` bytes
    /// came back short only at the end of the file. `ECKSUM` if a block is damaged.
    pub fn check(&self, file: &File, offset: u64, data: &[u8], wanted: usize) -> FopResult<()> {
        let suspect = self.suspects(file, offset, data, wanted);
        if suspect.is_empty() {
            return Ok(());
        }
        let damaged = self.recheck(file, &suspect);
        if damaged.is_empty() {
            return Ok(());
        }
        self.report(&damaged);
        Err(errno::ECKSUM)
    }

    /// The blocks of `data` (see [`Sums::check`]) whose sum does not match at first sight.
    fn suspects(&self, file: &File, offset: u64, data: &[u8], wanted: usize) -> Vec<u64> {
        let n = data.len() as u64;
        if n == 0 {
            return Vec::new();
        }
        let eof = data.len() < wanted;
        let (first, end) = (offset / BLOCK, (offset + n).div_ceil(BLOCK));
        self.with_map(|m| {
            let mut checked = 0;
            let mut suspect = Vec::new();
            for b in first..end {
                let Some(e) = m.entry(b) else { break };
                let want = e.load(Relaxed);
                if want == NONE {
                    continue;
                }
                checked += 1;
                let (start, stop) = (b * BLOCK, (b + 1) * BLOCK);
                let got = if start >= offset && stop <= offset + n {
                    Some(crc(
                        &data[(start - offset) as usize..(stop - offset) as usize]
                    ))
                } else if start >= offset && eof {
                    // The file ends inside the block: the rest reads as zeros.
                    Some(crc_padded(&data[(start - offset) as usize..]))
                } else {
                    block_crc(file, b)
                };
                if got.map(seal) != Some(want) {
                    suspect.push(b);
                }
            }
            CHECKED.fetch_add(checked, Relaxed);
            suspect
        })
        .unwrap_or_default()
    }

    /// Reads `[offset, offset + len)` of the file in pieces and returns the blocks whose
    /// sums do not match: for a read the brick answers from the file itself (not from a
    /// buffer it filled), and for scrub.
    fn damaged_in(&self, file: &File, offset: u64, len: u64) -> FopResult<Vec<u64>> {
        if self.with_map(|_| ()).is_none() {
            return Ok(Vec::new());
        }
        thread_local! {
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        const PIECE: usize = 64 * 1024;
        BUF.with_borrow_mut(|buf| {
            buf.resize(PIECE, 0);
            let mut damaged = Vec::new();
            let mut done = 0u64;
            while done < len {
                let want = (len - done).min(PIECE as u64) as usize;
                let at = offset + done;
                let got = read_full(file, &mut buf[..want], at)?;
                let suspect = self.suspects(file, at, &buf[..got], want);
                if !suspect.is_empty() {
                    damaged.extend(self.recheck(file, &suspect));
                }
                if got < want {
                    break;
                }
                done += got as u64;
            }
            Ok(damaged)
        })
    }

    /// [`Sums::check`] of `[offset, offset + len)` read from the file.
    pub fn check_file(&self, file: &File, offset: u64, len: usize) -> FopResult<()> {
        let damaged = self.damaged_in(file, offset, len as u64)?;
        if damaged.is_empty() {
            return Ok(());
        }
        self.report(&damaged);
        Err(errno::ECKSUM)
    }

    /// Checks every block of the file: the blocks whose bytes do not match their sums.
    pub fn scrub(&self, file: &File) -> FopResult<Vec<u64>> {
        let size = file
            .metadata()
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO) as u32)?
            .len();
        self.damaged_in(file, 0, size)
    }

    /// The entries a reader that checks the data itself gets with `[offset, offset + len)`
    /// of a file of `size` bytes (see [`kiln_proto::ops::HELLO_SUMS`]): each block's sum where
    /// the data holds the whole block (or all of it up to the end of the file); [`NONE`] for a
    /// block without one, and for one the data covers only in part or that was mid-change,
    /// which this checks itself (`ECKSUM` if damaged). `None`: nothing for the reader to check.
    pub fn shipped(
        &self,
        file: &File,
        offset: u64,
        len: usize,
        size: u64,
    ) -> FopResult<Option<Vec<u32>>> {
        let end = offset + len as u64;
        if len == 0 {
            return Ok(None);
        }
        let mut here = Vec::new();
        let Some(out) = self.with_map(|m| {
            (offset / BLOCK..end.div_ceil(BLOCK))
                .map(|b| {
                    let e = m.entry(b).map_or(NONE, |e| e.load(Relaxed));
                    let whole = b * BLOCK >= offset && ((b + 1) * BLOCK <= end || end == size);
                    if e == NONE || (whole && e != DIRTY) {
                        e
                    } else {
                        here.push(b);
                        NONE
                    }
                })
                .collect::<Vec<u32>>()
        }) else {
            return Ok(None);
        };
        if !here.is_empty() {
            CHECKED.fetch_add(here.len() as u64, Relaxed);
            let damaged = self.recheck(file, &here);
            if !damaged.is_empty() {
                self.report(&damaged);
                return Err(errno::ECKSUM);
            }
        }
        Ok(out.iter().any(|e| *e != NONE).then_some(out))
    }

    /// Blocks whose sum did not match, checked again with no change under way: a change
    /// left half done is sealed as found; the blocks still wrong are damaged.
    fn recheck(&self, file: &File, blocks: &[u64]) -> Vec<u64> {
        let _w = self.writing.locked();
        let mut damaged = Vec::new();
        self.with_map(|m| {
            for &b in blocks {
                let Some(e) = m.entry(b) else { continue };
                let want = e.load(Relaxed);
                let got = block_crc(file, b).map(seal);
                match (want, got) {
                    (NONE, _) => {}
                    (DIRTY, Some(c)) => {
                        e.store(c, Relaxed);
                        RESEALED.fetch_add(1, Relaxed);
                    }
                    (w, Some(c)) if w == c => {}
                    // Unreadable now: the read itself reports that, it is not damage.
                    (_, None) => {}
                    _ => damaged.push(b),
                }
            }
        });
        damaged
    }

    /// Counts and logs damaged blocks (once a minute per inode and first block).
    fn report(&self, damaged: &[u64]) {
        DAMAGED.fetch_add(damaged.len() as u64, Relaxed);
        let (first, last) = (damaged[0], damaged[damaged.len() - 1]);
        if super::trouble::first_in_a_minute(&format!("sums:{}:{first}", self.key.ino)) {
            tracing::error!(
                ino = self.key.ino,
                blocks = damaged.len(),
                offset = first * BLOCK,
                end = (last + 1) * BLOCK,
                "checksum mismatch: {} block(s) of inode {} between bytes {} and {} do not \
                 match their sums (this copy is damaged; a replicated volume reads another \
                 and repairs it)",
                damaged.len(),
                self.key.ino,
                first * BLOCK,
                (last + 1) * BLOCK
            );
        }
    }

    /// Writes the sums back to stable storage (with the file's `fsync`).
    pub fn sync(&self) -> FopResult<()> {
        self.with_map(|m| rfs::fdatasync(&m.file).map_err(|e| e.raw_os_error() as u32))
            .unwrap_or(Ok(()))
    }

    /// Seals every block of the file as its bytes are now, and keeps no sum past its end:
    /// for bytes that changed behind this layer (or were there before it kept sums) when they
    /// are known to be right. Returns the blocks sealed.
    pub fn rebuild(&self, file: &File) -> FopResult<u64> {
        let _w = self.writing.locked();
        let size = file
            .metadata()
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO) as u32)?
            .len();
        let blocks = size.div_ceil(BLOCK);
        self.make_room(blocks.max(1));
        let mut sealed = 0;
        self.with_map(|m| {
            for b in 0..blocks {
                let Some(e) = m.entry(b) else { break };
                match block_crc(file, b) {
                    Some(c) => {
                        e.store(seal(c), Relaxed);
                        sealed += 1;
                    }
                    None => e.store(NONE, Relaxed),
                }
            }
            m.clear(blocks, m.room());
        });
        Ok(sealed)
    }

    /// A read-only descriptor of the sidecar, for a reader of the file that checks the
    /// blocks it reads itself (`None`: no sums).
    pub fn reader(&self) -> Option<File> {
        self.with_map(|_| ())?;
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        rfs::openat(&*self.dirs.get(false)?, self.name(), flags, Mode::empty())
            .ok()
            .map(File::from)
    }

    /// The entry of block `b` (for tests and scrub).
    pub fn entry(&self, b: u64) -> u32 {
        self.with_map(|m| m.entry(b).map_or(NONE, |e| e.load(Relaxed)))
            .unwrap_or(NONE)
    }
}

/// Marks blocks `[from, to)` that hold a sum as mid-change.
fn dirty(m: &Map, from: u64, to: u64) {
    for b in from..to {
        let Some(e) = m.entry(b) else { break };
        if e.load(Relaxed) != NONE {
            e.store(DIRTY, Relaxed);
        }
    }
}

/// The entry a block holding `data` (then zeros: the file ends there, or `data` is whole)
/// has when its sum is right.
pub fn block_entry(data: &[u8]) -> u32 {
    seal(crc_padded(data))
}

/// The sum of `data` followed by zeros up to a whole block.
fn crc_padded(data: &[u8]) -> u32 {
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    d.update(data);
    d.update(&ZEROS[..BLOCK as usize - data.len().min(BLOCK as usize)]);
    d.finalize() as u32
}

static ZEROS: [u8; BLOCK as usize] = [0; BLOCK as usize];

/// The sum of block `b` of the file as it is now (`None` if it cannot be read).
fn block_crc(file: &File, b: u64) -> Option<u32> {
    let mut buf = [0u8; BLOCK as usize];
    let n = read_full(file, &mut buf, b * BLOCK).ok()?;
    Some(crc_padded(&buf[..n]))
}

/// Reads into `buf` at `offset` until it is full or the file ends; the bytes read.
fn read_full(file: &File, buf: &mut [u8], offset: u64) -> FopResult<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.raw_os_error().unwrap_or(libc::EIO) as u32),
        }
    }
    Ok(done)
}

/// Whole blocks of a written payload, in place.
struct Blocks<'a> {
    iov: &'a [RawIov],
    n: usize,
    /// Where the last block began: a vector's index and the payload offset of its start
    /// (blocks are asked for in order, so each is found from there, not from the first vector).
    at: (usize, usize),
}

impl<'a> Blocks<'a> {
    fn new(iov: &'a [RawIov], n: usize) -> Blocks<'a> {
        Blocks { iov, n, at: (0, 0) }
    }

    /// The sum of the `BLOCK` bytes at `at` in the payload.
    fn crc_at(&mut self, at: usize) -> Option<u32> {
        if at + BLOCK as usize > self.n {
            return None;
        }
        if at < self.at.1 {
            self.at = (0, 0);
        }
        let (mut i, mut start) = self.at;
        while i < self.iov.len() && start + self.iov[i].len <= at {
            start += self.iov[i].len;
            i += 1;
        }
        self.at = (i, start);
        let mut skip = at - start;
        let mut want = BLOCK as usize;
        let mut d: Option<crc_fast::Digest> = None;
        for v in &self.iov[i..] {
            let take = (v.len - skip).min(want);
            // SAFETY: the payload's vectors stay valid and unchanged until the write fop
            // completes (the IoBufs contract), and this runs within it; `skip + take <= len`.
            let s = unsafe { std::slice::from_raw_parts((v.base + skip) as *const u8, take) };
            if take == BLOCK as usize {
                return Some(crc(s));
            }
            d.get_or_insert_with(|| crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
                .update(s);
            want -= take;
            skip = 0;
            if want == 0 {
                break;
            }
        }
        (want == 0).then(|| d.map_or(crc(&[]), |d| d.finalize() as u32))
    }
}

mod reader;
mod tree;
pub use reader::verify_shipped;
pub use tree::{check_tree, rebuild_at, TreeCheck};

#[cfg(test)]
mod tests;
