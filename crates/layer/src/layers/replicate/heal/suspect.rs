//! Suspect marks ([`m::ANY`]) turned into ordinary ones, so that heal can copy.
//!
//! A brick records suspect marks for what a client connection changed lately when it ended
//! holding handles (its client was killed mid-write, see the brick's `recent` records): byte
//! ranges where the replicas may differ, and names whose entries may. Which replica is right
//! is not known, and need not be — the change was never acknowledged — but every replica
//! must end up the same, and no read may see bytes a later read contradicts. So one replica
//! is chosen by a rule readers share ([`m::suspect_source`]: the first member that is up and
//! not behind), and for every other replica each suspect range is marked as missed on every
//! replica that is up but that one, with the source's size (from it to the end of the file:
//! a write that grew the file on some replicas only) — the marks a client would have written
//! had it lived. Suspect names are looked up on every replica; only those whose entry differs
//! from the source's (missing, another kind, size, symlink target or device) are flagged
//! [`m::ENTRY`] (a replica down now is flagged unseen), and a differing mode or owner
//! [`m::META`]. The suspect marks are then cleared, each unless a new one was added since they
//! were read. Ordinary heal copies the rest.

use crate::exec::join_all;
use crate::marks::{self as m, CondFlag, CondMark, FlagMark, Mark, RangeSet};
use crate::replicate::{bit, Replicate};
use crate::{errno, Attr, Ctx, FopResult, Layer, LayerRef};

use super::*;

/// Resolves every suspect file of replica set `r`; returns how many it resolved and the
/// errors of those it could not (they stay suspect for the next run).
pub(super) async fn resolve_all(r: &Replicate) -> (u64, Vec<String>) {
    let mut done = 0;
    let mut errors = Vec::new();
    let mut seen = std::collections::HashSet::new();
    loop {
        let paths: Vec<String> = suspect_paths(r)
            .await
            .into_iter()
            .filter(|p| seen.insert(p.clone()))
            .collect();
        if paths.is_empty() {
            return (done, errors);
        }
        for p in paths {
            match resolve(r, &p).await {
                Ok(()) => done += 1,
                Err(e) => errors.push(format!(
                    "{}: {p}: suspect marks (a client died mid-change) left: errno {e}",
                    r.name()
                )),
            }
        }
    }
}

/// The paths with suspect marks on the first index page of every replica that is up.
async fn suspect_paths(r: &Replicate) -> Vec<String> {
    let kids = r.replicas();
    let futs = kids
        .iter()
        .map(|k| k.up().then(|| k.pending_index(&Ctx::NONE, "", &())))
        .collect();
    let mut paths: Vec<String> = join_all(futs)
        .await
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|page| page.entries.0)
        .filter(|e| e.target == m::ANY)
        .map(|e| e.path)
        .collect();
    paths.sort_unstable();
    paths.dedup();
    paths
}

/// What the replicas that are up say of one suspect path.
#[derive(Default)]
struct Seen {
    /// Replicas with marks against them for the file (a bit each), as a reader counts them.
    behind: u32,
    /// Suspect ranges over every replica.
    ranges: RangeSet,
    /// Suspect flags over every replica.
    flags: u32,
    /// Per holder of suspect marks: the generation read, and whether it holds flags.
    gens: Vec<(usize, u64, bool)>,
}

async fn read(kids: &[LayerRef], up: &[usize], path: &str) -> FopResult<Seen> {
    let futs = up
        .iter()
        .map(|i| Some(kids[*i].pending(&Ctx::NONE, path, &())))
        .collect();
    let mut s = Seen::default();
    for (i, page) in up.iter().zip(join_all(futs).await) {
        // A replica whose marks are unknown could hold some against the source.
        let page = page.unwrap_or(Err(errno::ENOTCONN))?;
        for t in page.targets.0 {
            let marked = !t.ranges.0.is_empty() || t.flags & m::ENTRY != 0;
            if t.target == m::ANY {
                for r in &t.ranges.0 {
                    s.ranges.add(r.offset, r.len);
                }
                if t.cut != m::WHOLE {
                    s.ranges.add(t.cut, m::WHOLE);
                }
                s.flags |= t.flags;
                s.gens.push((*i, t.gen, t.flags != 0));
            } else if (t.target as usize) < kids.len() && marked {
                s.behind |= bit(t.target as usize);
            }
        }
    }
    Ok(s)
}

/// Resolves one path's suspect marks (see the module documentation).
pub(super) async fn resolve(r: &Replicate, path: &str) -> FopResult<()> {
    let kids = r.replicas();
    let up: Vec<usize> = (0..kids.len()).filter(|i| kids[*i].up()).collect();
    let seen = read(kids, &up, path).await?;
    if seen.gens.is_empty() {
        return Ok(()); // resolved meanwhile
    }
    let members = up.iter().copied().filter(|i| !kids[*i].joining());
    let src = m::suspect_source(members, seen.behind).ok_or(ENODATA)?;
    let cx = &Ctx::NONE;
    let src_attr = match kids[src].lookup(cx, path).await {
        Ok(a) => Some(a),
        Err(errno::ENOENT) => None,
        Err(e) => return Err(e),
    };
    let mut misses: Vec<(u32, Option<RangeSet>, u32)> = Vec::new();
    let attrs = if seen.flags & m::ENTRY != 0 {
        let futs = up.iter().map(|i| Some(kids[*i].lookup(cx, path))).collect();
        join_all(futs).await
    } else {
        Vec::new()
    };
    for t in (0..kids.len()).filter(|t| *t != src) {
        let mut ranges = RangeSet::default();
        let mut flags = 0;
        if !seen.ranges.is_empty() {
            match &src_attr {
                Some(a) => {
                    for (o, l) in seen.ranges.iter() {
                        ranges.add(o, l);
                    }
                    ranges.add(a.size, m::WHOLE);
                }
                None => flags |= m::ENTRY,
            }
        }
        if seen.flags & m::ENTRY != 0 {
            let theirs = up.iter().position(|i| *i == t).map(|k| &attrs[k]);
            let (f, from) = match theirs {
                Some(Some(Ok(a))) => compare(kids, src, t, path, src_attr.as_ref(), Some(a)).await,
                Some(Some(Err(errno::ENOENT))) => {
                    compare(kids, src, t, path, src_attr.as_ref(), None).await
                }
                // Down, or not answering: not seen, so flagged.
                _ => (m::ENTRY, None),
            };
            flags |= f;
            if let Some(from) = from {
                ranges.add(from, m::WHOLE);
            }
        }
        if !ranges.is_empty() || flags != 0 {
            misses.push((t as u32, Some(ranges).filter(|r| !r.is_empty()), flags));
        }
    }
    mark_misses(kids, &up, path, &misses).await?;
    clear_suspects(kids, path, &seen).await?;
    tracing::info!(
        set = r.name(),
        path,
        source = src,
        replicas = misses.len(),
        "suspect marks resolved: a client died mid-change; heal makes the others like the \
         source"
    );
    Ok(())
}

/// How target `t`'s entry differs from the source's: the flags it needs, and where its bytes
/// must be copied from to the end (a size that differs).
async fn compare(
    kids: &[LayerRef],
    src: usize,
    t: usize,
    path: &str,
    sa: Option<&Attr>,
    ta: Option<&Attr>,
) -> (u32, Option<u64>) {
    let (sa, ta) = match (sa, ta) {
        (None, None) => return (0, None),
        (Some(s), Some(t)) => (s, t),
        _ => return (m::ENTRY, None),
    };
    let kind = |a: &Attr| a.mode & libc::S_IFMT;
    if kind(sa) != kind(ta) || sa.rdev != ta.rdev {
        return (m::ENTRY, None);
    }
    if kind(sa) == libc::S_IFLNK {
        let cx = &Ctx::NONE;
        let (a, b) = (
            kids[src].readlink(cx, path).await,
            kids[t].readlink(cx, path).await,
        );
        if a != b {
            return (m::ENTRY, None);
        }
    }
    let meta = if (sa.mode, sa.uid, sa.gid) != (ta.mode, ta.uid, ta.gid) {
        m::META
    } else {
        0
    };
    let from = (kind(sa) == libc::S_IFREG && sa.size != ta.size).then(|| sa.size.min(ta.size));
    (meta, from)
}

/// Marks each miss (target, ranges, flags) on every replica in `up` but its target.
async fn mark_misses(
    kids: &[LayerRef],
    up: &[usize],
    path: &str,
    misses: &[(u32, Option<RangeSet>, u32)],
) -> FopResult<()> {
    let cx = &Ctx::NONE;
    let mut marks: Vec<(usize, Mark)> = Vec::new();
    let mut flags: Vec<(usize, FlagMark)> = Vec::new();
    for (t, ranges, f) in misses {
        for h in up.iter().copied().filter(|h| *h != *t as usize) {
            for (offset, len) in ranges.iter().flat_map(|r| r.iter()) {
                let target = *t;
                marks.push((
                    h,
                    Mark {
                        target,
                        offset,
                        len,
                    },
                ));
            }
            if *f != 0 {
                let target = *t;
                flags.push((h, FlagMark { target, flags: *f }));
            }
        }
    }
    let mut futs = Vec::new();
    futs.extend(
        marks
            .iter()
            .map(|(h, v)| Some(kids[*h].mark_add(cx, path, v))),
    );
    futs.extend(
        flags
            .iter()
            .map(|(h, v)| Some(kids[*h].flag_add(cx, path, v))),
    );
    for r in join_all(futs).await.into_iter().flatten() {
        r?;
    }
    Ok(())
}

/// Clears the suspect marks read, on each holder, unless it added one since.
async fn clear_suspects(kids: &[LayerRef], path: &str, seen: &Seen) -> FopResult<()> {
    let cx = &Ctx::NONE;
    for (h, gen, has_flags) in &seen.gens {
        // Flags first: the generation lasts while either kind is held.
        if *has_flags {
            let v = CondFlag {
                target: m::ANY,
                flags: m::ENTRY | m::META,
                gen: *gen,
                data: 0,
            };
            match kids[*h].flag_clear_if(cx, path, &v).await {
                Ok(()) | Err(EAGAIN) => {}
                Err(e) => return Err(e),
            }
        }
        let v = CondMark {
            target: m::ANY,
            offset: 0,
            len: m::WHOLE,
            gen: *gen,
        };
        match kids[*h].mark_clear_if(cx, path, &v).await {
            Ok(()) | Err(EAGAIN) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
