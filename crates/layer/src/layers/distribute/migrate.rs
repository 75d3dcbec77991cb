//! Rebalance: finding names that are not where the layout wants them, and moving them there
//! while clients use them.
//!
//! [`Distribute::misplaced`] lists one directory on every subvolume and returns each
//! non-directory whose hashed subvolume is another one (files placed under an older layout,
//! renamed across subvolumes, or on a draining subvolume), and the subdirectories to visit
//! next. No directory is walked before clients may use a new layout: this is the rebalance's
//! own walk, at its own pace.
//!
//! [`Distribute::migrate`] moves one name. A regular file is copied to a temporary name on the
//! destination ([`MOVING_PREFIX`], never listed) under a migration session on the source
//! (`kiln_layer::layers::marks`, module `migrate`): the bricks record the ranges clients
//! change meanwhile, and the mover copies those again, round after round, until little is
//! left. Then it freezes the file on the source (clients' fops there fail with `EMOVED`, and
//! the freeze waits for their changes in flight), copies the rest, the size, owner, mode,
//! times and extended attributes, syncs the copy and renames it over the name on the
//! destination, removes the name on the source and marks the file moved there. A client whose
//! handle then says `EMOVED` reopens the file by its name — found on the destination, its
//! hashed subvolume — and sends the fop again (the graph switch does, in `kiln-client`), so no
//! fop fails and no write is lost: every write either reached the source before the freeze
//! (and was copied) or is sent again to the destination.
//!
//! A symlink or special file is made again on the destination and renamed into place, then
//! removed from the source. A file with several names (hard links) is not moved: its other
//! names may sit on other subvolumes, and changes through them are not seen (it is counted as
//! skipped). A name found on its hashed subvolume as well (left by a mover that died between
//! the rename and the removal) is skipped and logged, never removed blindly.
//!
//! Every copied byte goes through [`Progress::pace`]: counted for the rebalance's report, and
//! slowed to the rate the volume's `rebalance-rate` option sets.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::marks::{self as m, HealReq, RangeSet};
use crate::{Attr, Ctx, Errno, Fd, FopResult, IoBufs, LayerRef, ReadDst, ReadOut, SetAttrs};
use kiln_proto::ops::{
    SETATTR_ATIME, SETATTR_GID, SETATTR_MODE, SETATTR_MTIME, SETATTR_SIZE, SETATTR_UID,
};
use kiln_proto::sync::MutexExt as _;

use super::{is_dir, split, Distribute, ENOENT};

/// Names beginning so are a mover's copies in progress: never listed to clients.
pub const MOVING_PREFIX: &str = ".kiln-moving.";
/// Bytes per read and write of a copy.
const CHUNK: u64 = 1 << 20;
/// A copy in progress not changed for this long (its ctime: no client can set it) was left
/// by a mover that died — a live one writes or changes it chunk after chunk, and renews its
/// session every few seconds: the walk that finds it removes it.
const STALE_COPY: Duration = Duration::from_secs(600);
/// Changed bytes left at which a move cuts over.
const CUTOVER: u64 = 8 << 20;
/// Changed bytes left after every round above which a move gives up for now (a freeze that
/// long would stall clients).
const CUTOVER_MAX: u64 = 64 << 20;
/// Copy rounds of changed ranges before a move cuts over whatever is left.
const ROUNDS: usize = 16;
/// How often a long copy renews its session (its lease is 10 s).
const RENEW: Duration = Duration::from_secs(2);

const ECANCELED: Errno = libc::ECANCELED as Errno;
const EIO: Errno = libc::EIO as Errno;

/// A name that is not on its hashed subvolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misplaced {
    /// Its path.
    pub path: String,
    /// The subvolume it is on.
    pub from: usize,
    /// The subvolume it hashes to.
    pub to: usize,
    /// Its size in bytes.
    pub size: u64,
    /// The name is on its hashed subvolume too (a move cut short between its rename and its
    /// removal): left alone, never removed blindly.
    pub twin: bool,
}

/// A rebalance's counters and pace, shared with whoever reports on it.
#[derive(Default)]
pub struct Progress {
    /// Bytes copied (holes of sparse files included: they are read).
    pub bytes: AtomicU64,
    /// Names moved.
    pub files: AtomicU64,
    /// Names left where they are (hard links, duplicates).
    pub skipped: AtomicU64,
    /// Names that could not be moved (the error is logged).
    pub failed: AtomicU64,
    /// Bytes per second at most; 0: no limit.
    pub rate: AtomicU64,
    /// Set to stop: the move in progress is undone and fails with `ECANCELED`.
    pub stop: AtomicBool,
    /// Since when, and how many bytes, the pace is reckoned.
    paced: Mutex<Option<(Instant, u64, u64)>>,
}

impl Progress {
    /// Counts `n` bytes copied, then waits as long as the rate wants.
    pub async fn pace(&self, n: u64) -> FopResult<()> {
        self.bytes.fetch_add(n, Relaxed);
        if self.stop.load(Relaxed) {
            return Err(ECANCELED);
        }
        let rate = self.rate.load(Relaxed);
        if rate == 0 {
            return Ok(());
        }
        let due = {
            let mut p = self.paced.locked();
            let now = Instant::now();
            let (since, bytes, at) = match *p {
                // Reckoned afresh when the rate changes, or after a pause (no catching up).
                Some((s, b, r)) if r == rate && now.duration_since(s) < Duration::from_secs(60) => {
                    (s, b + n, r)
                }
                _ => (now, n, rate),
            };
            *p = Some((since, bytes, at));
            since + Duration::from_secs_f64(bytes as f64 / rate as f64)
        };
        if due > Instant::now() {
            crate::timer::sleep_until(due).await;
        }
        Ok(())
    }
}

/// Bytes of `todo` below `size`.
fn left(todo: &RangeSet, size: u64) -> u64 {
    todo.iter()
        .map(|(o, l)| {
            let end = if l == m::WHOLE {
                size
            } else {
                (o + l).min(size)
            };
            end.saturating_sub(o)
        })
        .sum()
}

fn session(begin: u32) -> HealReq {
    HealReq { begin }
}

/// `dir/name`, or `name` at the root.
fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// The temporary name of a copy of `path`, in the same directory: unique to this mover (two
/// movers never share one, even of the same file).
fn temp_of(path: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let (dir, name) = split(path);
    let n = NEXT.fetch_add(1, Relaxed);
    let tag = format!(
        "{MOVING_PREFIX}{:08x}.{}.{n}",
        super::name_hash(name),
        std::process::id()
    );
    join(dir, &tag)
}

/// Removes the copy at `path` (attributes `a`) if a mover that died left it.
pub(super) async fn drop_if_stale(kid: &LayerRef, path: &str, a: &Attr) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    if now.saturating_sub(a.ctime.sec) < STALE_COPY.as_secs() as i64 {
        return;
    }
    match kid.unlink(&Ctx::NONE, path).await {
        Ok(()) => tracing::info!(path, "removed a copy a mover left unfinished"),
        Err(e) => tracing::warn!(path, err = e, "a copy a mover left unfinished stays"),
    }
}

/// The distribute layer of a stack, if it has one.
pub fn find(top: &LayerRef) -> Option<LayerRef> {
    if top.as_any().is_some_and(|a| a.is::<Distribute>()) {
        return Some(top.clone());
    }
    top.graph_children().iter().find_map(find)
}

impl Distribute {
    /// The names of its subvolumes, in order.
    pub fn kid_names(&self) -> Vec<String> {
        self.kids.iter().map(|k| k.name().to_owned()).collect()
    }

    /// The names in directory `dir` that are not on their hashed subvolume, and its
    /// subdirectories (see the module documentation).
    pub async fn misplaced(&self, dir: &str) -> FopResult<(Vec<Misplaced>, Vec<String>)> {
        let cx = &Ctx::NONE;
        let mut found = Vec::new();
        let mut subdirs = Vec::new();
        let mut names: Vec<(String, usize, Attr)> = Vec::new();
        for (i, kid) in self.kids.iter().enumerate() {
            let mut off = 0u64;
            loop {
                let r = match kid.readdir(cx, dir, off, 256).await {
                    Ok(r) => r,
                    // A subvolume added since has not got the directory yet.
                    Err(ENOENT) if i > 0 => break,
                    Err(e) => return Err(e),
                };
                off += r.entries.0.len() as u64;
                for e in r.entries.0 {
                    if e.name.starts_with(MOVING_PREFIX) {
                        drop_if_stale(kid, &join(dir, &e.name), &e.attr).await;
                        continue;
                    }
                    if e.name == "." || e.name == ".." {
                        continue;
                    }
                    let path = join(dir, &e.name);
                    if is_dir(&e.attr) {
                        if !subdirs.contains(&path) {
                            subdirs.push(path);
                        }
                    } else {
                        names.push((path, i, e.attr));
                    }
                }
                if r.eof || off == 0 {
                    break;
                }
            }
        }
        for (path, i, a) in &names {
            let h = self.hashed(path)?;
            if h == *i {
                continue;
            }
            let twin = names.iter().any(|(p, j, _)| p == path && *j == h);
            found.push(Misplaced {
                twin,
                path: path.clone(),
                from: *i,
                to: h,
                size: if a.mode & libc::S_IFMT == libc::S_IFREG {
                    a.size
                } else {
                    0
                },
            });
        }
        Ok((found, subdirs))
    }

    /// Moves `m` to its hashed subvolume (see the module documentation). `Ok(false)`: left
    /// where it is on purpose (counted as skipped).
    pub async fn migrate(&self, m: &Misplaced, progress: &Progress) -> FopResult<bool> {
        let cx = &Ctx::NONE;
        if m.twin {
            tracing::warn!(
                path = m.path,
                "on subvolumes {} and {}: left alone (a move cut short?); remove one copy",
                m.from,
                m.to
            );
            return Ok(false);
        }
        let (Some(src), Some(dst)) = (self.kids.get(m.from), self.kids.get(m.to)) else {
            return Err(libc::EINVAL as Errno);
        };
        let a = src.lookup(cx, &m.path).await?;
        if is_dir(&a) {
            return Ok(false);
        }
        if a.nlink > 1 {
            tracing::info!(path = m.path, "has {} names: not moved", a.nlink);
            return Ok(false);
        }
        let parent = split(&m.path).0;
        if !parent.is_empty() {
            self.heal_dir(m.to, parent).await?;
        }
        let temp = temp_of(&m.path);
        match dst.unlink(cx, &temp).await {
            Ok(()) | Err(ENOENT) => {}
            Err(e) => return Err(e),
        }
        let kind = a.mode & libc::S_IFMT;
        if kind == libc::S_IFREG {
            let mut mv = Move {
                src,
                dst,
                path: &m.path,
                temp: &temp,
                sfd: None,
                dfd: None,
                progress,
            };
            let r = mv.run().await;
            mv.close().await;
            if r.is_err() {
                let _ = src
                    .heal_session(cx, &m.path, &session(m::SESSION_END))
                    .await;
                let _ = dst.unlink(cx, &temp).await;
            }
            if r == Err(libc::EBUSY as Errno) {
                // Read past the brick by a local reader (FUSE passthrough) that could not
                // follow it: left for a later rebalance.
                tracing::info!(path = m.path, "open for passthrough reads: not moved now");
                return Ok(false);
            }
            return r.map(|()| true);
        }
        // Frozen like a file (nobody has it open, but its name could change meanwhile).
        let r = async {
            src.heal_session(cx, &m.path, &session(m::SESSION_MIGRATE))
                .await?;
            src.heal_session(cx, &m.path, &session(m::SESSION_FREEZE))
                .await?;
            if kind == libc::S_IFLNK {
                let target = src.readlink(cx, &m.path).await?;
                dst.symlink(cx, &target, &temp).await?;
            } else {
                dst.mknod(cx, &temp, a.mode, a.rdev).await?;
            }
            place(src, dst, &m.path, &temp).await
        }
        .await;
        if r.is_err() {
            let _ = src
                .heal_session(cx, &m.path, &session(m::SESSION_END))
                .await;
            let _ = dst.unlink(cx, &temp).await;
        }
        r.map(|()| true)
    }
}

/// Under the freeze: marks the file moved on `src` (refused if the freeze lapsed or the name
/// changed: nothing is lost, the move fails), renames `temp` to `path` on `dst`, then removes
/// `path` from `src`. Between the mark and the rename a lookup on `src` says `EMOVED`, so
/// clients look again rather than hear that the file does not exist; the name is frozen on
/// `dst` too while the rename reaches each of its replicas, so no client opens it on some of
/// them only. If a client made `path` on `dst` meanwhile (a rename over it, which replaces
/// the file), that one stays.
async fn place(src: &LayerRef, dst: &LayerRef, path: &str, temp: &str) -> FopResult<()> {
    let cx = &Ctx::NONE;
    dst.heal_session(cx, path, &session(m::SESSION_MIGRATE))
        .await?;
    let r = async {
        dst.heal_session(cx, path, &session(m::SESSION_FREEZE))
            .await?;
        src.heal_session(cx, path, &session(m::SESSION_MOVED))
            .await?;
        rename_into_place(dst, path, temp).await
    }
    .await;
    let _ = dst.heal_session(cx, path, &session(m::SESSION_END)).await;
    r?;
    match src.unlink(cx, path).await {
        Ok(()) | Err(ENOENT) => Ok(()),
        Err(e) => {
            tracing::error!(path, "moved, but the old copy cannot be removed: errno {e}");
            Err(e)
        }
    }
}

/// Renames `temp` to `path` on `dst`, unless a client made `path` there meanwhile.
async fn rename_into_place(dst: &LayerRef, path: &str, temp: &str) -> FopResult<()> {
    let cx = &Ctx::NONE;
    let mut tries = 0;
    loop {
        match dst.rename(cx, temp, path, libc::RENAME_NOREPLACE).await {
            Ok(()) => return Ok(()),
            Err(e) if e == libc::EEXIST as Errno => {
                tracing::info!(
                    path,
                    "replaced on its new set while it moved: the move yields"
                );
                let _ = dst.unlink(cx, temp).await;
                return Ok(());
            }
            Err(e) if tries < 3 => {
                tries += 1;
                tracing::warn!(path, "moving into place failed (errno {e}): again");
            }
            Err(e) => {
                tracing::error!(
                    path,
                    "marked moved but not put in place (errno {e}): its copy is {temp} on \
                     the new set, the data still on the old one"
                );
                return Err(e);
            }
        }
    }
}

/// One regular file's move.
struct Move<'a> {
    src: &'a LayerRef,
    dst: &'a LayerRef,
    path: &'a str,
    temp: &'a str,
    sfd: Option<Fd>,
    dfd: Option<Fd>,
    progress: &'a Progress,
}

impl Move<'_> {
    async fn run(&mut self) -> FopResult<()> {
        let cx = &Ctx::NONE;
        let flags = (libc::O_RDWR | libc::O_CREAT | libc::O_EXCL) as u32;
        let (dfd, _) = self.dst.create(cx, self.temp, flags, 0o600).await?;
        self.dfd = Some(dfd);
        self.src
            .heal_session(cx, self.path, &session(m::SESSION_MIGRATE))
            .await?;
        self.sfd = Some(self.src.open(cx, self.path, libc::O_RDONLY as u32).await?);
        let mut todo = RangeSet::default();
        let mut renewed = Instant::now();
        // The first pass: everything, holes left as holes.
        let mut size = self.sync_size().await?;
        self.copy_span((0, size), true, true, &mut todo, &mut renewed)
            .await?;
        // Rounds of what clients changed meanwhile, until little is left.
        for _ in 0..ROUNDS {
            self.changed(&mut todo).await?;
            renewed = Instant::now();
            size = self.sync_size().await?;
            if left(&todo, size) <= CUTOVER {
                break;
            }
            for (o, l) in std::mem::take(&mut todo).iter() {
                let span = (
                    o,
                    if l == m::WHOLE {
                        size
                    } else {
                        (o + l).min(size)
                    },
                );
                self.copy_span(span, false, true, &mut todo, &mut renewed)
                    .await?;
            }
        }
        if left(&todo, size) > CUTOVER_MAX {
            tracing::info!(
                path = self.path,
                "clients change it faster than it copies: left for the next run"
            );
            return Err(libc::EAGAIN as Errno);
        }
        // The cut-over: clients wait (their fops say EMOVED and are sent again). Not paced,
        // and the session renewed, so that the freeze is short and never lapses.
        self.src
            .heal_session(cx, self.path, &session(m::SESSION_FREEZE))
            .await?;
        self.changed(&mut todo).await?;
        size = self.sync_size().await?;
        let fin = self.src.fstat(cx, self.sfd()?).await?;
        if fin.nlink != 1 {
            // Linked since the move began (its other name may be elsewhere), or removed. (A
            // rename over the name or of it fails the freeze itself.)
            return Err(libc::ESTALE as Errno);
        }
        for (o, l) in std::mem::take(&mut todo).iter() {
            let span = (
                o,
                if l == m::WHOLE {
                    size
                } else {
                    (o + l).min(size)
                },
            );
            self.copy_span(span, false, false, &mut todo, &mut renewed)
                .await?;
        }
        self.copy_meta(&fin).await?;
        self.dst.fsync(cx, self.dfd()?, false).await?;
        place(self.src, self.dst, self.path, self.temp).await
    }

    /// Copies `[start, end)` a chunk at a time (paced when `pace`), renewing the session (and
    /// collecting what clients changed into `todo`) every [`RENEW`].
    async fn copy_span(
        &self,
        (start, end): (u64, u64),
        holes: bool,
        pace: bool,
        todo: &mut RangeSet,
        renewed: &mut Instant,
    ) -> FopResult<()> {
        let mut off = start;
        while off < end {
            let len = CHUNK.min(end - off);
            self.copy(off, len, holes, pace).await?;
            off += len;
            if renewed.elapsed() >= RENEW {
                self.changed(todo).await?;
                *renewed = Instant::now();
            }
        }
        Ok(())
    }

    fn sfd(&self) -> FopResult<&Fd> {
        self.sfd.as_ref().ok_or(EIO)
    }

    fn dfd(&self) -> FopResult<&Fd> {
        self.dfd.as_ref().ok_or(EIO)
    }

    /// Releases both handles.
    async fn close(&mut self) {
        let cx = &Ctx::NONE;
        if let Some(fd) = self.sfd.take() {
            let _ = self.src.release(cx, fd).await;
        }
        if let Some(fd) = self.dfd.take() {
            let _ = self.dst.release(cx, fd).await;
        }
    }

    /// Adds the ranges clients changed since the last ask to `todo` (and renews the session).
    async fn changed(&self, todo: &mut RangeSet) -> FopResult<()> {
        let cx = &Ctx::NONE;
        self.src
            .heal_session(cx, self.path, &session(m::SESSION_DIRTY))
            .await?;
        let info = self.src.heal_info(cx, self.path, &()).await?;
        if info.live == 0 {
            return Err(libc::ETIMEDOUT as Errno);
        }
        for r in info.skipped.0 {
            todo.add(r.offset, r.len);
        }
        Ok(())
    }

    /// Makes the copy as long as the source is now; returns that size.
    async fn sync_size(&self) -> FopResult<u64> {
        let cx = &Ctx::NONE;
        let size = self.src.fstat(cx, self.sfd()?).await?.size;
        let set = SetAttrs {
            valid: SETATTR_SIZE,
            size,
            ..SetAttrs::default()
        };
        self.dst.fsetattr(cx, self.dfd()?, &set).await?;
        Ok(size)
    }

    /// Copies `[off, off+len)`; with `holes`, a chunk of zeros is not written (the copy is new
    /// and reads zeros there already).
    async fn copy(&self, off: u64, len: u64, holes: bool, pace: bool) -> FopResult<()> {
        let cx = &Ctx::NONE;
        let out = self
            .src
            .read(cx, self.sfd()?, off, ReadDst::Any(len as u32))
            .await?;
        let buf = match out {
            ReadOut::Buf(b) => b,
            ReadOut::Into { n, bufs } => {
                let mut v = bufs.into_owned::<Vec<u8>>().unwrap_or_default().concat();
                v.truncate(n);
                v
            }
            ReadOut::File {
                file, offset, len, ..
            } => {
                use std::os::unix::fs::FileExt;
                let mut v = vec![0; len];
                let n = file.read_at(&mut v, offset).map_err(|_| EIO)?;
                v.truncate(n);
                v
            }
        };
        let n = buf.len() as u64;
        if n > 0 && !(holes && buf.iter().all(|b| *b == 0)) {
            let w = self
                .dst
                .write(cx, self.dfd()?, off, IoBufs::owned(vec![buf]))
                .await?;
            if w.n as u64 != n {
                return Err(EIO);
            }
        }
        if pace {
            self.progress.pace(len).await
        } else {
            self.progress.bytes.fetch_add(len, Relaxed);
            Ok(())
        }
    }

    /// Owner, mode, times and extended attributes of the source, onto the copy.
    async fn copy_meta(&self, a: &Attr) -> FopResult<()> {
        let cx = &Ctx::NONE;
        for name in self.src.listxattr(cx, self.path).await? {
            if crate::reserved_xattr(&name).is_some() || name.starts_with("trusted.kiln") {
                continue;
            }
            match self.src.getxattr(cx, self.path, &name).await {
                Ok(v) => self.dst.setxattr(cx, self.temp, &name, &v, 0).await?,
                Err(e) if e == libc::ENODATA as Errno => {}
                Err(e) => return Err(e),
            }
        }
        let set = SetAttrs {
            valid: SETATTR_UID | SETATTR_GID | SETATTR_MODE | SETATTR_ATIME | SETATTR_MTIME,
            uid: a.uid,
            gid: a.gid,
            mode: a.mode & 0o7777,
            atime: a.atime.clone(),
            mtime: a.mtime.clone(),
            ..SetAttrs::default()
        };
        self.dst.fsetattr(cx, self.dfd()?, &set).await.map(|_| ())
    }
}
