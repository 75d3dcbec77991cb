//! Local short-circuit reads: the client's side (the brick's is `kiln_server::grants`).
//!
//! When a protocol-client's brick is on this host (a Unix-socket connection), a handle that
//! reads more than once asks the brick for a *grant*: a read-only descriptor of the brick's
//! file, a slot of the connection's generation table (a memfd the brick bumps before anything
//! that could make a direct read differ from a read through it) and the slot's value now.
//! Reads then go straight to the file with `preadv`, checked like a seqlock:
//!
//! 1. load the slot; if it is not the granted value, or the connection is not the one the
//!    grant came on, the grant is dropped and the read goes to the brick;
//! 2. `preadv` into the caller's memory;
//! 3. fence, load the slot again: unchanged means the bytes are what the brick would have
//!    sent; changed means the read is done again through the brick (its bytes are
//!    overwritten there).
//!
//! A dropped grant is asked for again after a growing number of reads through the brick
//! (another client writing the file all the time would otherwise cost a grant per read).
//! Direct reads are reported to the brick with the next grant, or at most a second later, so
//! `kiln volume profile` counts them (`localread`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_proto::iov::RawIov;
use kiln_proto::sync::MutexExt as _;

mod copier;
pub use copier::{copy, copy_inline_on_this_thread, LARGE};

/// Reads through the brick after a stale grant before asking again, at first; doubles up to
/// [`BACKOFF_MAX`].
const BACKOFF_MIN: u32 = 16;
const BACKOFF_MAX: u32 = 4096;
/// Backoff's count while a request for a grant is out.
const ASKING: u32 = u32::MAX;
/// How often direct reads are reported to the brick at most.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// A descriptor the brick sent, mapped whole and read-only.
struct Mapped {
    base: *const u8,
    len: usize,
    _fd: OwnedFd,
}

// SAFETY: `base` points at a shared read-only mapping that lives as long as `Mapped` and is
// only read through atomics.
unsafe impl Send for Mapped {}
// SAFETY: as above.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps `fd` whole, if its size is at least `min` and at most `max` bytes.
    fn new(fd: OwnedFd, min: usize, max: usize) -> std::io::Result<Mapped> {
        let len = rustix::fs::fstat(&fd)?.st_size as usize;
        if len < min || len > max {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: a fresh read-only shared mapping of the whole descriptor; checked for
        // failure. The brick never shrinks what it sends (a sealed memfd; a checksum file it
        // only grows), so the mapping stays backed.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapped {
            base: base as *const u8,
            len,
            _fd: fd,
        })
    }

    /// The 8-byte word at byte `at`, if in bounds.
    fn load64(&self, at: usize) -> Option<u64> {
        // SAFETY: in bounds of the mapping (checked) and 8-aligned (callers index words),
        // which lives as long as `self`; the brick changes it only with atomic operations.
        (at + 8 <= self.len)
            .then(|| unsafe { (*self.base.add(at).cast::<AtomicU64>()).load(Ordering::Acquire) })
    }

    /// The 4-byte word at byte `at`, if in bounds.
    fn load32(&self, at: usize) -> Option<u32> {
        // SAFETY: as `load64`, for a 4-aligned word.
        (at + 4 <= self.len).then(|| unsafe {
            (*self.base.add(at).cast::<std::sync::atomic::AtomicU32>()).load(Ordering::Acquire)
        })
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, referenced by nothing else once we drop.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// A connection's generation table, mapped read-only.
pub struct Table(Mapped);

impl Table {
    /// Maps the table the brick sent.
    pub fn map(memfd: OwnedFd) -> std::io::Result<Arc<Table>> {
        // A brick's table has 4096 slots; refuse anything absurd rather than map it.
        Ok(Arc::new(Table(Mapped::new(memfd, 8, 8 << 20)?)))
    }

    fn load(&self, slot: u32) -> Option<u64> {
        self.0.load64(slot as usize * 8)
    }
}

/// A file's block checksums as its brick keeps them (see [`kiln_proto::ops::GRANT_SUMS`]),
/// mapped read-only.
pub struct Sums(Mapped);

impl Sums {
    /// Maps the checksums the brick sent.
    pub fn map(fd: OwnedFd) -> std::io::Result<Sums> {
        Ok(Sums(Mapped::new(fd, 4096, 1 << 40)?))
    }

    /// Block `b`'s entry; `None` past what was mapped (the brick grew it since).
    fn entry(&self, b: u64) -> Option<u32> {
        let at = usize::try_from(4096 + 4 * b).ok()?;
        self.0.load32(at)
    }

    /// Checks `n` bytes read at `offset` into `iov` (fewer than asked: the file ended there)
    /// against the sums; blocks the read holds only in part are read whole from `file`.
    /// False when a block cannot be vouched for here (mid-change, past the mapping, or not
    /// matching): the read then goes through the brick, which checks it carefully.
    ///
    /// # Safety
    /// The first `n` bytes of `iov` must be readable (just filled by the read).
    unsafe fn check(
        &self,
        file: &OwnedFd,
        iov: &[RawIov],
        offset: u64,
        n: usize,
        eof: bool,
    ) -> bool {
        use kiln_layer::layers::posix::sums::{block_entry, verify_shipped, BLOCK, DIRTY, NONE};
        if n == 0 {
            return true;
        }
        let end = offset + n as u64;
        let (first, last) = (offset / BLOCK, end.div_ceil(BLOCK));
        let mut entries = Vec::with_capacity((last - first) as usize);
        for b in first..last {
            let Some(e) = self.entry(b) else { return false };
            if e == DIRTY {
                return false;
            }
            let whole = b * BLOCK >= offset && ((b + 1) * BLOCK <= end || eof);
            if e != NONE && !whole {
                let mut buf = [0u8; BLOCK as usize];
                // SAFETY: a read into our own stack buffer.
                let got = unsafe {
                    libc::pread(
                        file.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        (b * BLOCK) as i64,
                    )
                };
                if got < 0 || block_entry(&buf[..got as usize]) != e {
                    return false;
                }
                entries.push(NONE);
            } else {
                entries.push(e);
            }
        }
        // SAFETY: per the caller's contract, these bytes were just filled.
        let pieces = unsafe { filled(iov, n) };
        verify_shipped(offset, &entries, &pieces).is_ok()
    }
}

/// The first `n` bytes of the memory `iov` describes, as slices, to be read in place.
///
/// # Safety
/// Those bytes must be readable, and not written, while the slices live.
pub(crate) unsafe fn filled<'a>(iov: &[RawIov], n: usize) -> Vec<&'a [u8]> {
    let mut left = n;
    iov.iter()
        .map(|v| {
            let k = left.min(v.len);
            left -= k;
            // SAFETY: per the caller's contract; `k` is within the vector.
            unsafe { std::slice::from_raw_parts(v.base as *const u8, k) }
        })
        .collect()
}

/// A grant: the brick's file, and the slot value reads through it are current under.
pub struct Grant {
    file: OwnedFd,
    /// The file's block checksums, when it keeps them.
    sums: Option<Sums>,
    table: Arc<Table>,
    slot: u32,
    gen: u64,
    /// The connection (its generation in the layer) the grant came on.
    conn: u64,
}

/// Where a handle stands.
enum State {
    /// Not asked yet: reads so far.
    Untried(u32),
    Held(Arc<Grant>),
    /// Dropped: reads through the brick left before asking again, and the next wait.
    Backoff(u32, u32),
    /// The brick said no (not a regular file, write-only, table full): never for this handle.
    Refused,
}

/// A handle's short-circuit state.
pub struct HandleGrant(Mutex<State>);

impl Default for HandleGrant {
    fn default() -> HandleGrant {
        HandleGrant(Mutex::new(State::Untried(0)))
    }
}

/// What a read should do.
pub enum Plan {
    /// Read through this grant.
    Direct(Arc<Grant>),
    /// Ask for a grant first, then read through it.
    Ask,
    /// Go to the brick.
    Brick,
}

impl HandleGrant {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.locked()
    }

    /// What the next read on connection `conn` does.
    pub fn plan(&self, conn: u64) -> Plan {
        let mut s = self.state();
        match &mut *s {
            State::Held(g) if g.conn == conn => Plan::Direct(g.clone()),
            State::Held(_) => {
                *s = State::Untried(1);
                Plan::Brick
            }
            // A handle read once gets no grant: a small file read whole costs no extra request.
            State::Untried(0) => {
                *s = State::Untried(1);
                Plan::Brick
            }
            State::Untried(_) => {
                *s = State::Backoff(ASKING, BACKOFF_MIN);
                Plan::Ask
            }
            State::Backoff(0, next) => {
                *s = State::Backoff(ASKING, *next);
                Plan::Ask
            }
            State::Backoff(left, _) => {
                // While asking (ASKING), other reads go to the brick.
                if *left != ASKING {
                    *left -= 1;
                }
                Plan::Brick
            }
            State::Refused => Plan::Brick,
        }
    }

    /// A request for a grant went away unanswered (its future was dropped): back to the
    /// brick for a while, rather than waiting for ever on an answer that will not come.
    pub fn abandoned(&self) {
        if matches!(*self.state(), State::Backoff(ASKING, _)) {
            self.dropped();
        }
    }

    /// True once the handle was granted (it may have read straight from the file).
    pub fn used(&self) -> bool {
        !matches!(*self.state(), State::Untried(_) | State::Refused)
    }

    /// The brick granted `g`.
    pub fn granted(&self, g: Grant) -> Arc<Grant> {
        let g = Arc::new(g);
        *self.state() = State::Held(g.clone());
        g
    }

    /// The brick refused for good.
    pub fn refused(&self) {
        *self.state() = State::Refused;
    }

    /// `g` went stale (or asking failed for now): back to the brick for a while.
    pub fn dropped(&self) {
        let mut s = self.state();
        let next = match &*s {
            State::Backoff(_, next) => *next,
            _ => BACKOFF_MIN,
        };
        *s = State::Backoff(next, (next * 2).min(BACKOFF_MAX));
    }
}

impl Grant {
    /// A grant from a GRANT reply's slot and value, its file, and the table (the one that
    /// came with it, or the connection's).
    pub fn new(
        file: OwnedFd,
        sums: Option<Sums>,
        table: Arc<Table>,
        slot: u32,
        gen: u64,
        conn: u64,
    ) -> Grant {
        Grant {
            file,
            sums,
            table,
            slot,
            gen,
            conn,
        }
    }

    fn current(&self) -> bool {
        self.table.load(self.slot) == Some(self.gen)
    }

    /// Reads into `iov` at `offset` straight from the brick's file: the bytes read (short only
    /// at end of file), or `None` when the grant is stale or a block cannot be vouched for
    /// against the file's checksums (the memory's contents are then unspecified, and the read
    /// must go to the brick).
    ///
    /// # Safety
    /// The vectors must point at memory the caller may write for the call's duration.
    pub unsafe fn read(&self, iov: &[RawIov], offset: u64) -> Option<usize> {
        if !self.current() {
            return None;
        }
        let mut done = 0usize;
        let total: usize = iov.iter().map(|v| v.len).sum();
        let mut rest = std::borrow::Cow::Borrowed(iov);
        while done < total {
            if done > 0 {
                rest = std::borrow::Cow::Owned(skip_bytes(iov, done));
            }
            // SAFETY: `rest` describes the caller's writable memory past what is filled; the
            // iovec layout of `RawIov` is `struct iovec`'s.
            let n = unsafe {
                libc::preadv(
                    self.file.as_raw_fd(),
                    rest.as_ptr() as *const libc::iovec,
                    rest.len().min(1024) as i32,
                    (offset + done as u64) as i64,
                )
            };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return None;
            }
            if n == 0 {
                break;
            }
            done += n as usize;
        }
        if let Some(s) = &self.sums {
            // SAFETY: `done` bytes of the caller's memory were just filled.
            if !unsafe { s.check(&self.file, iov, offset, done, done < total) } {
                return None;
            }
        }
        // The data and checksum loads above happen before the second look at the slot (a
        // seqlock's read side: the brick bumps before it changes anything).
        fence(Ordering::SeqCst);
        self.current().then_some(done)
    }
}

/// The vectors past `n` bytes of `iov`.
fn skip_bytes(iov: &[RawIov], mut n: usize) -> Vec<RawIov> {
    let mut out = Vec::with_capacity(iov.len());
    for v in iov {
        if n >= v.len {
            n -= v.len;
            continue;
        }
        out.push(RawIov {
            base: v.base + n,
            len: v.len - n,
        });
        n = 0;
    }
    out
}

/// A protocol-client's short-circuit: on or off, the connection's table, and the direct reads
/// not yet reported to the brick.
pub struct Shortcut {
    /// The connection is a Unix socket: the only kind a brick grants over.
    unix: bool,
    on: AtomicBool,
    table: Mutex<Option<(u64, Arc<Table>)>>,
    reads: AtomicU64,
    bytes: AtomicU64,
    /// Reads made straight from the brick's files, all told.
    pub direct: AtomicU64,
    /// Direct reads found stale (and done again through the brick), all told.
    pub stale: AtomicU64,
    /// When the last report went, in milliseconds since `born`.
    reported_ms: AtomicU64,
    born: Instant,
}

impl Shortcut {
    /// For a connection over a Unix socket (`unix`) or not; on until [`Shortcut::set`].
    pub fn new(unix: bool) -> Shortcut {
        Shortcut {
            unix,
            on: AtomicBool::new(true),
            table: Mutex::new(None),
            reads: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            direct: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            reported_ms: AtomicU64::new(0),
            born: Instant::now(),
        }
    }

    /// Turns it on or off (a volume option changed).
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Whether it is on (and can be: over a Unix socket).
    pub fn is_on(&self) -> bool {
        self.unix && self.on.load(Ordering::Relaxed)
    }

    /// The table of connection `conn`, if one came.
    pub fn table(&self, conn: u64) -> Option<Arc<Table>> {
        let t = self.table.locked();
        t.as_ref()
            .filter(|(c, _)| *c == conn)
            .map(|(_, t)| t.clone())
    }

    /// Keeps the table that came on connection `conn`.
    pub fn set_table(&self, conn: u64, t: Arc<Table>) {
        *self.table.locked() = Some((conn, t));
    }

    /// Counts a direct read; true when it is time to report.
    pub fn count(&self, bytes: usize) -> bool {
        let n = self.reads.fetch_add(1, Ordering::Relaxed);
        self.direct.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        // The clock only every so many reads: a 4 KiB direct read costs about a microsecond.
        if !n.is_multiple_of(64) {
            return false;
        }
        let now = self.born.elapsed().as_millis() as u64;
        now >= self.reported_ms.load(Ordering::Relaxed) + REPORT_EVERY.as_millis() as u64
    }

    /// The reads to report now (and counted as reported).
    pub fn take_report(&self) -> (u64, u64) {
        let now = self.born.elapsed().as_millis() as u64;
        self.reported_ms.store(now, Ordering::Relaxed);
        (
            self.reads.swap(0, Ordering::Relaxed),
            self.bytes.swap(0, Ordering::Relaxed),
        )
    }
}
