//! Snapshots of an image across replicas: the same barrier, the same copy, on every replica.
//!
//! A snapshot needs every replica up and current for the file (a replica behind would copy an
//! old image). Each replica first copies the file with writers running and records what
//! changes from then on (`SNAP_PREPARE`); then the barrier is raised on all of them
//! (`SNAP_FREEZE`); once each answered — every change already past its gate finished — each
//! copies again what changed since its first copy (`SNAP_TAKE`) and the barriers are lifted
//! (`SNAP_THAW`, by the caller, also after a failure; they lapse by themselves too).
//!
//! The barriers go up one replica at a time, and a writer sends a change to each replica on a
//! connection of its own, so one replica's copy may lack a change another's holds, two ways:
//! - the change waited at this replica's barrier, but ran on a replica frozen a moment later.
//!   Each replica answers the ranges changes waited on.
//! - the change ran on another replica before that one's barrier, and was still on its way to
//!   this one (in a socket, or queued behind other requests) until after this one's barrier
//!   was lifted: it never waited here. Every change of a file's bytes carries a stamp, the
//!   same to each replica ([`super::stamps`]); each replica answers the stamped changes its
//!   copy holds that are not settled everywhere yet, and a change one lists and another has not
//!   run is lacking there.
//!
//! For every piece of those ranges, a replica that lacks nothing there becomes the source (it
//! holds every change that finished anywhere before the barrier — every acknowledged write
//! among them, since a write is acknowledged only after every replica ran it or its miss was
//! marked): the snapshot is marked on it as missed by the others there, and heal makes them
//! alike (a few ranges, moments). Where every replica lacks something, the first is the
//! source: the copies then agree on one order the changes could have run in. Until heal has
//! run, reads of the snapshot go to the source (marks keep them away from the others), and a
//! clone waits (`EAGAIN`), so every clone starts from copies that agree.
//!
//! The snapshot is refused (`EAGAIN`, its copies removed) where the copies cannot be compared
//! so: a replica forgot stamped changes (far too many in flight), or the image has marks now
//! (a replica missed a change while the snapshot was taken, a lack no stamp shows).

use kiln_proto::ops::{snapshot_path, SNAP_CLONE, SNAP_FREEZE, SNAP_PREPARE, SNAP_TAKE, SNAP_THAW};
use kiln_proto::stamp::SnapReply;

use super::stamps::lacking;
use super::{missing, Miss, RepFd, Replicate};
use crate::marks::{self as m, RangeSet};
use crate::{errno, Ctx, Fd, FopResult, Fut, LayerRef};

/// Try again: a replica is away or behind, or a snapshot is still being made alike.
const EAGAIN: u32 = libc::EAGAIN as u32;

/// For each piece of the ranges some replica's copy lacks changes in: the replica to copy it
/// from (one that lacks none there, else the first) and the piece (offset, len).
pub(super) fn sources(lacks: &[RangeSet]) -> Vec<(usize, u64, u64)> {
    let mut cuts: Vec<u64> = lacks
        .iter()
        .flat_map(|s| s.iter())
        .flat_map(|(o, l)| [o, if l == m::WHOLE { u64::MAX } else { o + l }])
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        let len = if b == u64::MAX { m::WHOLE } else { b - a };
        let lack: Vec<bool> = lacks.iter().map(|s| s.overlaps(a, len)).collect();
        if !lack.contains(&true) {
            continue;
        }
        let from = lack.iter().position(|h| !h).unwrap_or(0);
        match out.last_mut() {
            Some((f, o, l)) if *f == from && *l != m::WHOLE && *o + *l == a => *l = len,
            _ => out.push((from, a, len)),
        }
    }
    out
}

impl Replicate {
    /// SNAP on every replica.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn snap_all(
        &self,
        cx: &Ctx,
        rfd: &RepFd,
        cmd: u32,
        name: &str,
        to: &str,
        ttl_ms: u32,
    ) -> FopResult<SnapReply> {
        let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, SnapReply> {
            let k = k.clone();
            Box::pin(async move { k.snap(cx, &fd, cmd, name, to, ttl_ms).await })
        };
        if cmd != SNAP_THAW {
            let away = (0..self.kids.len()).any(|i| !self.kids[i].up() || self.kids[i].joining());
            if away || missing(rfd) != 0 || rfd.state.unread() != 0 {
                tracing::warn!(
                    path = rfd.path,
                    "snapshot refused: a replica is away or behind"
                );
                return Err(EAGAIN);
            }
        }
        if cmd == SNAP_CLONE && self.healing(cx, &snapshot_path(&rfd.path, name)).await? {
            return Err(EAGAIN);
        }
        let res = self.fan_out(cx, rfd, &op).await;
        let all = res.iter().all(|r| matches!(r, Some(Ok(_))));
        let first_err = || {
            res.iter()
                .find_map(|r| match r {
                    Some(Err(e)) => Some(*e),
                    _ => None,
                })
                .unwrap_or(errno::ENOTCONN)
        };
        match cmd {
            SNAP_THAW => Ok(SnapReply::default()),
            SNAP_PREPARE | SNAP_FREEZE | SNAP_TAKE | SNAP_CLONE if !all => {
                // What some replicas made, the others did not: take it back.
                let made = match cmd {
                    SNAP_TAKE if !to.is_empty() => Some(to.to_owned()),
                    SNAP_TAKE => Some(snapshot_path(&rfd.path, name)),
                    // The first copy is made under the part name.
                    SNAP_PREPARE => Some(format!("{}~", snapshot_path(&rfd.path, name))),
                    SNAP_CLONE => Some(to.to_owned()),
                    _ => None,
                };
                for (i, r) in res.iter().enumerate() {
                    if let (Some(p), Some(Ok(_))) = (&made, r) {
                        let _ = self.kids[i].unlink(cx, p).await;
                    }
                }
                Err(first_err())
            }
            SNAP_TAKE => {
                let snap = if to.is_empty() {
                    snapshot_path(&rfd.path, name)
                } else {
                    to.to_owned()
                };
                let replies: Vec<&SnapReply> = res.iter().flatten().flatten().collect();
                let refuse = if replies.iter().any(|r| r.lost) {
                    Some("a replica forgot changes it ran (too many in flight)")
                } else if replies.iter().any(|r| r.marked) {
                    Some("a replica missed a change meanwhile (heal it first)")
                } else {
                    None
                };
                if let Some(why) = refuse {
                    tracing::warn!(path = rfd.path, snapshot = snap, "snapshot refused: {why}");
                    for k in &self.kids {
                        let _ = k.unlink(cx, &snap).await;
                    }
                    return Err(EAGAIN);
                }
                // A replica's copy lacks what waited at its barrier and what it has not run.
                let mut lacks = lacking(&replies);
                for (l, r) in lacks.iter_mut().zip(&replies) {
                    l.add_runs(0, &r.blocked.runs.0);
                }
                self.make_alike(cx, &snap, &lacks).await
            }
            _ => Ok(SnapReply::default()),
        }
    }

    /// Marks where the replicas' copies differ (`lacks`: per replica, the ranges its copy
    /// lacks changes in; see the module documentation); answers those ranges.
    async fn make_alike(&self, cx: &Ctx, snap: &str, lacks: &[RangeSet]) -> FopResult<SnapReply> {
        let mut all = RangeSet::default();
        for (from, offset, len) in sources(lacks) {
            let others: Vec<usize> = (0..self.kids.len()).filter(|i| *i != from).collect();
            self.mark(cx, snap, &[from], &others, Miss::bytes(offset, len))
                .await?;
            all.add(offset, len);
        }
        if !all.is_empty() {
            tracing::info!(
                snapshot = snap,
                ranges = all.count(),
                "snapshot copies made alike by heal"
            );
        }
        Ok(SnapReply {
            blocked: all.extents(),
            ..SnapReply::default()
        })
    }

    /// True while any replica holds marks on `path` (heal has not made its copies alike).
    async fn healing(&self, cx: &Ctx, path: &str) -> FopResult<bool> {
        for (_, p) in self.pages_of_up(cx, path).await {
            match p {
                Ok(p) if !p.targets.0.is_empty() => return Ok(true),
                Ok(_) | Err(errno::ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(r: &[(u64, u64)]) -> RangeSet {
        let mut s = RangeSet::default();
        for (o, l) in r {
            s.add(*o, *l);
        }
        s
    }

    #[test]
    fn each_piece_comes_from_a_replica_that_held_nothing_back_there() {
        // Replica 1 held back [0, 10); replicas 0 and 1 both held back [20, 30); replica 2
        // held back everything from 25 on.
        let b = [
            set(&[(20, 10)]),
            set(&[(0, 10), (20, 10)]),
            set(&[(25, m::WHOLE)]),
        ];
        assert_eq!(sources(&b), vec![(0, 0, 10), (2, 20, 5), (0, 25, m::WHOLE)]);
        assert!(sources(&[set(&[]), set(&[])]).is_empty());
        // Held back everywhere: the first replica, whose copy the others then match.
        assert_eq!(sources(&[set(&[(5, 5)]), set(&[(5, 5)])]), vec![(0, 5, 5)]);
    }
}
