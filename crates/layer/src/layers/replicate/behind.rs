//! Which replicas are behind for a file, or for some bytes of it, by the marks the replicas
//! that are up hold.

use super::{bit, RepFd, Replicate};
use crate::exec::join_all;
use crate::marks as m;
use crate::marks::PendingPage;
use crate::{Ctx, FopResult};

impl Replicate {
    /// The first page of `path`'s marks on each replica that is up.
    pub(super) async fn pages_of_up(
        &self,
        cx: &Ctx,
        path: &str,
    ) -> Vec<(usize, FopResult<PendingPage>)> {
        let up: Vec<usize> = (0..self.kids.len())
            .filter(|i| self.kids[*i].up())
            .collect();
        let futs = up
            .iter()
            .map(|i| Some(self.kids[*i].pending(cx, path, &())))
            .collect();
        let pages = join_all(futs).await.into_iter().flatten();
        up.into_iter().zip(pages).collect()
    }

    /// Asks every replica in `which` (those up) for its marks on `path`: the replicas that
    /// are behind, and those that serve no read because the file is suspect ([`m::ANY`]): it
    /// is read from its suspect source alone until heal has resolved its suspect marks.
    pub(super) async fn behind(&self, cx: &Ctx, path: &str, which: &[usize]) -> (u32, u32) {
        let futs = which
            .iter()
            .map(|i| Some(self.kids[*i].pending(cx, path, &())))
            .collect();
        let mut bad = 0;
        let mut suspect = false;
        for page in join_all(futs).await.into_iter().flatten().flatten() {
            for t in page.targets.0 {
                let named = t.flags & m::ENTRY != 0;
                let marked = !t.ranges.0.is_empty() || named;
                if (t.target as usize) < self.kids.len() && marked {
                    bad |= bit(t.target as usize);
                }
                suspect |= t.target == m::ANY && marked;
            }
        }
        let mut unread = 0;
        if suspect {
            let members = which.iter().copied().filter(|i| !self.kids[*i].joining());
            if let Some(src) = m::suspect_source(members, bad) {
                unread = !bit(src) & ((1u64 << self.kids.len()) - 1) as u32 & !bad;
            }
        }
        (bad, unread)
    }

    /// Replicas behind for the bytes `[offset, offset+len)` of `path` by the marks of the
    /// replicas that are up: a replica that missed other ranges of the file can still serve
    /// these. A name miss, or a listing cut before the end of the range, counts as behind.
    pub(super) async fn behind_at(&self, cx: &Ctx, path: &str, offset: u64, len: u64) -> u32 {
        let end = offset.saturating_add(len);
        let mut bad = 0;
        for (i, page) in self.pages_of_up(cx, path).await {
            let Ok(page) = page else {
                // Marks unknown on this replica: it serves no read the marks decide.
                bad |= bit(i);
                continue;
            };
            for t in page.targets.0 {
                let hit = t.flags & m::ENTRY != 0
                    || t.cut < end
                    || t.ranges.0.iter().any(|r| {
                        let r_end = if r.len == m::WHOLE {
                            u64::MAX
                        } else {
                            r.offset.saturating_add(r.len)
                        };
                        r.offset < end && offset < r_end
                    });
                if hit && (t.target as usize) < self.kids.len() {
                    bad |= bit(t.target as usize);
                }
            }
        }
        bad
    }

    /// The replicas to try for a read of `[offset, offset+len)`: those not known to be
    /// behind for the file, or — when that leaves none — those the marks show hold these
    /// bytes (a file whose replicas each missed something while others were away).
    pub(super) async fn read_candidates(
        &self,
        cx: &Ctx,
        rfd: &RepFd,
        offset: u64,
        len: u64,
    ) -> Vec<usize> {
        let order = self.read_order(rfd.state.unread(), rfd.prefer);
        if !order.is_empty() {
            return order;
        }
        let bad = self.behind_at(cx, &rfd.path, offset, len).await;
        self.read_order(bad, rfd.prefer)
    }
}
