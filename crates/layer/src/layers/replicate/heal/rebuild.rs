//! Full rebuild: a new brick (wiped, replaced, or told to leave) gets everything from its
//! replicas — names, attributes, xattrs, special files, hard links and data — before it is a
//! member again.
//!
//! A rebuild is one entry flag: heal flags the volume root [`m::ENTRY`] | [`m::META`] for the
//! new brick on a member, with [`m::REBUILD`] beside them to say a rebuild is under way. Healing the root flags every name in it, each directory heal flags
//! what it holds, and each file's heal copies all its bytes (see the module above): the
//! ordinary heal does the walk, one name at a time, under the same locks and sessions as any
//! heal, while clients read and write. The flags live in the members' marks logs, so a
//! rebuild that stops (heal or kilnd restarted, a member down) goes on where it was.
//!
//! The new brick takes every client change meanwhile, but serves no read and counts for no
//! quorum ([`crate::Layer::joining`]). When no member that is up lists anything for it any
//! more but the `REBUILD` flag, heal tells it (MEMBER join): it records its identity and is a
//! member again; then the flag is cleared.
//!
//! Progress ([`Rebuild`]): the member's tree is walked once when a run finds a rebuild (names
//! and bytes in all), and the new brick's too (what it holds already); each file healed since
//! adds its bytes.

use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use crate::marks::{self as m, CondFlag, FlagMark, MemberReq};
use crate::replicate::Replicate;
use crate::{errno, Ctx, FopResult, LayerRef};
use kiln_proto::sync::MutexExt as _;

use super::entries::{child, kind, list};
use super::Need;

/// A rebuild's progress, as `heal info`, `volume status` and `/metrics` show it.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rebuild {
    /// The replicate layer's name.
    pub set: String,
    /// The brick being rebuilt: its index in the set, and its layer name.
    pub target: usize,
    /// Its layer name.
    pub target_name: String,
    /// Names (files, directories, links, special files) on the member it is rebuilt from.
    pub files_total: u64,
    /// Bytes of regular files there.
    pub bytes_total: u64,
    /// Names the new brick holds (counted when the run began, plus those healed since).
    pub files_done: u64,
    /// Bytes it holds, likewise.
    pub bytes_done: u64,
    /// Bytes copied by this run so far.
    pub bytes_moved: u64,
    /// When this run began working on it (seconds since the epoch).
    pub since: u64,
    /// Bytes copied per second by this run.
    pub rate: f64,
    /// Seconds left at that rate (`None`: no rate yet).
    pub eta: Option<u64>,
    /// True once it finished and the brick is a member.
    pub done: bool,
    /// When this heal service began working on it.
    #[serde(skip)]
    started: Option<Instant>,
}

impl Rebuild {
    fn tick(&mut self) {
        let secs = self.started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        if secs > 0.0 && self.bytes_moved > 0 {
            self.rate = self.bytes_moved as f64 / secs;
            let left = self.bytes_total.saturating_sub(self.bytes_done);
            self.eta = Some((left as f64 / self.rate).ceil() as u64);
        }
    }
}

/// The rebuilds a heal run works on, shared with whoever shows them.
#[derive(Default)]
pub struct Board {
    rebuilds: Mutex<Vec<Rebuild>>,
}

impl Board {
    /// The rebuilds now (finished ones included until the next run).
    pub fn snapshot(&self) -> Vec<Rebuild> {
        self.rebuilds.locked().clone()
    }

    fn update(&self, set: &str, target: usize, f: impl FnOnce(&mut Rebuild)) {
        let mut all = self.rebuilds.locked();
        if let Some(r) = all.iter_mut().find(|r| r.set == set && r.target == target) {
            f(r);
        }
    }

    fn put(&self, r: Rebuild) {
        let mut all = self.rebuilds.locked();
        all.retain(|x| !(x.set == r.set && x.target == r.target));
        all.push(r);
    }

    /// Forgets the set's rebuilds that finished (shown until the next run).
    fn forget_done(&self, set: &str) {
        let mut all = self.rebuilds.locked();
        all.retain(|x| x.set != set || !x.done);
    }
}

/// The first member that is up, not `target`.
fn member_source(kids: &[LayerRef], target: usize) -> Option<usize> {
    (0..kids.len()).find(|i| *i != target && kids[*i].up() && !kids[*i].joining())
}

/// Starts a rebuild of `target` in `r` (flags the root for it on a member); with `leave`,
/// a member is first made new (it is rebuilt even though it has an identity).
pub async fn start(r: &Replicate, target: usize, leave: bool) -> FopResult<()> {
    let kids = r.replicas();
    if !kids[target].up() {
        return Err(errno::ENOTCONN);
    }
    let Some(src) = member_source(kids, target) else {
        tracing::warn!(target, "no member is up to rebuild from");
        return Err(super::ENODATA);
    };
    if leave {
        let req = MemberReq {
            op: m::MEMBER_LEAVE,
        };
        kids[target].member(&Ctx::NONE, "", &req).await?;
    }
    let flag = FlagMark {
        target: target as u32,
        flags: m::ENTRY | m::META | m::REBUILD,
    };
    kids[src].flag_add(&Ctx::NONE, "", &flag).await?;
    tracing::info!(
        set = crate::Layer::name(r),
        brick = kids[target].name(),
        from = kids[src].name(),
        "full rebuild started"
    );
    Ok(())
}

/// Names and bytes of regular files in one replica's tree.
async fn count(kid: &LayerRef) -> FopResult<(u64, u64)> {
    let (mut files, mut bytes) = (0u64, 0u64);
    let mut todo = vec![String::new()];
    while let Some(dir) = todo.pop() {
        for (name, a) in list(kid, &dir).await? {
            files += 1;
            match kind(&a) {
                libc::S_IFDIR => todo.push(child(&dir, &name)),
                libc::S_IFREG => bytes += a.size,
                _ => {}
            }
        }
    }
    Ok((files, bytes))
}

/// What the members that are up list for `target`: whether a rebuild is flagged (and the
/// generations to clear that flag against), and whether anything else is listed (`None`: a
/// member could not be asked, or its index did not fit one page — not known).
struct Listed {
    rebuild: Vec<(usize, u64)>,
    other: Option<bool>,
}

async fn listed(kids: &[LayerRef], target: usize) -> Listed {
    let members: Vec<usize> = (0..kids.len())
        .filter(|i| *i != target && kids[*i].up() && !kids[*i].joining())
        .collect();
    let cx = &Ctx::NONE;
    let futs = members
        .iter()
        .map(|i| {
            let k = &kids[*i];
            Some(Box::pin(crate::exec::join2(
                k.pending_index(cx, "", &()),
                k.pending(cx, "", &()),
            )))
        })
        .collect();
    let mut out = Listed {
        rebuild: Vec::new(),
        other: Some(false),
    };
    for (i, r) in members.iter().zip(crate::exec::join_all(futs).await) {
        let Some((Ok(index), Ok(root))) = r else {
            out.other = None;
            continue;
        };
        for t in root
            .targets
            .0
            .iter()
            .filter(|t| t.target as usize == target)
        {
            if t.flags & m::REBUILD != 0 {
                out.rebuild.push((*i, t.gen));
            }
        }
        let more =
            index.entries.0.iter().any(|e| {
                e.target as usize == target && !(e.path.is_empty() && e.flags == m::REBUILD)
            });
        if more {
            out.other = out.other.map(|_| true);
        } else if index.more {
            out.other = None;
        }
    }
    out
}

/// Copies every directory's access and change times from `s` to `t` where they differ.
async fn dir_times(s: &LayerRef, t: &LayerRef) -> FopResult<()> {
    use kiln_proto::ops::{SETATTR_ATIME, SETATTR_MTIME};
    let cx = &Ctx::NONE;
    let mut todo = vec![String::new()];
    while let Some(dir) = todo.pop() {
        let sa = s.lookup(cx, &dir).await?;
        if let Ok(ta) = t.lookup(cx, &dir).await {
            if (&ta.atime, &ta.mtime) != (&sa.atime, &sa.mtime) {
                let set = crate::SetAttrs {
                    valid: SETATTR_ATIME | SETATTR_MTIME,
                    atime: sa.atime.clone(),
                    mtime: sa.mtime.clone(),
                    ..Default::default()
                };
                t.setattr(cx, &dir, &set).await?;
            }
        }
        for (name, a) in list(s, &dir).await? {
            if kind(&a) == libc::S_IFDIR {
                todo.push(child(&dir, &name));
            }
        }
    }
    Ok(())
}

/// The new bricks of `r` that are up: starts a rebuild of each that has none under way, and
/// puts each on `board` with its totals.
pub(super) async fn begin(r: &Replicate, board: &Board) -> Vec<usize> {
    let kids = r.replicas();
    let set = crate::Layer::name(r);
    board.forget_done(set);
    let mut out = Vec::new();
    for t in 0..kids.len() {
        if !kids[t].up() || !kids[t].joining() {
            continue;
        }
        // A client learns that a brick joined only when it next asks (at most a second
        // later): the brick itself is asked, so that a brick that just joined is not rebuilt
        // again.
        let ask = MemberReq { op: m::MEMBER_ASK };
        match kids[t].member(&Ctx::NONE, "", &ask).await {
            Ok(st) if st.joining == 0 => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(
                    set,
                    brick = kids[t].name(),
                    "cannot ask the brick: errno {e}"
                );
                continue;
            }
        }
        if listed(kids, t).await.rebuild.is_empty() {
            if let Err(e) = start(r, t, false).await {
                tracing::warn!(
                    set,
                    brick = kids[t].name(),
                    "cannot start a rebuild: errno {e}"
                );
                continue;
            }
        }
        let Some(src) = member_source(kids, t) else {
            continue;
        };
        out.push(t);
        // The trees are counted once per rebuild, not in every heal run.
        let known = board
            .rebuilds
            .locked()
            .iter()
            .any(|r| r.set == set && r.target == t && !r.done);
        if known {
            continue;
        }
        let (files_total, bytes_total) = count(&kids[src]).await.unwrap_or_default();
        let (have_files, have_bytes) = count(&kids[t]).await.unwrap_or_default();
        board.put(Rebuild {
            set: set.to_owned(),
            target: t,
            target_name: kids[t].name().to_owned(),
            files_total,
            bytes_total,
            files_done: have_files.min(files_total),
            bytes_done: have_bytes.min(bytes_total),
            since: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            started: Some(Instant::now()),
            ..Default::default()
        });
    }
    out
}

/// Counts a file healed on a brick being rebuilt.
pub(super) fn healed(board: &Board, need: &Need, bytes: u64) {
    board.update(&need.set, need.target, |r| {
        // Names and bytes made since the count may exceed it: done stops at the total.
        if need.entry {
            r.files_done = (r.files_done + 1).min(r.files_total);
        }
        r.bytes_moved += bytes;
        r.bytes_done = (r.bytes_done + bytes).min(r.bytes_total);
        r.tick();
    });
}

/// Ends the rebuilds of `r` that have nothing left (no member that is up lists anything for
/// the brick but the rebuild flag, in full): each brick is told it is a member, then the flag
/// is cleared. Returns the bricks that joined.
pub(super) async fn finish(r: &Replicate, board: &Board) -> Vec<String> {
    let kids = r.replicas();
    let set = crate::Layer::name(r);
    let mut joined = Vec::new();
    for t in 0..kids.len() {
        if !kids[t].up() {
            continue;
        }
        let l = listed(kids, t).await;
        if l.rebuild.is_empty() || l.other != Some(false) {
            continue;
        }
        // Healing a directory's names touched its times on the brick after they were
        // copied: they are copied again, now that every name is in place.
        if let Some(src) = member_source(kids, t) {
            if let Err(e) = dir_times(&kids[src], &kids[t]).await {
                tracing::warn!(set, brick = kids[t].name(), "directory times: errno {e}");
                continue;
            }
        }
        let req = MemberReq { op: m::MEMBER_JOIN };
        match kids[t].member(&Ctx::NONE, "", &req).await {
            Ok(st) if st.joining == 0 => {}
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(set, brick = kids[t].name(), "cannot join: errno {e}");
                continue;
            }
        }
        for (i, gen) in l.rebuild {
            let v = CondFlag {
                target: t as u32,
                flags: m::REBUILD,
                gen,
                data: 0,
            };
            // Refused (a new mark since): the next run clears it.
            let _ = kids[i].flag_clear_if(&Ctx::NONE, "", &v).await;
        }
        tracing::info!(
            set,
            brick = kids[t].name(),
            "full rebuild finished: a member"
        );
        board.update(set, t, |r| {
            r.done = true;
            r.files_done = r.files_total;
            r.bytes_done = r.bytes_total;
            r.eta = Some(0);
        });
        joined.push(kids[t].name().to_owned());
    }
    joined
}
