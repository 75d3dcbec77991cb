//! A migration's session on a replicated file ([`crate::marks::SESSION_MIGRATE`] …): a
//! rebalance moving the file to another subvolume needs what clients changed on *any* replica,
//! and its freeze on all of them, so both go to every replica (all of them up, or none).

use crate::exec::join_all;
use crate::marks::{self as m, HealInfo, HealReq, RangeSet};
use crate::{errno, Ctx, FopResult};

use super::Replicate;

impl Replicate {
    /// HEAL_SESSION on every replica: ending is best effort; anything else needs them all.
    pub(super) async fn session_all(&self, cx: &Ctx, path: &str, req: &HealReq) -> FopResult<()> {
        let end = req.begin == m::SESSION_END;
        if !end && !self.kids.iter().all(|k| k.up() && !k.joining()) {
            return Err(errno::ENOTCONN);
        }
        let futs = self
            .kids
            .iter()
            .map(|k| Some(k.heal_session(cx, path, req)))
            .collect();
        for r in join_all(futs).await.into_iter().flatten() {
            if !end {
                r?;
            }
        }
        Ok(())
    }

    /// HEAL_INFO from every replica: live only if live on all; the ranges of all.
    pub(super) async fn info_all(&self, cx: &Ctx, path: &str) -> FopResult<HealInfo> {
        let futs = self
            .kids
            .iter()
            .map(|k| Some(k.heal_info(cx, path, &())))
            .collect();
        let mut live = 1;
        let mut busy = 0;
        let mut ranges = RangeSet::default();
        for r in join_all(futs).await {
            let i = r.ok_or(errno::ENOTCONN)??;
            live &= i.live;
            busy |= i.busy;
            for r in i.skipped.0 {
                ranges.add(r.offset, r.len);
            }
        }
        let mut info = HealInfo {
            live,
            busy,
            ..HealInfo::default()
        };
        info.skipped.0 = ranges
            .iter()
            .map(|(offset, len)| m::Range { offset, len })
            .collect();
        Ok(info)
    }
}
