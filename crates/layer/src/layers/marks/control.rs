//! The control API behind the replication control fops heal and replicate speak: pending
//! pages, the index, marks and flags, locks and sessions.

use std::collections::BTreeMap;

use crate::marks::{
    self as m, CondFlag, CondMark, FlagMark, HealReq, IndexEntry, IndexPage, LockReq, Mark,
    PendingPage, RangeSet,
};
use crate::{fail, Fut};
use kiln_proto::codec::Seq;

use super::locks::span;
use super::*;

impl Marks {
    /// True when this brick holds marks on `path` (some replica is behind for it).
    pub(super) fn has_marks(&self, path: &str) -> bool {
        let st = self.store();
        st.records.get(path).is_some_and(|r| !r.is_empty())
            || st.flags.get(path).is_some_and(|f| !f.is_empty())
    }

    pub(super) fn pending_page(&self, path: &str) -> PendingPage {
        let st = self.store();
        let mut page = PendingPage {
            targets: Seq(Vec::new()),
            more: false,
        };
        let empty = BTreeMap::new();
        let records = st.records.get(path).unwrap_or(&empty);
        let flags = st.flags.get(path);
        let mut targets: Vec<u32> = records.keys().copied().collect();
        targets.extend(flags.into_iter().flat_map(|f| f.keys().copied()));
        targets.sort_unstable();
        targets.dedup();
        if !targets.is_empty() {
            // The page's room, shared among the targets (each has a few marks, mostly).
            let per = ((m::PAGE_BYTES / targets.len().max(1)).saturating_sub(40) / 16).max(1);
            let none = RangeSet::default();
            for t in &targets {
                let ranges = records.get(t).unwrap_or(&none);
                let mut tr = m::TargetRanges {
                    target: *t,
                    ranges: Seq(Vec::new()),
                    gen: st.gen(path, *t),
                    cut: m::WHOLE,
                    flags: flags.and_then(|f| f.get(t)).copied().unwrap_or(0),
                };
                for (i, (offset, len)) in ranges.iter().enumerate() {
                    if i == per {
                        tr.cut = offset;
                        page.more = true;
                        break;
                    }
                    tr.ranges.0.push(m::Range { offset, len });
                }
                page.targets.0.push(tr);
            }
        }
        page
    }

    pub(super) fn index_page(&self) -> IndexPage {
        let st = self.store();
        let mut page = IndexPage {
            entries: Seq(Vec::new()),
            more: false,
        };
        let mut size = 0;
        // Paths with byte marks or flags, in path order (a parent before what is in it).
        let mut paths: Vec<&String> = st.records.keys().chain(st.flags.keys()).collect();
        paths.sort_unstable();
        paths.dedup();
        let none = BTreeMap::new();
        'outer: for path in paths {
            let records = st.records.get(path).unwrap_or(&none);
            let flags = st.flags.get(path);
            let mut targets: Vec<u32> = records.keys().copied().collect();
            targets.extend(flags.into_iter().flat_map(|f| f.keys().copied()));
            targets.sort_unstable();
            targets.dedup();
            for t in targets {
                let need = 40 + path.len();
                if size + need > m::PAGE_BYTES {
                    page.more = true;
                    break 'outer;
                }
                size += need;
                let ranges = records.get(&t);
                page.entries.0.push(IndexEntry {
                    path: path.clone(),
                    target: t,
                    ranges: ranges.map_or(0, |r| r.count() as u64),
                    bytes: ranges.map_or(0, |r| r.bytes()),
                    flags: flags.and_then(|f| f.get(&t)).copied().unwrap_or(0),
                });
            }
        }
        page
    }

    /// MARK_ADD (`b'A'`) or MARK_CLEAR (`b'C'`).
    pub(super) fn apply_mark(&self, kind: u8, path: &str, mark: &Mark) -> FopResult<()> {
        crate::layers::posix::brick::check_path(path)?;
        self.apply(&[(kind, path, mark.target, mark.offset, mark.len)])
    }

    /// FLAG_ADD.
    pub(super) fn apply_flag(&self, path: &str, f: &FlagMark) -> FopResult<()> {
        crate::layers::posix::brick::check_path(path)?;
        self.apply(&[(b'F', path, f.target, u64::from(f.flags), 0)])
    }

    /// FLAG_CLEAR_IF.
    pub(super) fn apply_flag_clear(&self, path: &str, c: &CondFlag) -> FopResult<()> {
        crate::layers::posix::brick::check_path(path)?;
        self.clear_flags_if(path, c.target, c.gen, c.flags, c.data == 1)
    }

    /// MARK_CLEAR_IF.
    pub(super) fn apply_mark_clear(&self, path: &str, c: &CondMark) -> FopResult<()> {
        crate::layers::posix::brick::check_path(path)?;
        self.clear_if(path, c.target, c.gen, c.offset, c.len)
    }

    /// HEAL_SESSION: begins (afresh) or ends the caller's session, or one of a migration's
    /// steps ([`m::SESSION_HEAL`] …).
    pub(super) fn apply_session<'a>(
        &'a self,
        owner: u64,
        path: &'a str,
        req: &HealReq,
    ) -> Fut<'a, ()> {
        if let Err(e) = crate::layers::posix::brick::check_path(path) {
            return fail(e);
        }
        match req.begin {
            m::SESSION_END => self.heal_end(owner, path),
            m::SESSION_HEAL => {
                return Box::pin(std::future::ready(self.heal_begin(owner, path, false)))
            }
            m::SESSION_MIGRATE => {
                return Box::pin(std::future::ready(self.heal_begin(owner, path, true)))
            }
            m::SESSION_DIRTY => return Box::pin(std::future::ready(self.dirty(owner, path))),
            m::SESSION_FREEZE => return Box::pin(self.freeze(owner, path)),
            m::SESSION_MOVED => return Box::pin(std::future::ready(self.moved(owner, path))),
            _ => return fail(crate::errno::EINVAL),
        }
        Box::pin(std::future::ready(Ok(())))
    }

    /// HEAL_LOCK: `lock` 1 takes the range (waiting for writes in flight), else drops it.
    pub(super) fn lock_req<'a>(&'a self, owner: u64, path: &'a str, req: &LockReq) -> Fut<'a, ()> {
        if let Err(e) = crate::layers::posix::brick::check_path(path) {
            return fail(e);
        }
        let (start, end) = span(req.offset, req.len);
        if req.lock == 1 {
            Box::pin(self.lock(owner, path, start, end))
        } else {
            self.unlock(owner, path, start, end);
            Box::pin(std::future::ready(Ok(())))
        }
    }
}
