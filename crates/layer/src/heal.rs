//! Heal: copy to a replica exactly the ranges it missed, while I/O continues.
//!
//! The bricks that took a change another replica missed hold marks naming it
//! ([`crate::marks`]). Heal reads every replica's index, and for each (file, replica behind —
//! the *target*): makes sure the file exists there (creating parent directories), then, chunk
//! by chunk (at most [`CHUNK`] bytes), takes a heal lock on the chunk on every replica that is
//! up, reads it from an up-to-date replica (the *source*), writes it to the target, clears that
//! chunk's marks and drops the lock. The lock keeps client writes to the chunk out of the copy
//! on every replica; clearing under the lock means a miss recorded after the copy is never
//! cleared by it.
//!
//! **Writes that straddle the copy.** A client write goes to every replica at once, and the
//! copies do not arrive together: one can reach the target before the chunk's lock and the
//! source only after heal read the chunk (the source's copy waited on the lock, or was simply
//! slower). Copying the source's older bytes over it would lose an acknowledged write on the
//! target. So each pass over a file runs in a *heal session* on the target
//! ([`crate::marks`]): heal begins it before it looks at the file's marks; from then on the
//! target records the ranges that clients change (and those they were changing as it began),
//! and heal's writes — through a handle opened with [`crate::marks::HEAL_OPEN`] — take only the
//! bytes no client changed since: the target's bytes there are the newer ones. Ordering at the
//! target is exact: a client write and a heal write to the same bytes are registered under one
//! mutex, a client write is recorded the moment it is let through, and once heal's lock has
//! lapsed a client write waits for an overlapping heal write rather than run beside it.
//!
//! A skipped range is cleared like the rest, but conditionally (`kiln.pending.clear.if`): only
//! if no holder recorded a new miss for the target since heal read the marks, before the
//! session began. Skipping is right because the target holds the client's newer bytes; a later
//! write the target missed (its connection broke, or it failed there) leaves a new mark, and
//! then the range stays marked and the next pass (a new session) copies it. A heal size change
//! that would cut bytes a client wrote since the session began is refused and the chunk stays
//! marked too. A pass ends the session; a file takes at most [`PASSES`] passes per run.
//!
//! Before the first copy of a pass heal waits [`GRACE`] when clients had the file open on the
//! target as the session began. The one case the session cannot see is a write that reached
//! the target *before* the session began and reaches the source only after heal read the chunk:
//! with the grace, that needs one replica's copy of a write to lag the other's by more than
//! [`GRACE`] plus heal's round trips, while that brick answers heal — not seen in the seeded
//! heal-while-writing runs (see `crates/server/tests/replicate_heal.rs`).
//!
//! **Choosing the source.** A source is an up replica, not the target, that no up replica
//! marks as behind for the chunk (up replicas that hold marks for the target are tried
//! first). A client write that reached the target but failed on a replica leaves
//! marks against that replica, and heal then copies from another one; if no replica that is up
//! is current for a chunk, heal leaves it marked and says so (`ENODATA`): with two replicas
//! each missing part of the same range and the third down, which bytes are newer is not known.
//!
//! **Names and attributes.** A name flagged [`crate::marks::ENTRY`] for the target is healed
//! first, then the file's bytes, then a [`crate::marks::META`] flag. Under a heal lock on the
//! name on every up replica (the bricks hold client changes of that name, and of its
//! attributes, until it goes), heal looks the name up on a source — an up replica, not the
//! target, itself flagged for none of what is healed (holders first) — and on the target:
//! gone on the source, it is removed on the target (a directory with all it holds); of another
//! type (or a symlink to elsewhere), it is removed and made anew; missing, it is made (a
//! directory with its mode, a symlink with its target, a file empty). A directory's contents
//! are then flagged `ENTRY` on the source, name by name (the source's names, and the
//! target's too when both had the directory), and healed like any flagged name, in path
//! order in the same run; a file's bytes are all marked for copying, in the same step that
//! clears its flag. Then mode, owner, times and `user.` xattrs are copied. **The rule for
//! removing:** a name is removed from the target only when it is flagged for the target and
//! the source is not flagged behind for it; a name that reached only the target (a create
//! the source missed) carries a flag against the source on the target, so that source is
//! refused, and with no current source the name is left flagged (`ENODATA`). Nothing is
//! removed because a listing lacks it. Flags are cleared conditionally
//! (`kiln.pending.flag.clear.if`) against the generations read before the lock: a flag
//! marked again meanwhile stays, and the next pass heals it again.
//!
//! Heal must run on connections of its own (a [`crate::replicate::Replicate`] built for it),
//! not those of a client that also writes: locks and sessions belong to a connection, and a
//! connection's own writes pass its locks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use kiln_proto::Wire;

use crate::exec::join_all;
use crate::marks::{
    self as m, CondFlag, CondMark, FlagMark, HealInfo, HealReq, IndexPage, LockReq, Mark,
    PendingPage, RangeSet,
};
use crate::replicate::Replicate;
use crate::{errno, Ctx, Errno, Fd, FopResult, IoBufs, LayerRef, ReadDst, ReadOut};

/// File exists.
const EEXIST: Errno = 17;
/// Try again: the file is still marked after [`PASSES`] passes, or a heal size change was
/// refused.
const EAGAIN: Errno = 11;
/// No data: no replica that is up is current for part of what the target needs.
const ENODATA: Errno = 61;
/// Timed out: the session on the target lapsed (heal stalled for a lease).
const ETIMEDOUT: Errno = 110;

/// Most bytes copied under one lock.
pub const CHUNK: u64 = 1 << 20;

/// How long heal waits, after it began a session on a file that clients have open on the
/// target, before it copies: see the module documentation.
pub const GRACE: Duration = Duration::from_millis(100);

/// Most passes (sessions) over one file in one run.
pub const PASSES: usize = 8;

/// Most looks at a file's marks within one pass (each copies what is new since the last).
const ROUNDS: usize = 64;

/// One file a replica needs healed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Need {
    /// The replicate layer's name.
    pub set: String,
    /// The file.
    pub path: String,
    /// The replica behind (its index in the set) and its layer name.
    pub target: usize,
    /// Its layer name.
    pub target_name: String,
    /// Marked ranges.
    pub ranges: u64,
    /// Marked bytes (a range "to the end of the file" counts as unknown: u64::MAX).
    pub bytes: u64,
    /// False while the replica behind is down (nothing can be healed yet).
    pub target_up: bool,
    /// The replica missed a change of this name (created, removed, renamed from or to).
    pub entry: bool,
    /// The replica missed a change of this path's attributes or xattrs.
    pub metadata: bool,
}

/// What a heal run did.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Report {
    /// Files brought up to date.
    pub files: u64,
    /// Bytes copied to replicas that were behind.
    pub bytes: u64,
    /// Files left for later (their replica is down, or an error).
    pub left: u64,
    /// Errors, as text.
    pub errors: Vec<String>,
}

/// Every replicate layer in a stack.
pub fn replicate_layers(top: &LayerRef) -> Vec<LayerRef> {
    fn walk(l: &LayerRef, out: &mut Vec<LayerRef>) {
        if l.as_any().is_some_and(|a| a.is::<Replicate>()) {
            out.push(l.clone());
            return;
        }
        for c in l.children() {
            walk(c, out);
        }
    }
    let mut out = Vec::new();
    walk(top, &mut out);
    out
}

fn rep(l: &LayerRef) -> &Replicate {
    l.as_any()
        .and_then(|a| a.downcast_ref::<Replicate>())
        .expect("replicate_layers returns replicate layers")
}

/// What needs healing in every replicate layer of a stack.
pub async fn info(top: &LayerRef) -> Vec<Need> {
    let mut out = Vec::new();
    for l in replicate_layers(top) {
        out.extend(needs(rep(&l)).await);
    }
    out
}

/// The first page of one replica set's index, merged over its replicas that are up.
async fn needs(r: &Replicate) -> Vec<Need> {
    let kids = r.replicas();
    let futs = kids
        .iter()
        .map(|k| k.up().then(|| k.getxattr(&Ctx::NONE, "", m::INDEX)))
        .collect();
    let mut by: std::collections::BTreeMap<(String, u32), (u64, u64, u32)> = Default::default();
    for v in join_all(futs).await.into_iter().flatten().flatten() {
        let Ok(page) = IndexPage::from_wire(&v) else {
            tracing::warn!("a brick sent an index page that does not decode");
            continue;
        };
        for e in page.entries.0 {
            let slot = by.entry((e.path, e.target)).or_default();
            slot.0 = slot.0.max(e.ranges);
            slot.1 = slot.1.max(e.bytes);
            slot.2 |= e.flags;
        }
    }
    by.into_iter()
        .filter(|((_, t), _)| (*t as usize) < kids.len())
        .map(|((path, t), (ranges, bytes, flags))| Need {
            set: crate::Layer::name(r).to_owned(),
            path,
            target: t as usize,
            target_name: kids[t as usize].name().to_owned(),
            ranges,
            bytes,
            target_up: kids[t as usize].up(),
            entry: flags & m::ENTRY != 0,
            metadata: flags & m::META != 0,
        })
        .collect()
}

/// Heals every replicate layer of a stack once over; `progress` hears of each file done.
pub async fn run(top: &LayerRef, progress: &(dyn Fn(&Need, u64) + Sync)) -> Report {
    let mut report = Report::default();
    for l in replicate_layers(top) {
        let r = rep(&l);
        // Pages: what is healed is cleared, so the next look shows the rest.
        let mut seen = std::collections::HashSet::new();
        loop {
            let list = needs(r).await;
            let fresh: Vec<Need> = list
                .into_iter()
                .filter(|n| seen.insert((n.path.clone(), n.target)))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for need in fresh {
                if !need.target_up {
                    report.left += 1;
                    continue;
                }
                match heal_file(r, &need.path, need.target).await {
                    Ok(bytes) => {
                        report.files += 1;
                        report.bytes += bytes;
                        progress(&need, bytes);
                    }
                    Err(e) => {
                        report.left += 1;
                        report.errors.push(format!(
                            "{}: {} on {}: errno {e}",
                            need.set, need.path, need.target_name
                        ));
                    }
                }
            }
        }
    }
    report
}

/// Parent directories of `path`, outermost first.
fn parents(path: &str) -> Vec<&str> {
    path.match_indices('/').map(|(i, _)| &path[..i]).collect()
}

/// Calls setxattr `name` with `value` on every replica in `on`; fails if any fails.
async fn on_all(
    kids: &[LayerRef],
    on: &[usize],
    path: &str,
    name: &str,
    value: &[u8],
) -> FopResult<()> {
    let futs = on
        .iter()
        .map(|i| Some(kids[*i].setxattr(&Ctx::NONE, path, name, value, 0)))
        .collect();
    for r in join_all(futs).await.into_iter().flatten() {
        r?;
    }
    Ok(())
}

/// Sleeps without a runtime: a thread wakes the task when the time is up.
async fn sleep(d: Duration) {
    let done = Arc::new(AtomicBool::new(false));
    let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
    let mut started = false;
    std::future::poll_fn(|cx| {
        if done.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        *waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        if !started {
            started = true;
            let (done, waker) = (done.clone(), waker.clone());
            std::thread::spawn(move || {
                std::thread::sleep(d);
                done.store(true, Ordering::Release);
                if let Some(w) = waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    w.wake();
                }
            });
        }
        if done.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await
}

/// One file's marks as the replicas that are up hold them, seen from one target.
struct View {
    /// Marks against each replica, over every up replica's page (a listing cut short counts
    /// as marked from its cut to the end of the file).
    behind: Vec<RangeSet>,
    /// The target's listed marks: what can be copied now.
    need: RangeSet,
    /// Per replica that answered: the generation of its marks for the target (0: none).
    gens: Vec<Option<u64>>,
    /// Up replicas that hold marks for the target.
    holders: Vec<usize>,
    /// Flags ([`m::ENTRY`], [`m::META`]) against each replica, over every up replica's page.
    flagged: Vec<u32>,
    /// Up replicas that hold flags for the target.
    flag_holders: Vec<usize>,
}

impl View {
    async fn read(kids: &[LayerRef], up: &[usize], path: &str, target: usize) -> FopResult<View> {
        let futs = up
            .iter()
            .map(|i| Some(kids[*i].getxattr(&Ctx::NONE, path, m::PENDING)))
            .collect();
        let mut v = View {
            behind: vec![RangeSet::default(); kids.len()],
            need: RangeSet::default(),
            gens: vec![None; kids.len()],
            holders: Vec::new(),
            flagged: vec![0; kids.len()],
            flag_holders: Vec::new(),
        };
        for (i, r) in up.iter().zip(join_all(futs).await) {
            // A replica whose marks are unknown could hold some against the source.
            let bytes = r.unwrap_or(Err(errno::ENOTCONN))?;
            let page = PendingPage::from_wire(&bytes).map_err(|_| errno::EPROTO)?;
            v.gens[*i] = Some(0);
            for t in page.targets.0 {
                let tt = t.target as usize;
                if tt >= kids.len() || tt == *i {
                    continue;
                }
                for r in &t.ranges.0 {
                    v.behind[tt].add(r.offset, r.len);
                    if tt == target {
                        v.need.add(r.offset, r.len);
                    }
                }
                if t.cut != m::WHOLE {
                    v.behind[tt].add(t.cut, m::WHOLE);
                }
                v.flagged[tt] |= t.flags;
                if tt == target && t.flags != 0 {
                    v.flag_holders.push(*i);
                }
                if tt == target {
                    v.gens[*i] = Some(t.gen);
                    if !t.ranges.0.is_empty() {
                        v.holders.push(*i);
                    }
                }
            }
        }
        Ok(v)
    }
}

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
    heal_flags(kids, &up, path, target, m::META).await?;
    Ok(moved)
}

/// Brings the bytes of `path` on replica `target` up to date; returns the bytes copied.
async fn heal_data(kids: &[LayerRef], up: &[usize], path: &str, target: usize) -> FopResult<u64> {
    let cx = &Ctx::NONE;
    let up = up.to_vec();
    let others: Vec<usize> = up.iter().copied().filter(|i| *i != target).collect();
    let first = View::read(kids, &up, path, target).await?;
    // The file's kind and mode come from a replica that took what the target missed.
    let Some(&src) = first.holders.first() else {
        return Ok(0); // healed meanwhile
    };
    let clear_all = |offset: u64, len: u64| {
        let v = Mark {
            target: target as u32,
            offset,
            len,
        }
        .to_wire();
        let others = others.clone();
        async move { on_all(kids, &others, path, m::CLEAR, &v).await }
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
        .open(cx, path, libc::O_WRONLY as u32 | m::HEAL_OPEN)
        .await?;
    let mut h = Healing {
        kids,
        up: &up,
        others: &others,
        target,
        path,
        tfd: &tfd,
        sfds: vec![None; kids.len()],
        buf: vec![0u8; CHUNK as usize],
    };
    let r = h.passes(first).await;
    for (i, fd) in h.sfds.into_iter().enumerate() {
        if let Some(fd) = fd {
            let _ = kids[i].release(cx, fd).await;
        }
    }
    let _ = kids[target].release(cx, tfd).await;
    r
}

/// One file being healed on one target.
struct Healing<'a> {
    kids: &'a [LayerRef],
    up: &'a [usize],
    /// Up replicas but the target.
    others: &'a [usize],
    target: usize,
    path: &'a str,
    /// The target's heal handle.
    tfd: &'a Fd,
    /// Sources' handles, opened on first use.
    sfds: Vec<Option<Fd>>,
    buf: Vec<u8>,
}

impl Healing<'_> {
    async fn session(&self, begin: bool) -> FopResult<()> {
        let v = HealReq {
            begin: u32::from(begin),
        }
        .to_wire();
        let t = [self.target];
        on_all(self.kids, &t, self.path, m::HEAL, &v).await
    }

    async fn info(&self) -> FopResult<HealInfo> {
        let v = self.kids[self.target]
            .getxattr(&Ctx::NONE, self.path, m::HEAL)
            .await?;
        HealInfo::from_wire(&v).map_err(|_| errno::EPROTO)
    }

    /// Passes until the target has no marks left, each in a session of its own.
    async fn passes(&mut self, mut view: View) -> FopResult<u64> {
        let mut moved = 0;
        for _ in 0..PASSES {
            // The generations are read before the session begins: a miss recorded after it
            // changes them.
            let gens = view.gens.clone();
            self.session(true).await?;
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
    async fn pass(&mut self, gens: &[Option<u64>]) -> FopResult<(u64, bool)> {
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
                    let (got, last) = self.chunk(src, gens, pos, n, whole).await?;
                    moved += got;
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
    fn source(&self, view: &View, pos: u64, len: u64) -> Option<usize> {
        let rest = self.others.iter().filter(|i| !view.holders.contains(i));
        view.holders
            .iter()
            .chain(rest)
            .copied()
            .find(|i| !view.behind[*i].overlaps(pos, len))
    }

    async fn source_fd(&mut self, src: usize) -> FopResult<Fd> {
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
    async fn chunk(
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
        let lock = |on: u32| {
            LockReq {
                offset: pos,
                len: lock_len,
                lock: on,
            }
            .to_wire()
        };
        on_all(kids, self.up, path, m::LOCK, &lock(1)).await?;
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
        let _ = on_all(kids, self.up, path, m::LOCK, &lock(0)).await;
        cleared?;
        match step {
            Ok((_, wrote, last)) => Ok((wrote, last)),
            Err(EAGAIN) => Ok((0, true)),
            Err(e) => Err(e),
        }
    }

    /// Clears the target's marks on `[pos, pos+len)`: the parts heal wrote outright, and the
    /// parts it skipped unless a holder recorded a new miss for the target since `gens`.
    async fn clear(
        &self,
        gens: &[Option<u64>],
        skipped: &RangeSet,
        pos: u64,
        len: u64,
    ) -> FopResult<()> {
        let t = self.target as u32;
        let plain: Vec<Vec<u8>> = skipped
            .outside(pos, len)
            .into_iter()
            .map(|(offset, len)| {
                Mark {
                    target: t,
                    offset,
                    len,
                }
                .to_wire()
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
                    }
                    .to_wire();
                    cond.push((*i, v));
                }
            }
        }
        let mut futs = Vec::new();
        for v in &plain {
            for i in self.others {
                futs.push(Some(self.kids[*i].setxattr(
                    &Ctx::NONE,
                    self.path,
                    m::CLEAR,
                    v,
                    0,
                )));
            }
        }
        for (i, v) in &cond {
            futs.push(Some(self.kids[*i].setxattr(
                &Ctx::NONE,
                self.path,
                m::CLEAR_IF,
                v,
                0,
            )));
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
async fn copy_chunk(
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

/// The child path `name` of directory `dir` (`""`: the root).
fn child(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// Every name in directory `path` of one replica.
async fn list(kid: &LayerRef, path: &str) -> FopResult<Vec<(String, crate::Attr)>> {
    let mut out = Vec::new();
    let mut offset = 0;
    loop {
        let page = kid.readdir(&Ctx::NONE, path, offset, 512).await?;
        offset += page.entries.0.len() as u64;
        out.extend(page.entries.0.into_iter().map(|e| (e.name, e.attr)));
        if page.eof {
            return Ok(out);
        }
    }
}

fn kind(a: &crate::Attr) -> u32 {
    a.mode & libc::S_IFMT
}

/// Removes `path` from one replica, and, for a directory, all it holds.
async fn remove_tree(kid: &LayerRef, path: &str) -> FopResult<()> {
    let cx = &Ctx::NONE;
    let attr = match kid.lookup(cx, path).await {
        Ok(a) => a,
        Err(errno::ENOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    if kind(&attr) != libc::S_IFDIR {
        return match kid.unlink(cx, path).await {
            Ok(()) | Err(errno::ENOENT) => Ok(()),
            Err(e) => Err(e),
        };
    }
    // Depth first, without recursion in async code: directories are removed once emptied.
    let mut stack = vec![(path.to_owned(), false)];
    while let Some((dir, listed)) = stack.pop() {
        if listed {
            match kid.rmdir(cx, &dir).await {
                Ok(()) | Err(errno::ENOENT) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        stack.push((dir.clone(), true));
        for (name, a) in list(kid, &dir).await? {
            let p = child(&dir, &name);
            if kind(&a) == libc::S_IFDIR {
                stack.push((p, false));
            } else {
                match kid.unlink(cx, &p).await {
                    Ok(()) | Err(errno::ENOENT) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(())
}

/// Heals `flags` ([`m::ENTRY`], [`m::META`]) of `path` on `target`, pass after pass until no
/// flag of those is left for it (a flag marked again meanwhile is healed again).
async fn heal_flags(
    kids: &[LayerRef],
    up: &[usize],
    path: &str,
    target: usize,
    flags: u32,
) -> FopResult<()> {
    for _ in 0..PASSES {
        let view = View::read(kids, up, path, target).await?;
        let want = view.flagged[target] & flags;
        if want == 0 {
            return Ok(());
        }
        // The source: up, not the target, flagged for nothing that is healed here (an entry
        // heal also copies the attributes); holders first.
        let behind = m::ENTRY | want;
        let others: Vec<usize> = up.iter().copied().filter(|i| *i != target).collect();
        let rest = others.iter().filter(|i| !view.flag_holders.contains(i));
        let Some(src) = view
            .flag_holders
            .iter()
            .chain(rest)
            .copied()
            .find(|i| view.flagged[*i] & behind == 0)
        else {
            tracing::warn!(
                path,
                target,
                "no replica that is up is current for this name: left marked"
            );
            return Err(ENODATA);
        };
        let lock = |on: u32| {
            LockReq {
                offset: 0,
                len: m::WHOLE,
                lock: on,
            }
            .to_wire()
        };
        on_all(kids, up, path, m::LOCK, &lock(1)).await?;
        let step = heal_flags_locked(kids, &view, &others, path, target, src, want).await;
        let _ = on_all(kids, up, path, m::LOCK, &lock(0)).await;
        step?;
    }
    Err(EAGAIN)
}

/// One pass of [`heal_flags`], under the heal lock on `path` on every up replica: makes the
/// target's entry (with [`m::ENTRY`]) and attributes match the source's, then clears what it
/// healed on every other up replica unless a mark was added since `view` was read.
async fn heal_flags_locked(
    kids: &[LayerRef],
    view: &View,
    others: &[usize],
    path: &str,
    target: usize,
    src: usize,
    want: u32,
) -> FopResult<()> {
    let cx = &Ctx::NONE;
    let (s, t) = (&kids[src], &kids[target]);
    let sa = match s.lookup(cx, path).await {
        Ok(a) => Some(a),
        Err(errno::ENOENT) => None,
        Err(e) => return Err(e),
    };
    let mut ta = match t.lookup(cx, path).await {
        Ok(a) => Some(a),
        Err(errno::ENOENT) => None,
        Err(e) => return Err(e),
    };
    let mut whole = false;
    let mut clear = want;
    if want & m::ENTRY != 0 {
        let Some(sa) = &sa else {
            // Gone on the source: gone on the target (a directory with all it holds).
            if ta.is_some() {
                remove_tree(t, path).await?;
            }
            return clear_flags(kids, view, others, path, target, m::ENTRY | m::META, false).await;
        };
        let same = match &ta {
            Some(a) if kind(a) != kind(sa) => false,
            Some(_) if kind(sa) == libc::S_IFLNK => {
                s.readlink(cx, path).await? == t.readlink(cx, path).await?
            }
            Some(_) => true,
            None => false,
        };
        if !same && ta.is_some() {
            remove_tree(t, path).await?;
            ta = None;
        }
        let mut names: Vec<String> = Vec::new();
        match kind(sa) {
            libc::S_IFDIR => {
                if ta.is_none() {
                    mkdir_parents(t, path).await?;
                    match t.mkdir(cx, path, sa.mode & 0o7777).await {
                        Ok(_) | Err(EEXIST) => {}
                        Err(e) => return Err(e),
                    }
                } else {
                    // Both have it: what the target holds and the source does not goes too.
                    names.extend(list(t, path).await?.into_iter().map(|(n, _)| n));
                }
                // What it holds is healed name by name: flagged on the source for the target.
                names.extend(list(s, path).await?.into_iter().map(|(n, _)| n));
                names.sort_unstable();
                names.dedup();
            }
            libc::S_IFLNK => {
                if ta.is_none() {
                    mkdir_parents(t, path).await?;
                    let to = s.readlink(cx, path).await?;
                    t.symlink(cx, &to, path).await?;
                }
            }
            libc::S_IFREG => {
                if ta.is_none() {
                    mkdir_parents(t, path).await?;
                    let flags = (libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY) as u32;
                    let (fd, _) = t.create(cx, path, flags, sa.mode & 0o7777).await?;
                    let _ = t.release(cx, fd).await;
                }
                // Its bytes may be another file's (created or renamed over while the target
                // was away): all of them are copied.
                whole = true;
            }
            _ => {
                tracing::warn!(path, target, "cannot heal a special file: left marked");
                return Err(errno::EINVAL);
            }
        }
        let v = FlagMark {
            target: target as u32,
            flags: m::ENTRY,
        }
        .to_wire();
        for n in names {
            s.setxattr(cx, &child(path, &n), m::FLAG, &v, 0).await?;
        }
        clear |= m::META;
    }
    if let Some(sa) = &sa {
        if kind(sa) != libc::S_IFLNK {
            copy_meta(s, t, path, sa).await?;
        }
    }
    clear_flags(kids, view, others, path, target, clear, whole).await
}

/// Clears `flags` for `target` on `others`, each unless it added a mark since `view`; with
/// `whole`, marks all the file's bytes for `target` in the same step.
async fn clear_flags(
    kids: &[LayerRef],
    view: &View,
    others: &[usize],
    path: &str,
    target: usize,
    flags: u32,
    whole: bool,
) -> FopResult<()> {
    let values: Vec<(usize, Vec<u8>)> = others
        .iter()
        .filter_map(|i| {
            view.gens[*i].map(|gen| {
                let v = CondFlag {
                    target: target as u32,
                    flags,
                    gen,
                    data: u32::from(whole),
                };
                (*i, v.to_wire())
            })
        })
        .collect();
    let mut futs = Vec::new();
    for (i, v) in &values {
        futs.push(Some(kids[*i].setxattr(
            &Ctx::NONE,
            path,
            m::FLAG_CLEAR_IF,
            v,
            0,
        )));
    }
    for r in join_all(futs).await.into_iter().flatten() {
        match r {
            // Marked again meanwhile: the next pass heals it again.
            Ok(()) | Err(EAGAIN) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Makes the parent directories of `path` on one replica (their own flags set their modes).
async fn mkdir_parents(kid: &LayerRef, path: &str) -> FopResult<()> {
    for p in parents(path) {
        match kid.mkdir(&Ctx::NONE, p, 0o755).await {
            Ok(_) | Err(EEXIST) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Copies mode, owner, times and `user.` xattrs of `path` from the source to the target.
async fn copy_meta(s: &LayerRef, t: &LayerRef, path: &str, sa: &crate::Attr) -> FopResult<()> {
    use kiln_proto::ops::{SETATTR_ATIME, SETATTR_GID, SETATTR_MODE, SETATTR_MTIME, SETATTR_UID};
    let cx = &Ctx::NONE;
    let ta = t.lookup(cx, path).await?;
    let mut set = crate::SetAttrs {
        valid: SETATTR_MODE | SETATTR_ATIME | SETATTR_MTIME,
        mode: sa.mode & 0o7777,
        atime: sa.atime.clone(),
        mtime: sa.mtime.clone(),
        ..Default::default()
    };
    if (ta.uid, ta.gid) != (sa.uid, sa.gid) {
        set.valid |= SETATTR_UID | SETATTR_GID;
        set.uid = sa.uid;
        set.gid = sa.gid;
    }
    t.setattr(cx, path, &set).await?;
    let user = |n: &String| n.starts_with("user.");
    let have: Vec<String> = s
        .listxattr(cx, path)
        .await?
        .into_iter()
        .filter(user)
        .collect();
    for n in t.listxattr(cx, path).await?.into_iter().filter(user) {
        if !have.contains(&n) {
            match t.removexattr(cx, path, &n).await {
                Ok(()) | Err(ENODATA) => {}
                Err(e) => return Err(e),
            }
        }
    }
    for n in &have {
        let v = match s.getxattr(cx, path, n).await {
            Ok(v) => v,
            Err(ENODATA) => continue,
            Err(e) => return Err(e),
        };
        if t.getxattr(cx, path, n).await.ok().as_ref() != Some(&v) {
            t.setxattr(cx, path, n, &v, 0).await?;
        }
    }
    Ok(())
}
