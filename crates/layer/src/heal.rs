//! Heal: copy to a replica exactly the ranges it missed, while I/O continues.
//!
//! The bricks that took a change another replica missed hold marks naming it
//! ([`crate::marks`]). Heal reads every replica's index, and for each (file, replica behind):
//! makes sure the file exists there (creating parent directories), then, chunk by chunk
//! (at most [`CHUNK`] bytes), takes a heal lock on the chunk on every replica that is up, reads
//! it from an up-to-date replica, writes it to the one behind, clears that chunk's marks and
//! drops the lock. The lock keeps client writes to the chunk out of the copy on every replica,
//! so a write is either in the copy or lands after it, everywhere alike; clearing under the
//! lock means a miss recorded after the copy is never cleared by it.
//!
//! Known window: a client write sent to every replica that reaches the replica behind *before*
//! the chunk's lock and an up-to-date replica only *after* the copy (that replica's process
//! stalled for longer than heal's lock and read round trips) is overwritten on the healed
//! replica by the older data. Seen once in ~60 seeded runs of heal-while-writing on this
//! 2-core machine. The fix is for the brick behind to record the ranges client writes touched
//! since heal began on the file and for heal's writes to skip them (not built yet).
//!
//! Heal must run on connections of its own (a [`crate::replicate::Replicate`] built for it),
//! not those of a client that also writes: locks belong to a connection, and a connection's
//! own writes pass its locks.

use kiln_proto::Wire;

use crate::exec::join_all;
use crate::marks::{self as m, IndexPage, LockReq, Mark, PendingPage};
use crate::replicate::Replicate;
use crate::{errno, Ctx, Errno, Fd, FopResult, IoBufs, LayerRef, ReadDst, ReadOut};

/// File exists.
const EEXIST: Errno = 17;

/// Most bytes copied under one lock.
pub const CHUNK: u64 = 1 << 20;

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
    let mut by: std::collections::BTreeMap<(String, u32), (u64, u64)> = Default::default();
    for v in join_all(futs).await.into_iter().flatten().flatten() {
        let Ok(page) = IndexPage::from_wire(&v) else {
            tracing::warn!("a brick sent an index page that does not decode");
            continue;
        };
        for e in page.entries.0 {
            let slot = by.entry((e.path, e.target)).or_default();
            slot.0 = slot.0.max(e.ranges);
            slot.1 = slot.1.max(e.bytes);
        }
    }
    by.into_iter()
        .filter(|((_, t), _)| (*t as usize) < kids.len())
        .map(|((path, t), (ranges, bytes))| Need {
            set: crate::Layer::name(r).to_owned(),
            path,
            target: t as usize,
            target_name: kids[t as usize].name().to_owned(),
            ranges,
            bytes,
            target_up: kids[t as usize].up(),
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

/// Brings `path` on replica `target` up to date; returns the bytes copied.
pub async fn heal_file(r: &Replicate, path: &str, target: usize) -> FopResult<u64> {
    let kids = r.replicas();
    let cx = &Ctx::NONE;
    let up: Vec<usize> = (0..kids.len()).filter(|i| kids[*i].up()).collect();
    if !up.contains(&target) {
        return Err(errno::ENOTCONN);
    }
    let others: Vec<usize> = up.iter().copied().filter(|i| *i != target).collect();
    // A source: an up replica that holds marks for the target (it took what the target
    // missed) and has none against itself.
    let mut source = None;
    for i in &others {
        let Ok(v) = kids[*i].getxattr(cx, path, m::PENDING).await else {
            continue;
        };
        let Ok(page) = PendingPage::from_wire(&v) else {
            continue;
        };
        if page.targets.0.iter().any(|t| t.target as usize == target) {
            source = Some(*i);
            break;
        }
    }
    let Some(src) = source else {
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
    let sfd = kids[src].open(cx, path, libc::O_RDONLY as u32).await?;
    let tfd = match kids[target].open(cx, path, libc::O_WRONLY as u32).await {
        Ok(f) => f,
        Err(e) => {
            let _ = kids[src].release(cx, sfd).await;
            return Err(e);
        }
    };
    let r = copy_marked(kids, &up, src, target, path, &sfd, &tfd).await;
    let _ = kids[src].release(cx, sfd).await;
    let _ = kids[target].release(cx, tfd).await;
    r
}

async fn copy_marked(
    kids: &[LayerRef],
    up: &[usize],
    src: usize,
    target: usize,
    path: &str,
    sfd: &Fd,
    tfd: &Fd,
) -> FopResult<u64> {
    let cx = &Ctx::NONE;
    let others: Vec<usize> = up.iter().copied().filter(|i| *i != target).collect();
    let mut moved = 0u64;
    let mut buf = vec![0u8; CHUNK as usize];
    loop {
        let v = kids[src].getxattr(cx, path, m::PENDING).await?;
        let page = PendingPage::from_wire(&v).map_err(|_| errno::EPROTO)?;
        let ranges: Vec<(u64, u64)> = page
            .targets
            .0
            .iter()
            .filter(|t| t.target as usize == target)
            .flat_map(|t| t.ranges.0.iter().map(|r| (r.offset, r.len)))
            .collect();
        if ranges.is_empty() {
            return Ok(moved);
        }
        for (offset, len) in ranges {
            let whole = len == m::WHOLE;
            let end = if whole { u64::MAX } else { offset + len };
            let mut pos = offset;
            while pos < end {
                let n = (end - pos).min(CHUNK);
                // A range to the end of the file is locked to the end: its last chunk also
                // sets the size.
                let lock_len = if whole { m::WHOLE } else { n };
                let lock = LockReq {
                    offset: pos,
                    len: lock_len,
                    lock: 1,
                }
                .to_wire();
                on_all(kids, up, path, m::LOCK, &lock).await?;
                let step = copy_chunk(kids, src, target, sfd, tfd, pos, n, whole, &mut buf).await;
                let cleared = match &step {
                    Ok((_, last)) => {
                        let clear_len = if *last && whole { m::WHOLE } else { n };
                        let v = Mark {
                            target: target as u32,
                            offset: pos,
                            len: clear_len,
                        }
                        .to_wire();
                        on_all(kids, &others, path, m::CLEAR, &v).await
                    }
                    Err(_) => Ok(()),
                };
                let unlock = LockReq {
                    offset: pos,
                    len: lock_len,
                    lock: 0,
                }
                .to_wire();
                let _ = on_all(kids, up, path, m::LOCK, &unlock).await;
                let (got, last) = step?;
                cleared?;
                moved += got;
                if last {
                    break;
                }
                pos += n;
            }
        }
    }
}

/// Copies `[pos, pos+n)` from the source to the target; returns the bytes copied and whether
/// the source ended there (then, for a range to the end of the file, the target's size is
/// set to the source's).
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
) -> Result<(u64, bool), Errno> {
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
        if w.n != got {
            return Err(errno::EIO);
        }
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
    Ok((got as u64, last))
}
