//! What the replicas that are up say about a file: the ranges and flags each target is
//! behind by, the generations of those marks, and which replicas hold what others missed.

use crate::exec::join_all;
use crate::marks::{self as m, RangeSet};
use crate::{errno, Ctx, FopResult, LayerRef};

/// One file's marks as the replicas that are up hold them, seen from one target.
pub(super) struct View {
    /// Marks against each replica, over every up replica's page (a listing cut short counts
    /// as marked from its cut to the end of the file).
    pub(super) behind: Vec<RangeSet>,
    /// The target's listed marks: what can be copied now.
    pub(super) need: RangeSet,
    /// Per replica that answered: the generation of its marks for the target (0: none).
    pub(super) gens: Vec<Option<u64>>,
    /// Up replicas that hold marks for the target.
    pub(super) holders: Vec<usize>,
    /// Flags ([`m::ENTRY`], [`m::META`]) against each replica, over every up replica's page.
    pub(super) flagged: Vec<u32>,
    /// Up replicas that hold flags for the target.
    pub(super) flag_holders: Vec<usize>,
}

impl View {
    pub(super) async fn read(
        kids: &[LayerRef],
        up: &[usize],
        path: &str,
        target: usize,
    ) -> FopResult<View> {
        let futs = up
            .iter()
            .map(|i| Some(kids[*i].pending(&Ctx::NONE, path, &())))
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
            let page = r.unwrap_or(Err(errno::ENOTCONN))?;
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
