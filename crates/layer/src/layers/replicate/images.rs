//! An image's lease and dirty records across replicas (the bricks keep them: see the marks
//! layer's `images`).
//!
//! - **Lease**: asked of every replica that is up. Granted when a quorum of members granted it
//!   (two quorums cannot both exist). Short of one, the grants this very ask made are given
//!   back (not the ones it only renewed), so two askers never block each other for long.
//! - **Dirty records**: started and stopped on every replica (a quorum must take it). A write
//!   acknowledged reached a quorum, so the ranges any `n - quorum + 1` replicas recorded cover
//!   every acknowledged write: the answer is their union, or `ENOENT` (copy everything) when
//!   fewer replicas know the record (restarted bricks forget it).

use kiln_proto::ops::{DIRTY_GET, LEASE_ACQUIRE, LEASE_RELEASE};

use super::{quorum_errno, RepFd, Replicate};
use crate::marks::RangeSet;
use crate::{errno, Ctx, ExtentList, Fd, FopResult, Fut, LayerRef, LeaseState};

impl Replicate {
    /// LEASE on every replica.
    pub(super) async fn lease_all(
        &self,
        cx: &Ctx,
        rfd: &RepFd,
        cmd: u32,
        ttl_ms: u32,
        holder: &str,
    ) -> FopResult<LeaseState> {
        let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, LeaseState> {
            let k = k.clone();
            Box::pin(async move { k.lease(cx, &fd, cmd, ttl_ms, holder).await })
        };
        let res = self.fan_out(cx, rfd, &op).await;
        let mut granted = Vec::new();
        let mut refused = None;
        let mut errs = Vec::new();
        for (i, r) in res.into_iter().enumerate() {
            match r {
                Some(Ok(s)) if s.granted => granted.push((i, s)),
                Some(Ok(s)) => refused = Some(s),
                Some(Err(e)) => errs.push(e),
                None => {}
            }
        }
        if cmd != LEASE_ACQUIRE {
            // A release or a question: any answer will do, a holder's first.
            return match (refused, granted.into_iter().next()) {
                (Some(s), _) if cmd != LEASE_RELEASE => Ok(s),
                (_, Some((_, s))) => Ok(s),
                (Some(s), None) => Ok(s),
                (None, None) => Err(quorum_errno(&errs)),
            };
        }
        let counted = granted
            .iter()
            .filter(|(i, _)| !self.kids[*i].joining())
            .count();
        if counted >= self.quorum() {
            // A quorum: no one else can hold one too (a minority that refused is behind on
            // the lease, and its replicas are healed from the quorum's).
            let best = granted.into_iter().max_by_key(|(_, s)| s.token);
            return Ok(best.expect("a quorum is at least one").1);
        }
        // Give back what this very ask took (not what it only renewed), so that it blocks
        // nobody.
        let give_back = move |k: &LayerRef, fd: Fd| -> Fut<'_, LeaseState> {
            let k = k.clone();
            Box::pin(async move { k.lease(cx, &fd, LEASE_RELEASE, ttl_ms, holder).await })
        };
        for (i, _) in granted.iter().filter(|(_, s)| s.fresh) {
            let _ = self.on_child(cx, rfd, *i, &give_back).await;
        }
        match refused {
            Some(s) => Ok(s),
            None => {
                tracing::warn!(path = rfd.path, holder, "lease not granted: no quorum");
                Err(quorum_errno(&errs))
            }
        }
    }

    /// DIRTY on every replica; a question's answer is the union described above.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn dirty_all(
        &self,
        cx: &Ctx,
        rfd: &RepFd,
        cmd: u32,
        name: &str,
        offset: u64,
        len: u64,
    ) -> FopResult<ExtentList> {
        let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, ExtentList> {
            let k = k.clone();
            Box::pin(async move { k.dirty(cx, &fd, cmd, name, offset, len).await })
        };
        let res = self.fan_out(cx, rfd, &op).await;
        let mut lists = Vec::new();
        let mut errs = Vec::new();
        for (i, r) in res.into_iter().enumerate() {
            match r {
                Some(Ok(l)) if !self.kids[i].joining() => lists.push(l),
                Some(Ok(_)) => {}
                Some(Err(e)) => errs.push(e),
                None => errs.push(errno::ENOTCONN),
            }
        }
        if cmd != DIRTY_GET {
            return if lists.len() >= self.quorum() {
                Ok(ExtentList::default())
            } else {
                Err(quorum_errno(&errs))
            };
        }
        let needed = self.kids.len() + 1 - self.quorum().min(self.kids.len());
        if lists.len() < needed {
            // Too few replicas know the record to be sure of every write: "everything".
            return Err(errno::ENOENT);
        }
        let mut set = RangeSet::default();
        let mut end = offset.saturating_add(len);
        for l in &lists {
            end = end.min(set.add_runs(offset, &l.runs.0));
        }
        Ok(set.runs(offset, end - offset))
    }
}
