//! An open sharded file: its base handle, the pieces opened so far, and its size as this
//! handle knows it; making, growing and cutting pieces.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{inner, piece_path, Mark, Shard, EEXIST, ENOENT, SHARD_DIR};
use crate::exec::join_all;
use crate::{Attr, Ctx, Fd, FopResult, Fut, SetAttrs};
use kiln_proto::sync::MutexExt as _;

/// How long a handle trusts that a piece it did not find is still a hole (another client may
/// write it meanwhile).
const ABSENT_FOR: Duration = Duration::from_secs(1);
/// Pieces removed at once.
const CUT_BATCH: usize = 32;
/// Pieces past a size this handle did not set that a growth clears first.
const GROW_CUT: u64 = 64;
/// Piece handles a file's handle keeps open; past this, the least recently used that no fop
/// holds are closed (a quarter at a time), so a 1 TiB image costs the bricks a bounded number
/// of open files.
const OPEN_MAX: usize = 256;

/// Flags of the base's open that its pieces are opened with too.
const KEPT_FLAGS: u32 = (libc::O_DIRECT | libc::O_SYNC | libc::O_DSYNC) as u32;

/// This layer's handle.
pub(super) enum ShardFd {
    /// A file kept whole: the handle below.
    Plain(Fd),
    /// A sharded file.
    Split(Arc<Pieces>),
}

impl ShardFd {
    pub(super) fn wrap(base: Fd, mark: Option<Mark>, flags: u32) -> Fd {
        Fd::new(match mark {
            None => ShardFd::Plain(base),
            Some(mark) => ShardFd::Split(Arc::new(Pieces {
                base,
                mark,
                flags: libc::O_RDWR as u32 | (flags & KEPT_FLAGS),
                open: Mutex::new(Slots::default()),
                known: AtomicU64::new(0),
                want: AtomicU64::new(0),
                set: AtomicU64::new(u64::MAX),
                growing: tokio::sync::Mutex::new(()),
                sync_failed: std::sync::atomic::AtomicBool::new(false),
                writable: flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32,
            })),
        })
    }

    /// The handle of the base (the whole file, when it is kept whole).
    pub(super) fn base(&self) -> &Fd {
        match self {
            ShardFd::Plain(f) => f,
            ShardFd::Split(p) => &p.base,
        }
    }
}

enum Slot {
    /// Open; last used at tick `used`.
    Open(Fd, u64),
    Absent(Instant),
}

impl Slot {
    fn fd(&self) -> Option<Fd> {
        match self {
            Slot::Open(fd, _) => Some(fd.clone()),
            Slot::Absent(_) => None,
        }
    }
}

/// The open pieces of a file's handle, with a clock for their use.
#[derive(Default)]
struct Slots {
    map: HashMap<u64, Slot>,
    tick: u64,
    open: usize,
}

impl Slots {
    /// Piece `k`'s handle, marked used now.
    fn get(&mut self, k: u64) -> Option<&Slot> {
        self.tick += 1;
        let now = self.tick;
        if let Some(Slot::Open(_, used)) = self.map.get_mut(&k) {
            *used = now;
        }
        self.map.get(&k)
    }

    fn insert(&mut self, k: u64, s: Slot) {
        self.open += usize::from(matches!(s, Slot::Open(..)));
        if let Some(Slot::Open(..)) = self.map.insert(k, s) {
            self.open -= 1;
        }
    }

    fn remove(&mut self, k: u64) -> Option<Fd> {
        match self.map.remove(&k) {
            Some(Slot::Open(fd, _)) => {
                self.open -= 1;
                Some(fd)
            }
            _ => None,
        }
    }

    /// Past [`OPEN_MAX`]: the least recently used quarter of the handles no fop holds, taken
    /// out to be closed.
    fn over(&mut self) -> Vec<Fd> {
        if self.open <= OPEN_MAX {
            return Vec::new();
        }
        let mut idle: Vec<(u64, u64)> = self
            .map
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Open(fd, used) if fd.holders() == 1 => Some((*used, *k)),
                _ => None,
            })
            .collect();
        idle.sort_unstable();
        idle.truncate(OPEN_MAX / 4);
        idle.into_iter()
            .filter_map(|(_, k)| self.remove(k))
            .collect()
    }
}

/// An open sharded file.
pub(super) struct Pieces {
    pub(super) base: Fd,
    pub(super) mark: Mark,
    /// What pieces are opened with.
    flags: u32,
    open: Mutex<Slots>,
    /// A size the file is known to have (it may be larger).
    pub(super) known: AtomicU64,
    /// The largest end any write of this handle waits to have the file grown to.
    want: AtomicU64,
    /// The size this handle last gave the file; `u64::MAX` before it has.
    set: AtomicU64,
    /// Held while the base's size is changed.
    growing: tokio::sync::Mutex<()>,
    /// A piece closed for room could not be synced: the next fsync says so.
    sync_failed: std::sync::atomic::AtomicBool,
    /// Opened for writing.
    pub(super) writable: bool,
}

impl Pieces {
    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.open.locked()
    }

    /// How many piece handles are open.
    #[cfg(test)]
    pub(super) fn open_pieces(&self) -> usize {
        self.slots().open
    }

    /// Forgets (and hands back, to be released) the open pieces from `first` on.
    fn forget_from(&self, first: u64) -> Vec<Fd> {
        let mut m = self.slots();
        let gone: Vec<u64> = m.map.keys().copied().filter(|k| *k >= first).collect();
        gone.into_iter().filter_map(|k| m.remove(k)).collect()
    }
}

fn size_attrs(size: u64) -> SetAttrs {
    SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size,
        ..SetAttrs::default()
    }
}

impl Shard {
    /// Piece `k` (≥ 1) of `p`, opened; made first with `make`, else None while it is a hole.
    pub(super) async fn piece(
        &self,
        cx: &Ctx,
        p: &Pieces,
        k: u64,
        make: bool,
    ) -> FopResult<Option<Fd>> {
        match p.slots().get(k) {
            Some(Slot::Open(fd, _)) => return Ok(Some(fd.clone())),
            Some(Slot::Absent(t)) if !make && t.elapsed() < ABSENT_FOR => return Ok(None),
            _ => {}
        }
        let cx = inner(cx);
        let path = piece_path(&p.mark.id, k);
        let fd = if make {
            self.make_piece(&cx, &path, p.flags).await?
        } else {
            match self.kid().open(&cx, &path, p.flags).await {
                Ok(fd) => fd,
                Err(ENOENT) => {
                    let mut m = p.slots();
                    // A write of this handle may have made it meanwhile.
                    if let Some(fd) = m.get(k).and_then(Slot::fd) {
                        return Ok(Some(fd));
                    }
                    m.insert(k, Slot::Absent(Instant::now()));
                    return Ok(None);
                }
                Err(e) => return Err(e),
            }
        };
        // Another fop of this handle may have opened it meanwhile: keep one.
        let (kept, closing) = {
            let mut m = p.slots();
            match m.get(k).and_then(Slot::fd) {
                Some(kept) => (Some(kept), Vec::new()),
                None => {
                    let tick = m.tick;
                    m.insert(k, Slot::Open(fd.clone(), tick));
                    (None, m.over())
                }
            }
        };
        for old in closing {
            // fsync later reaches only the pieces still open: these are synced now.
            if let Err(e) = self.kid().fsync(&cx, &old, false).await {
                tracing::warn!(
                    id = p.mark.id,
                    err = e,
                    "a piece closed for room failed to sync"
                );
                p.sync_failed.store(true, Relaxed);
            }
            let _ = self.kid().release(&cx, old).await;
        }
        Ok(Some(match kept {
            Some(kept) => {
                let _ = self.kid().release(&cx, fd).await;
                kept
            }
            None => fd,
        }))
    }

    /// Opens the piece at `path`, making it (and the shard directory) if it is not there.
    async fn make_piece(&self, cx: &Ctx, path: &str, flags: u32) -> FopResult<Fd> {
        let create = flags | libc::O_CREAT as u32;
        for _ in 0..2 {
            if !self.dir_made.load(Relaxed) {
                match self.kid().mkdir(cx, SHARD_DIR, 0o700).await {
                    Ok(_) | Err(EEXIST) => self.dir_made.store(true, Relaxed),
                    Err(e) => return Err(e),
                }
            }
            match self.kid().create(cx, path, create, 0o600).await {
                Ok((fd, _)) => return Ok(fd),
                // The directory went away (a volume emptied by hand): make it again once.
                Err(ENOENT) => self.dir_made.store(false, Relaxed),
                Err(e) => return Err(e),
            }
        }
        Err(ENOENT)
    }

    pub(super) async fn release_pieces(&self, cx: &Ctx, p: &Pieces) -> FopResult<()> {
        let pieces = p.forget_from(1);
        let icx = inner(cx);
        let futs: Vec<Option<Fut<'_, ()>>> = pieces
            .into_iter()
            .map(|fd| Some(self.kid().release(&icx, fd)))
            .collect();
        join_all(futs).await;
        self.kid().release(cx, p.base.clone()).await
    }

    pub(super) async fn sync_pieces(&self, cx: &Ctx, p: &Pieces, datasync: bool) -> FopResult<()> {
        let open: Vec<Fd> = p.slots().map.values().filter_map(Slot::fd).collect();
        let icx = inner(cx);
        let mut futs: Vec<Option<Fut<'_, ()>>> = open
            .iter()
            .map(|fd| Some(self.kid().fsync(&icx, fd, datasync)))
            .collect();
        futs.push(Some(self.kid().fsync(cx, &p.base, datasync)));
        for r in join_all(futs).await.into_iter().flatten() {
            r?;
        }
        if p.sync_failed.swap(false, Relaxed) {
            return Err(crate::errno::EIO);
        }
        Ok(())
    }

    /// The file's size now, asked of the base.
    pub(super) async fn size(&self, cx: &Ctx, p: &Pieces) -> FopResult<u64> {
        let size = self.kid().fstat(cx, &p.base).await?.size;
        p.known.store(size, Relaxed);
        Ok(size)
    }

    /// Grows the file to at least `end` before a write there: the writes waiting meanwhile
    /// share one change of the base's size.
    pub(super) async fn grow(&self, cx: &Ctx, p: &Pieces, end: u64) -> FopResult<()> {
        if end <= p.known.load(Relaxed) {
            return Ok(());
        }
        p.want.fetch_max(end, Relaxed);
        let _g = p.growing.lock().await;
        if end <= p.known.load(Relaxed) {
            return Ok(());
        }
        // A truncate meanwhile resets `want`: this write's end still counts.
        let target = p.want.load(Relaxed).max(end);
        let set = p.set.load(Relaxed);
        let now = match set {
            u64::MAX => self.size(cx, p).await?,
            s => s,
        };
        if now < target {
            if set != now {
                // A size this handle did not set: pieces just past it may hold bytes a crash
                // left (between a truncate's change of the base and its cut).
                let reach = now.saturating_add(GROW_CUT * p.mark.block);
                self.cut(cx, Some(p), &p.mark, now, target.min(reach))
                    .await?;
            }
            self.kid()
                .fsetattr(cx, &p.base, &size_attrs(target))
                .await?;
            p.set.store(target, Relaxed);
        }
        p.known.store(now.max(target), Relaxed);
        Ok(())
    }

    /// Truncates an open sharded file (fsetattr with a size): the base first, then the
    /// pieces past the new end.
    pub(super) async fn truncate(&self, cx: &Ctx, p: &Pieces, attrs: &SetAttrs) -> FopResult<Attr> {
        let _g = p.growing.lock().await;
        let old = self.size(cx, p).await?;
        let a = self.kid().fsetattr(cx, &p.base, attrs).await?;
        p.set.store(attrs.size, Relaxed);
        p.known.store(attrs.size, Relaxed);
        p.want.store(attrs.size, Relaxed);
        if attrs.size < old {
            self.cut(cx, Some(p), &p.mark, attrs.size, old).await?;
        }
        Ok(a)
    }

    /// Makes bytes `[from, to)` of the file with `mark` holes in its pieces: removes the
    /// pieces wholly inside, cuts the one `from` falls in (piece 0 is the base's business).
    pub(super) async fn cut(
        &self,
        cx: &Ctx,
        p: Option<&Pieces>,
        mark: &Mark,
        from: u64,
        to: u64,
    ) -> FopResult<()> {
        if to <= from {
            return Ok(());
        }
        let b = mark.block;
        let icx = inner(cx);
        let first_whole = from.div_ceil(b).max(1);
        if let Some(p) = p {
            for fd in p.forget_from(first_whole) {
                let _ = self.kid().release(&icx, fd).await;
            }
        }
        if !from.is_multiple_of(b) && from / b >= 1 {
            let path = piece_path(&mark.id, from / b);
            match self.kid().setattr(&icx, &path, &size_attrs(from % b)).await {
                Ok(_) | Err(ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
        let last = (to - 1) / b;
        let mut k = first_whole;
        while k <= last {
            let batch: Vec<String> = (k..=last.min(k + CUT_BATCH as u64 - 1))
                .map(|k| piece_path(&mark.id, k))
                .collect();
            k += batch.len() as u64;
            let futs: Vec<Option<Fut<'_, ()>>> = batch
                .iter()
                .map(|path| Some(self.kid().unlink(&icx, path)))
                .collect();
            for r in join_all(futs).await.into_iter().flatten() {
                match r {
                    Ok(()) | Err(ENOENT) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}
