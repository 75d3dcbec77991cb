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
//! and heal's writes — through a handle opened with `heal_open` — take only the
//! bytes no client changed since: the target's bytes there are the newer ones. Ordering at the
//! target is exact: a client write and a heal write to the same bytes are registered under one
//! mutex, a client write is recorded the moment it is let through, and once heal's lock has
//! lapsed a client write waits for an overlapping heal write rather than run beside it.
//!
//! A skipped range is cleared like the rest, but conditionally (`mark_clear_if`): only
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
//! heal-while-writing runs (see `crates/kilnd/tests/it/replicate_heal.rs`).
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
//! clears its flag. Then mode, owner, times and `user.` xattrs are copied. Each pass runs in
//! a heal session on the target begun before the lock, as the data path's: what of the name
//! clients changed there since (entry, mode, owner, times, xattrs) heal's changes leave out —
//! a skipped entry change ([`crate::marks::SKIPPED`]) means the target's entry is the newer,
//! and counts as healed. **The rule for
//! removing:** a name is removed from the target only when it is flagged for the target and
//! the source is not flagged behind for it; a name that reached only the target (a create
//! the source missed) carries a flag against the source on the target, so that source is
//! refused, and with no current source the name is left flagged (`ENODATA`). Nothing is
//! removed because a listing lacks it. Flags are cleared conditionally
//! (`flag_clear_if`) against the generations read before the lock: a flag
//! marked again meanwhile stays, and the next pass heals it again.
//!
//! **Full rebuilds** ([`rebuild`]): a new brick (wiped, replaced) is rebuilt by flagging the
//! volume root for it; the entry heal above then walks the whole tree. **Pacing**: after each
//! step that held clients back, heal rests as long again ([`DUTY`]).
//!
//! Heal must run on connections of its own (a [`crate::replicate::Replicate`] built for it),
//! not those of a client that also writes: locks and sessions belong to a connection, and a
//! connection's own writes pass its locks.

use std::time::Duration;

use crate::exec::join_all;
use crate::marks::{self as m};
use crate::replicate::Replicate;
use crate::{Ctx, Errno, FopResult, LayerRef};

mod data;
mod entries;
mod holes;
mod rebuild;
mod suspect;
mod view;

pub use data::heal_file;
pub use rebuild::{start as start_rebuild, Board, Rebuild};

/// File exists.
const EEXIST: Errno = 17;
/// Try again: the file is still marked after [`PASSES`] passes, or a heal size change was
/// refused.
const EAGAIN: Errno = 11;
/// No data: no replica that is up is current for part of what the target needs.
const ENODATA: Errno = 61;
/// Timed out: the session on the target lapsed (heal stalled for a lease).
const ETIMEDOUT: Errno = 110;

/// Most bytes copied under one lock: small enough that a client write to the chunk, or a
/// read queued behind heal's on the source, waits little (see [`DUTY`]).
pub const CHUNK: u64 = 1 << 17;

/// How long heal waits, after it began a session on a file that clients have open on the
/// target, before it copies: see the module documentation.
pub const GRACE: Duration = Duration::from_millis(100);

/// Most passes (sessions) over one file in one run.
pub const PASSES: usize = 8;

/// Most looks at a file's marks within one pass (each copies what is new since the last).
const ROUNDS: usize = 64;

/// A byte count, or null where it is not known (u64::MAX and the sums that reached it).
fn known_bytes<S: serde::Serializer>(b: &u64, s: S) -> Result<S::Ok, S::Error> {
    if *b > u64::MAX / 2 {
        s.serialize_none()
    } else {
        s.serialize_u64(*b)
    }
}

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
    /// Marked bytes (a range "to the end of the file" counts as unknown: u64::MAX, shown as
    /// null in JSON).
    #[serde(serialize_with = "known_bytes")]
    pub bytes: u64,
    /// False while the replica behind is down (nothing can be healed yet).
    pub target_up: bool,
    /// The replica missed a change of this name (created, removed, renamed from or to).
    pub entry: bool,
    /// The replica missed a change of this path's attributes or xattrs.
    pub metadata: bool,
    /// Suspect marks ([`m::ANY`]): a client died changing this path, and the replicas may
    /// differ; `target` is then the replica heal will make the others like (or, with none
    /// up and current, `usize::MAX`).
    pub suspect: bool,
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
    /// New bricks whose full rebuild finished: members now.
    pub joined: Vec<String>,
    /// Files whose suspect marks (a client died changing them) became ordinary ones.
    pub suspects: u64,
}

/// Every replicate layer in a stack.
pub fn replicate_layers(top: &LayerRef) -> Vec<LayerRef> {
    fn walk(l: &LayerRef, out: &mut Vec<LayerRef>) {
        if l.as_any().is_some_and(|a| a.is::<Replicate>()) {
            out.push(l.clone());
            return;
        }
        for c in l.graph_children() {
            walk(&c, out);
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

/// The replicas of a stack that are new bricks (see [`crate::Layer::joining`]), by layer
/// name, and whether each is up: a heal run rebuilds those that are up.
pub fn new_bricks(top: &LayerRef) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for l in replicate_layers(top) {
        for k in rep(&l).replicas() {
            if k.joining() {
                out.push((k.name().to_owned(), k.up()));
            }
        }
    }
    out
}

/// What needs healing in every replicate layer of a stack.
pub async fn info(top: &LayerRef) -> Vec<Need> {
    info_from_reachable(top).await.needs
}

/// What heal info found: the files behind, from every brick that answered, and the bricks
/// that could not be asked (down, or failing the question). A file only a brick that could
/// not be asked knows of is missing from `needs` until it answers again.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Info {
    /// Files behind on a replica.
    pub needs: Vec<Need>,
    /// The layer names of the bricks not asked.
    pub unasked: Vec<String>,
}

/// [`info`], saying which bricks could not be asked.
pub async fn info_from_reachable(top: &LayerRef) -> Info {
    let mut out = Info::default();
    for l in replicate_layers(top) {
        let (needs, unasked) = needs(rep(&l)).await;
        out.needs.extend(needs);
        out.unasked.extend(unasked);
    }
    out
}

/// The first page of one replica set's index, merged over its replicas that are up; and the
/// replicas that could not be asked.
async fn needs(r: &Replicate) -> (Vec<Need>, Vec<String>) {
    let kids = r.replicas();
    let futs = kids
        .iter()
        .map(|k| k.up().then(|| k.pending_index(&Ctx::NONE, "", &())))
        .collect();
    let mut by: std::collections::BTreeMap<(String, u32), (u64, u64, u32)> = Default::default();
    let mut unasked = Vec::new();
    for (k, page) in join_all(futs).await.into_iter().enumerate() {
        let page = match page {
            Some(Ok(p)) => p,
            _ => {
                unasked.push(kids[k].name().to_owned());
                continue;
            }
        };
        for e in page.entries.0 {
            let slot = by.entry((e.path, e.target)).or_default();
            slot.0 = slot.0.max(e.ranges);
            slot.1 = slot.1.max(e.bytes);
            slot.2 |= e.flags;
        }
    }
    // Suspect files are made like the first member up: the source a reader would pick
    // without counting marks (heal counts them when it resolves).
    let source = (0..kids.len()).find(|i| kids[*i].up() && !kids[*i].joining());
    let needs = by
        .into_iter()
        .filter(|((_, t), _)| (*t as usize) < kids.len() || *t == m::ANY)
        .map(|((path, t), (ranges, bytes, flags))| {
            let suspect = t == m::ANY;
            let target = if suspect {
                source.unwrap_or(usize::MAX)
            } else {
                t as usize
            };
            Need {
                set: crate::Layer::name(r).to_owned(),
                path,
                target,
                target_name: match (suspect, kids.get(target)) {
                    (false, Some(k)) => k.name().to_owned(),
                    (true, Some(k)) => format!("any (like {})", k.name()),
                    _ => "any (no source up)".to_owned(),
                },
                ranges,
                bytes,
                target_up: kids.get(target).is_some_and(|k| k.up()),
                entry: flags & m::ENTRY != 0,
                metadata: flags & m::META != 0,
                suspect,
            }
        })
        .collect();
    (needs, unasked)
}

/// Heals every replicate layer of a stack once over; `progress` hears of each file done.
pub async fn run(top: &LayerRef, progress: &(dyn Fn(&Need, u64) + Sync)) -> Report {
    run_with(top, progress, &Board::default()).await
}

/// [`run`], which also rebuilds new bricks in full ([`rebuild`]) and keeps their progress on
/// `board`.
pub async fn run_with(
    top: &LayerRef,
    progress: &(dyn Fn(&Need, u64) + Sync),
    board: &Board,
) -> Report {
    let mut report = Report::default();
    for l in replicate_layers(top) {
        let r = rep(&l);
        let rebuilding = rebuild::begin(r, board).await;
        // Suspect marks first: they become the ordinary marks the loop below heals.
        let (resolved, errors) = suspect::resolve_all(r).await;
        report.suspects += resolved;
        report.errors.extend(errors);
        // Pages: what is healed is cleared, so the next look shows the rest.
        let mut seen = std::collections::HashSet::new();
        loop {
            let (list, _) = needs(r).await;
            let fresh: Vec<Need> = list
                .into_iter()
                .filter(|n| seen.insert((n.path.clone(), n.target)))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for need in fresh {
                if !need.target_up || need.suspect {
                    report.left += 1;
                    continue;
                }
                match heal_file(r, &need.path, need.target).await {
                    Ok(bytes) => {
                        report.files += 1;
                        report.bytes += bytes;
                        if rebuilding.contains(&need.target) {
                            rebuild::healed(board, &need, bytes);
                        }
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
        report.joined.extend(rebuild::finish(r, board).await);
    }
    report
}

/// Parent directories of `path`, outermost first.
fn parents(path: &str) -> Vec<&str> {
    path.match_indices('/').map(|(i, _)| &path[..i]).collect()
}

/// Runs the control fop `op` on every replica in `on`; fails if any fails.
async fn on_all<'a>(
    kids: &'a [LayerRef],
    on: &[usize],
    op: impl Fn(&'a LayerRef) -> crate::Fut<'a, ()>,
) -> FopResult<()> {
    let futs = on.iter().map(|i| Some(op(&kids[*i]))).collect();
    for r in join_all(futs).await.into_iter().flatten() {
        r?;
    }
    Ok(())
}

/// Begins a heal session on `path` on the target `t`, waiting while another heal has one
/// there (the brick refuses with `EBUSY`: the heal service and `kiln volume heal` at work on
/// the same file): the other's work is joined, not raced. True when it waited — what the file
/// needs must then be read again.
pub(super) async fn begin_session(t: &LayerRef, path: &str) -> FopResult<bool> {
    let begin = m::HealReq {
        begin: m::SESSION_HEAL,
    };
    let mut waited = false;
    let mut pause = Duration::from_millis(10);
    loop {
        match t.heal_session(&Ctx::NONE, path, &begin).await {
            Ok(()) => return Ok(waited),
            Err(e) if e == libc::EBUSY as u32 => {
                if !waited {
                    tracing::info!(path, "another heal is at work on it: waiting for it");
                }
                waited = true;
                sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Sleeps without a runtime (the process's timer thread wakes the task).
async fn sleep(d: Duration) {
    crate::timer::sleep_until(std::time::Instant::now() + d).await
}

/// Share of the time heal works while clients may be waiting: after each step that held
/// clients' changes back (a chunk copied, a name healed under its lock) heal rests one and a
/// half times as long, so clients' requests queued behind it drain before the next.
/// `bench/rebuild.py` (fio 4 KiB randrw QD1 during a rebuild, against idle): with 1 MiB chunks
/// and 0.5, client p99 was 2.7x (reads) and 2.4x (writes) idle; with [`CHUNK`] 128 KiB and
/// 0.4, 1.4x and 1.3x, at 91 MB/s of rebuild on the shared 2-core machine
/// (`bench/README.md`).
pub const DUTY: f64 = 0.4;

/// Rests after a step of heal that took `worked` (see [`DUTY`]).
async fn rest(worked: Duration) {
    sleep(worked.mul_f64((1.0 - DUTY) / DUTY)).await
}

#[cfg(test)]
mod tests {
    use super::Need;

    #[test]
    fn a_whole_file_need_shows_unknown_bytes_as_null() {
        let mut n = Need {
            set: "rep".into(),
            path: "f".into(),
            target: 1,
            target_name: "c1".into(),
            ranges: 1,
            bytes: u64::MAX,
            target_up: true,
            entry: false,
            metadata: false,
            suspect: false,
        };
        let v = serde_json::to_value(&n).unwrap();
        assert!(v["bytes"].is_null(), "{v}");
        n.bytes = 4096;
        assert_eq!(serde_json::to_value(&n).unwrap()["bytes"], 4096);
    }
}
