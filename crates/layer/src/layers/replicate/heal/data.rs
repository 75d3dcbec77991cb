//! Healing a file's data: the marked ranges read from a replica that is not behind and
//! written to the one that is, chunk by chunk under heal locks, inside a heal session.

use crate::exec::join_all;
use crate::marks::{self as m, CondMark, HealInfo, HealReq, LockReq, Mark, RangeSet};
use crate::replicate::Replicate;
use crate::{errno, Ctx, Errno, Fd, FopResult, IoBufs, LayerRef, ReadDst, ReadOut};

use super::entries::heal_flags;
use super::view::View;
use super::*;

/// Brings `path` on replica `target` up to date — its entry, then its bytes, then its
/// attributes; returns the bytes copied.
pub async fn heal_file(r: &Replicate, path: &str, target: usize) -> FopResult<u64> {
    let kids = r.replicas();
    let up: Vec<usize> = (0..kids.len()).filter(|i| kids[*i].up()).collect();
    if !up.contains(&target) {
        return Err(errno::ENOTCONN);
    }
    let first = View::read(kids, &up, path, target).await?;
    if first.flagged[target] & m::ENTRY != 0 {
        heal_flags(kids, &up, path, target, m::ENTRY).await?;
    }
    let moved = heal_data(kids, &up, path, target).await?;
    // A source lost during the copy is left out of the attributes' heal too.
    let up: Vec<usize> = up.into_iter().filter(|i| kids[*i].up()).collect();
    heal_flags(kids, &up, path, target, m::META).await?;
    Ok(moved)
}

/// Leaves out of `up` the replicas (never the target) that went down; true when it left one
/// out and another replica remains to copy from.
fn lose_gone(kids: &[LayerRef], up: &mut Vec<usize>, target: usize) -> bool {
    let before = up.len();
    up.retain(|i| *i == target || kids[*i].up());
    up.len() < before && up.contains(&target) && up.len() >= 2
}

/// Brings the bytes of `path` on replica `target` up to date; returns the bytes copied.
pub(super) async fn heal_data(
    kids: &[LayerRef],
    up: &[usize],
    path: &str,
    target: usize,
) -> FopResult<u64> {
    let cx = &Ctx::NONE;
    let up = up.to_vec();
    let others: Vec<usize> = up.iter().copied().filter(|i| *i != target).collect();
    let first = View::read(kids, &up, path, target).await?;
    if first.holders.is_empty() {
        return Ok(0); // healed meanwhile
    }
    // The file's kind and mode come from a replica that took what the target missed (a
    // member: a new brick is never a source).
    let member = |i: &&usize| !kids[**i].joining();
    let Some(&src) = (first.holders.iter().find(member)).or(others.iter().find(member)) else {
        return Err(ENODATA);
    };
    let clear_all = |offset: u64, len: u64| {
        let v = Mark {
            target: target as u32,
            offset,
            len,
        };
        let others = others.clone();
        async move { on_all(kids, &others, |k| k.mark_clear(&Ctx::NONE, path, &v)).await }
    };
    let attr = match kids[src].lookup(cx, path).await {
        Ok(a) => a,
        Err(errno::ENOENT) => {
            // Gone from the source since: nothing to copy.
            clear_all(0, m::WHOLE).await?;
            return Ok(0);
        }
        Err(e) => return Err(e),
    };
    let is_dir = attr.mode & libc::S_IFMT == libc::S_IFDIR;
    for p in parents(path) {
        match kids[target].mkdir(cx, p, 0o755).await {
            Ok(_) | Err(EEXIST) => {}
            Err(e) => return Err(e),
        }
    }
    if is_dir {
        match kids[target].mkdir(cx, path, attr.mode & 0o7777).await {
            Ok(_) | Err(EEXIST) => {}
            Err(e) => return Err(e),
        }
    }
    if attr.mode & libc::S_IFMT != libc::S_IFREG {
        // Directories, symlinks, FIFOs, sockets and devices hold no bytes to copy (a socket
        // or FIFO must not even be opened); their names are healed with the entries.
        clear_all(0, m::WHOLE).await?;
        return Ok(0);
    }
    if kids[target].lookup(cx, path).await == Err(errno::ENOENT) {
        let (fd, _) = kids[target]
            .create(
                cx,
                path,
                (libc::O_CREAT | libc::O_WRONLY) as u32,
                attr.mode & 0o7777,
            )
            .await?;
        let _ = kids[target].release(cx, fd).await;
    }
    let tfd = kids[target]
        .heal_open(cx, path, libc::O_WRONLY as u32)
        .await?;
    let r = copy_all(kids, up, path, target, first, &tfd).await;
    let _ = kids[target].release(cx, tfd).await;
    r
}

/// The copy itself, in heal passes through the target's heal handle `tfd`. A source that
/// fails mid-copy (its brick died) is left out and the copy goes on from another replica that
/// is current; bytes already copied stay copied (their marks were cleared chunk by chunk).
async fn copy_all(
    kids: &[LayerRef],
    mut up: Vec<usize>,
    path: &str,
    target: usize,
    mut first: View,
    tfd: &Fd,
) -> FopResult<u64> {
    let cx = &Ctx::NONE;
    let mut moved = 0u64;
    loop {
        let others: Vec<usize> = up.iter().copied().filter(|i| *i != target).collect();
        let mut h = Healing {
            kids,
            up: &up,
            others: &others,
            target,
            path,
            tfd,
            sfds: vec![None; kids.len()],
            buf: vec![0u8; CHUNK as usize],
            moved: 0,
        };
        let r = h.passes(first).await;
        moved += h.moved;
        for (i, fd) in h.sfds.into_iter().enumerate() {
            if let Some(fd) = fd {
                let _ = kids[i].release(cx, fd).await;
            }
        }
        match r {
            Err(e) if lose_gone(kids, &mut up, target) => {
                tracing::info!(
                    path,
                    target,
                    "a replica heal was copying from went away (errno {e}); going on from \
                     another"
                );
                first = View::read(kids, &up, path, target).await?;
            }
            Ok(_) => return Ok(moved),
            Err(e) => return Err(e),
        }
    }
}

/// One file being healed on one target.
pub(super) struct Healing<'a> {
    pub(super) kids: &'a [LayerRef],
    pub(super) up: &'a [usize],
    /// Up replicas but the target.
    others: &'a [usize],
    pub(super) target: usize,
    pub(super) path: &'a str,
    /// The target's heal handle.
    pub(super) tfd: &'a Fd,
    /// Sources' handles, opened on first use.
    sfds: Vec<Option<Fd>>,
    buf: Vec<u8>,
    /// Bytes copied so far (kept when a pass fails part way).
    moved: u64,
}

impl Healing<'_> {
    /// Begins (`begin`) or ends the heal session on the target; true when beginning waited
    /// for another heal's session there (see [`super::begin_session`]).
    pub(super) async fn session(&self, begin: bool) -> FopResult<bool> {
        let t = &self.kids[self.target];
        if begin {
            return super::begin_session(t, self.path).await;
        }
        let end = HealReq {
            begin: m::SESSION_END,
        };
        t.heal_session(&Ctx::NONE, self.path, &end)
            .await
            .map(|_| false)
    }

    pub(super) async fn info(&self) -> FopResult<HealInfo> {
        self.kids[self.target]
            .heal_info(&Ctx::NONE, self.path, &())
            .await
    }

    /// Passes until the target has no marks left, each in a session of its own.
    pub(super) async fn passes(&mut self, mut view: View) -> FopResult<u64> {
        let mut moved = 0;
        for _ in 0..PASSES {
            // The generations are read before the session begins: a miss recorded after it
            // changes them.
            let mut gens = view.gens.clone();
            if self.session(true).await? {
                // Another heal had the file: see what it left (its marks cleared, new ones
                // since), then the same pass on that, in the session begun now.
                let _ = self.session(false).await;
                view = View::read(self.kids, self.up, self.path, self.target).await?;
                if view.need.is_empty() {
                    return Ok(moved);
                }
                gens = view.gens.clone();
                self.session(true).await?;
            }
            let step = self.pass(&gens).await;
            let _ = self.session(false).await;
            let (n, no_source) = step?;
            moved += n;
            view = View::read(self.kids, self.up, self.path, self.target).await?;
            if view.need.is_empty() {
                return Ok(moved);
            }
            if no_source {
                return Err(ENODATA);
            }
        }
        tracing::warn!(
            path = self.path,
            target = self.target,
            "still marked after {PASSES} heal passes (clients keep changing it and the \
             target keeps missing some): left for the next run"
        );
        Err(EAGAIN)
    }

    /// One pass: copies every marked range once; returns the bytes written and whether some
    /// range had no current source.
    pub(super) async fn pass(&mut self, gens: &[Option<u64>]) -> FopResult<(u64, bool)> {
        let info = self.info().await?;
        if info.live == 0 {
            return Err(ETIMEDOUT);
        }
        if info.busy == 1 {
            sleep(GRACE).await;
        }
        let mut moved = 0u64;
        let mut tried = RangeSet::default();
        let mut no_source = false;
        // Where the source has holes, as last read: a hint, read again each pass.
        let mut hint = None;
        for _ in 0..ROUNDS {
            let view = View::read(self.kids, self.up, self.path, self.target).await?;
            let mut todo = view.need.clone();
            for (o, l) in tried.iter() {
                todo.remove(o, l);
            }
            if todo.is_empty() {
                break;
            }
            let todo: Vec<(u64, u64)> = todo.iter().collect();
            for (offset, len) in todo {
                let whole = len == m::WHOLE;
                let end = if whole { u64::MAX } else { offset + len };
                tried.add(offset, len);
                let mut pos = offset;
                while pos < end {
                    let n = (end - pos).min(CHUNK);
                    // A range to the end of the file is locked to the end: its last chunk also
                    // sets the size.
                    let lock_len = if whole { m::WHOLE } else { n };
                    let Some(src) = self.source(&view, pos, lock_len) else {
                        tracing::warn!(
                            path = self.path,
                            target = self.target,
                            offset = pos,
                            "no replica that is up is current for this range: left marked"
                        );
                        no_source = true;
                        if whole {
                            break;
                        }
                        pos += n;
                        continue;
                    };
                    // A hole on the source and the target: cleared, not copied.
                    let hole = self.hole_ahead(&mut hint, src, pos, end).await;
                    if hole > 0 && self.source(&view, pos, hole) == Some(src) {
                        let skipped = self.skip_hole(src, gens, pos, hole, whole).await?;
                        if skipped > 0 {
                            pos += skipped;
                            continue;
                        }
                    }
                    let (got, last) = self.chunk(src, gens, pos, n, whole).await?;
                    moved += got;
                    self.moved += got;
                    if last {
                        break;
                    }
                    pos += n;
                }
            }
        }
        Ok((moved, no_source))
    }

    /// An up replica, not the target, that no up replica marks as behind for the range;
    /// replicas holding marks for the target first.
    pub(super) fn source(&self, view: &View, pos: u64, len: u64) -> Option<usize> {
        let rest = self.others.iter().filter(|i| !view.holders.contains(i));
        view.holders
            .iter()
            .chain(rest)
            .copied()
            .find(|i| !view.behind[*i].overlaps(pos, len) && !self.kids[*i].joining())
    }

    pub(super) async fn source_fd(&mut self, src: usize) -> FopResult<Fd> {
        if let Some(fd) = &self.sfds[src] {
            return Ok(fd.clone());
        }
        let fd = self.kids[src]
            .open(&Ctx::NONE, self.path, libc::O_RDONLY as u32)
            .await?;
        self.sfds[src] = Some(fd.clone());
        Ok(fd)
    }

    /// Copies one chunk under the lock and clears what the target has now; returns the bytes
    /// written and whether the source ended there.
    pub(super) async fn chunk(
        &mut self,
        src: usize,
        gens: &[Option<u64>],
        pos: u64,
        n: u64,
        whole: bool,
    ) -> FopResult<(u64, bool)> {
        let (kids, path, target) = (self.kids, self.path, self.target);
        let sfd = self.source_fd(src).await?;
        let lock_len = if whole { m::WHOLE } else { n };
        let lock = |on: u32| LockReq {
            offset: pos,
            len: lock_len,
            lock: on,
        };
        let (take, drop) = (lock(1), lock(0));
        let t0 = std::time::Instant::now();
        on_all(kids, self.up, |k| k.heal_lock(&Ctx::NONE, path, &take)).await?;
        let step = copy_chunk(
            kids,
            src,
            target,
            &sfd,
            self.tfd,
            pos,
            n,
            whole,
            &mut self.buf,
        )
        .await;
        let cleared = match &step {
            Ok((got, wrote, last)) => {
                let clear_len = if *last && whole { m::WHOLE } else { n };
                // The bytes a client wrote on the target since the session began: heal's
                // write skipped them (it says so by coming back short).
                let skipped = if wrote < got {
                    self.info().await.map(|i| {
                        let mut r = RangeSet::default();
                        for s in i.skipped.0 {
                            r.add(s.offset, s.len);
                        }
                        r
                    })
                } else {
                    Ok(RangeSet::default())
                };
                match skipped {
                    Ok(skipped) => self.clear(gens, &skipped, pos, clear_len).await,
                    Err(e) => Err(e),
                }
            }
            // Nothing cleared: the chunk stays marked (after a refused size change — a client
            // wrote past it — the next pass copies it again).
            Err(_) => Ok(()),
        };
        let _ = on_all(kids, self.up, |k| k.heal_lock(&Ctx::NONE, path, &drop)).await;
        rest(t0.elapsed()).await;
        cleared?;
        match step {
            Ok((_, wrote, last)) => Ok((wrote, last)),
            Err(EAGAIN) => Ok((0, true)),
            Err(e) => Err(e),
        }
    }

    /// Clears the target's marks on `[pos, pos+len)`: the parts heal wrote outright, and the
    /// parts it skipped unless a holder recorded a new miss for the target since `gens`.
    pub(super) async fn clear(
        &self,
        gens: &[Option<u64>],
        skipped: &RangeSet,
        pos: u64,
        len: u64,
    ) -> FopResult<()> {
        let t = self.target as u32;
        let plain: Vec<Mark> = skipped
            .outside(pos, len)
            .into_iter()
            .map(|(offset, len)| Mark {
                target: t,
                offset,
                len,
            })
            .collect();
        let mut cond = Vec::new();
        for (offset, len) in skipped.inside(pos, len) {
            for i in self.others {
                // A replica whose generation was not read keeps its mark.
                if let Some(gen) = gens[*i] {
                    let v = CondMark {
                        target: t,
                        offset,
                        len,
                        gen,
                    };
                    cond.push((*i, v));
                }
            }
        }
        let mut futs = Vec::new();
        for v in &plain {
            for i in self.others {
                futs.push(Some(self.kids[*i].mark_clear(&Ctx::NONE, self.path, v)));
            }
        }
        for (i, v) in &cond {
            futs.push(Some(self.kids[*i].mark_clear_if(&Ctx::NONE, self.path, v)));
        }
        for r in join_all(futs).await.into_iter().flatten() {
            match r {
                // A conditional clear refused: a new miss; the range stays marked.
                Ok(()) | Err(EAGAIN) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Copies `[pos, pos+n)` from the source to the target; returns the bytes read, the bytes the
/// target wrote (fewer when it skipped bytes a client wrote since the session began) and
/// whether the source ended there (then, for a range to the end of the file, the target's
/// size is set to the source's).
#[allow(clippy::too_many_arguments)]
pub(super) async fn copy_chunk(
    kids: &[LayerRef],
    src: usize,
    target: usize,
    sfd: &Fd,
    tfd: &Fd,
    pos: u64,
    n: u64,
    whole: bool,
    buf: &mut Vec<u8>,
) -> Result<(u64, u64, bool), Errno> {
    let cx = &Ctx::NONE;
    let taken = std::mem::take(buf);
    let out = kids[src]
        .read(cx, sfd, pos, ReadDst::Into(IoBufs::owned(vec![taken])))
        .await;
    let (got, mut data) = match out {
        Ok(ReadOut::Into { n: got, bufs }) => {
            (got, bufs.into_owned::<Vec<u8>>().unwrap_or_default())
        }
        Ok(_) => return Err(errno::EIO),
        Err(e) => {
            *buf = vec![0u8; CHUNK as usize];
            return Err(e);
        }
    };
    let mut chunk = data.pop().unwrap_or_default();
    let want = n.min(chunk.len() as u64) as usize;
    let got = got.min(want);
    let mut wrote = 0;
    if got > 0 {
        // Only the bytes read go out; the buffer's tail is not part of the file.
        let keep_len = chunk.len();
        chunk.truncate(got);
        let w = kids[target]
            .write(cx, tfd, pos, IoBufs::owned(vec![chunk]))
            .await?;
        let mut back = w.bufs.into_owned::<Vec<u8>>().unwrap_or_default();
        let mut b = back.pop().unwrap_or_default();
        b.resize(keep_len, 0);
        *buf = b;
        if w.n > got {
            return Err(errno::EIO);
        }
        wrote = w.n;
    } else {
        *buf = chunk;
    }
    if buf.len() < CHUNK as usize {
        buf.resize(CHUNK as usize, 0);
    }
    let last = (got as u64) < n;
    if whole && last {
        let size = crate::SetAttrs {
            valid: kiln_proto::ops::SETATTR_SIZE,
            size: pos + got as u64,
            ..Default::default()
        };
        kids[target].fsetattr(cx, tfd, &size).await?;
    }
    Ok((got as u64, wrote as u64, last))
}
