//! What replicas missed, as the replicate layer and the bricks' marks layer speak of it.
//!
//! When a change reaches some replicas of a file but not all, the replicate layer records, on
//! every replica that has it, which byte ranges each other replica missed ("pending marks").
//! A replica with marks against it never serves a read of that file; heal copies exactly the
//! marked ranges to it and then clears them.
//!
//! Marks travel as the replication control fops (see [`crate::for_each_control_fop`]), which
//! the brick's marks layer answers itself (they never reach the file system); each is typed,
//! counted by io-stats and shown by `kiln volume profile` like any fop:
//!
//! | fop              | argument     | reply          | meaning                                   |
//! |------------------|--------------|----------------|-------------------------------------------|
//! | `mark_add`       | [`Mark`]     |                | `target` missed `[offset, offset+len)`     |
//! | `mark_clear`     | [`Mark`]     |                | `target` has that range now                |
//! | `mark_clear_if`  | [`CondMark`] |                | the same, unless a mark for `target` was added since `gen` (then `EAGAIN`) |
//! | `flag_add`       | [`FlagMark`] |                | `target` missed an [`ENTRY`] or [`META`] change of this path |
//! | `flag_clear_if`  | [`CondFlag`] |                | those flags are healed, unless a mark for `target` was added since `gen` (then `EAGAIN`) |
//! | `pending`        |              | [`PendingPage`]| this file's marks                          |
//! | `pending_index`  |              | [`IndexPage`]  | (on the root) files with marks             |
//! | `heal_lock`      | [`LockReq`]  |                | heal's range lock on the file              |
//! | `heal_session`   | [`HealReq`]  |                | begin or end a heal session on the file    |
//! | `heal_info`      |              | [`HealInfo`]   | the caller's session on the file           |
//! | `heal_open`      | open flags   | a handle       | a handle whose writes are heal's (below)   |
//! | `member`         | [`MemberReq`]| [`MemberState`]| is the brick new (no identity)? heal makes it a member after a full rebuild, or new again |
//!
//! **Suspect marks** ([`ANY`]) say that some replica may differ, not which: a brick records
//! them for the recent changes of a client connection that ended without releasing its
//! handles (the client was killed mid-change). Heal resolves them (`heal::suspect`).
//!
//! One data fop carries marks too: `write_marked` is a write that, done, records that the
//! replicas in its `missed` bits missed all of it — what a `mark_add` after the write would
//! say, without its round trip. The replicate layer sends it when it knows before writing that
//! a replica will miss the write: the file is missing there (a new brick before heal made
//! it, or a create it missed), so each write reaches the others as one request.
//!
//! **Entry and metadata marks** ("flags", per path and target, beside the byte ranges):
//! [`ENTRY`] on a path says the target missed a change of the *name* — it was created (file,
//! directory, symlink, hard link), removed, or renamed from or to — so the target may hold
//! the wrong thing there, or something that should be gone, or nothing; heal makes the
//! target's entry match the source's (see [`crate::heal`]). [`META`] says the target missed a
//! change of the path's attributes (mode, owner, times, xattrs). Flags are marked on the
//! name itself, not on its parent directory, so heal touches exactly the names that changed.
//! A mark of any kind (bytes or flags) for a target gives it a new generation.
//!
//! `len == WHOLE` means the whole file (it was created, truncated or punched while the replica
//! was away). A `pending` or `pending_index` reply holds at most [`PAGE_BYTES`]; a heal that clears what it healed
//! and asks again sees the rest. A pending page shares its room among the targets, and says
//! per target where its listing was cut ([`TargetRanges::cut`]), so a reader always knows which
//! part of a target's marks it has not seen.
//!
//! **Heal sessions** (on the replica being healed). Between a heal's `begin` and `end` on a
//! file, the brick records the byte ranges that changes from other connections (client writes,
//! truncates, fallocate, discard) touch — and those in flight when the session begins. Heal
//! writes through a handle opened with `heal_open`; the brick writes only the parts of such
//! a write that no client change touched since `begin` (the client's data there is newer than
//! what heal read from the source), reports the write as short by the bytes it skipped, and
//! lists them in [`HealInfo::skipped`]. A heal size change is refused (`EAGAIN`) when a client
//! touched the range it would cut. Without a live session (it lapses [`LOCK_LEASE`] after the
//! heal's last request on the file) a heal write fails with `ETIMEDOUT`.

#![allow(missing_docs)] // wire struct fields are described in the table above

use std::collections::BTreeMap;

/// Flag: the target missed a change of this name (create, remove, rename from or to).
pub const ENTRY: u32 = 1;
/// Flag: the target missed a change of this path's attributes or xattrs.
pub const META: u32 = 2;
/// Flag, on the volume root only: a full rebuild of the target is under way (see
/// [`crate::heal`]); cleared when it has finished and the target is a member again.
pub const REBUILD: u32 = 4;
/// A range length meaning "to the end of the file, whatever its size".
pub const WHOLE: u64 = u64::MAX;
/// The errno of a change heal made to a name on the target within its heal session that the
/// brick skipped: a client changed that part of the name since the session began, so the
/// target's is newer (`EALREADY`). Heal counts it as healed.
pub const SKIPPED: u32 = 114;
/// The target of a *suspect* mark: some replica may differ from the others here, and which
/// one is right is not known — a client that was changing the file or name died before it
/// could mark the replicas it missed (see the brick's `recent` records). Heal turns suspect
/// marks into ordinary ones from one replica ([`suspect_source`]) and copies; until then
/// readers read only that replica. Replicas that do not know this target ignore it.
pub const ANY: u32 = u32::MAX;

/// The replica that suspect marks are resolved from, and that alone serves reads of a
/// suspect file until then: the first of `candidates` (replicas that are up and members, in
/// graph order) that no mark says is behind for the file (`behind`, a bit per replica). Heal
/// and every reader apply the same rule, so they agree while the same replicas are up.
pub fn suspect_source(candidates: impl IntoIterator<Item = usize>, behind: u32) -> Option<usize> {
    candidates.into_iter().find(|i| behind & (1 << i) == 0)
}
/// Most bytes of marks in one `pending` or `pending_index` reply.
pub const PAGE_BYTES: usize = 60 * 1024;
/// How long a heal lock lasts unless dropped or renewed: a heal that dies cannot hold writes
/// back for longer.
pub const LOCK_LEASE: std::time::Duration = std::time::Duration::from_secs(10);

pub use kiln_proto::marks::*;

/// A set of byte ranges, kept merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    /// start → end (exclusive; `u64::MAX` is the end of any file).
    map: BTreeMap<u64, u64>,
}

fn end_of(offset: u64, len: u64) -> u64 {
    if len == WHOLE {
        u64::MAX
    } else {
        offset.saturating_add(len)
    }
}

impl RangeSet {
    /// Adds `[offset, offset+len)`, merging with neighbours it touches.
    pub fn add(&mut self, offset: u64, len: u64) {
        let (mut start, mut end) = (offset, end_of(offset, len));
        if start >= end {
            return;
        }
        // Merge with every range that overlaps or touches [start, end].
        let touching: Vec<(u64, u64)> = self
            .map
            .range(..=end)
            .rev()
            .take_while(|(_, e)| **e >= start)
            .map(|(s, e)| (*s, *e))
            .collect();
        for (s, e) in touching {
            self.map.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        self.map.insert(start, end);
    }

    /// Removes `[offset, offset+len)`.
    pub fn remove(&mut self, offset: u64, len: u64) {
        let (start, end) = (offset, end_of(offset, len));
        if start >= end {
            return;
        }
        let hit: Vec<(u64, u64)> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(_, e)| **e > start)
            .map(|(s, e)| (*s, *e))
            .collect();
        for (s, e) in hit {
            self.map.remove(&s);
            if s < start {
                self.map.insert(s, start);
            }
            if e > end {
                self.map.insert(end, e);
            }
        }
    }

    /// True when nothing is marked.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Number of ranges.
    pub fn count(&self) -> usize {
        self.map.len()
    }

    /// Marked bytes (a range to the end of the file counts as its start's distance to 2^64).
    pub fn bytes(&self) -> u64 {
        self.map
            .iter()
            .fold(0u64, |a, (s, e)| a.saturating_add(e - s))
    }

    /// The ranges as (offset, len), `len == WHOLE` for a range to the end of the file.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(s, e)| {
            if *e == u64::MAX {
                (*s, WHOLE)
            } else {
                (*s, e - s)
            }
        })
    }

    /// The parts of `[offset, offset+len)` in the set, as (offset, len); `len == WHOLE` for a
    /// part to the end of the file.
    pub fn inside(&self, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let end = end_of(offset, len);
        let mut out = Vec::new();
        if offset >= end {
            return out;
        }
        let first = self
            .map
            .range(..=offset)
            .next_back()
            .map_or(offset, |(s, _)| *s);
        for (s, e) in self.map.range(first..end) {
            let (a, b) = ((*s).max(offset), (*e).min(end));
            if a < b {
                out.push((a, if b == u64::MAX { WHOLE } else { b - a }));
            }
        }
        out
    }

    /// The parts of `[offset, offset+len)` not in the set, as [`RangeSet::inside`] gives them.
    pub fn outside(&self, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let end = end_of(offset, len);
        let mut out = Vec::new();
        let mut at = offset;
        let piece = |a: u64, b: u64| (a, if b == u64::MAX { WHOLE } else { b - a });
        for (s, l) in self.inside(offset, len) {
            if s > at {
                out.push(piece(at, s));
            }
            at = end_of(s, l);
        }
        if at < end {
            out.push(piece(at, end));
        }
        out
    }

    /// The whole set as extents from 0: its ranges as data runs, what lies between as holes
    /// (nothing for an empty set).
    pub fn extents(&self) -> kiln_proto::ops::ExtentList {
        let end = self.iter().map(|(o, l)| o.saturating_add(l)).max();
        end.map_or_else(Default::default, |e| self.runs(0, e))
    }

    /// True when [`RangeSet::extents`] lists every range of the set (a data run and the hole
    /// before it each, within an extent list's limit).
    pub fn fits_extents(&self) -> bool {
        self.count() * 2 <= kiln_proto::ops::EXTENTS_MAX
    }

    /// `[offset, offset + len)` as consecutive runs: in the set (data) and not (holes), at
    /// most [`EXTENTS_MAX`](kiln_proto::ops::EXTENTS_MAX) of them (the caller asks again
    /// from where they end).
    pub fn runs(&self, offset: u64, len: u64) -> kiln_proto::ops::ExtentList {
        use kiln_proto::ops::{Extent, ExtentList, EXTENTS_MAX};
        let end = offset.saturating_add(len);
        let mut out = Vec::new();
        let mut at = offset;
        let mut full = false;
        for (s, l) in self.inside(offset, len) {
            if out.len() + 2 > EXTENTS_MAX {
                full = true;
                break;
            }
            let e = end_of(s, l).min(end);
            if s > at {
                out.push(Extent {
                    len: s - at,
                    hole: true,
                });
            }
            out.push(Extent {
                len: e - s,
                hole: false,
            });
            at = e;
        }
        if at < end && !full {
            out.push(Extent {
                len: end - at,
                hole: true,
            });
        }
        ExtentList {
            size: u64::MAX,
            runs: kiln_proto::codec::Seq(out),
        }
    }

    /// The data runs of `runs` from `offset` added to the set; returns where they end.
    pub fn add_runs(&mut self, offset: u64, runs: &[kiln_proto::ops::Extent]) -> u64 {
        let mut at = offset;
        for r in runs {
            if !r.hole {
                self.add(at, r.len);
            }
            at = at.saturating_add(r.len);
        }
        at
    }

    /// True when any marked range overlaps `[offset, offset+len)`.
    pub fn overlaps(&self, offset: u64, len: u64) -> bool {
        let end = end_of(offset, len);
        self.map
            .range(..end)
            .next_back()
            .is_some_and(|(_, e)| *e > offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_alternate_and_cover_the_range() {
        let mut set = RangeSet::default();
        set.add(10, 5);
        set.add(30, WHOLE);
        let r = set.runs(0, 40).runs.0;
        let got: Vec<(u64, bool)> = r.iter().map(|e| (e.len, e.hole)).collect();
        assert_eq!(got, vec![(10, true), (5, false), (15, true), (10, false)]);
        let mut back = RangeSet::default();
        assert_eq!(back.add_runs(0, &r), 40);
        assert_eq!(back.inside(0, 40), vec![(10, 5), (30, 10)]);
        assert_eq!(RangeSet::default().runs(5, 7).runs.0.len(), 1);
    }

    #[test]
    fn extents_list_every_range_exactly_when_they_fit() {
        use kiln_proto::ops::EXTENTS_MAX;
        for n in [EXTENTS_MAX / 2 - 1, EXTENTS_MAX / 2, EXTENTS_MAX / 2 + 1] {
            let mut set = RangeSet::default();
            for i in 0..n as u64 {
                set.add(1 + i * 10, 5);
            }
            let mut back = RangeSet::default();
            back.add_runs(0, &set.extents().runs.0);
            assert_eq!(set.fits_extents(), back == set, "{n} ranges");
            assert_eq!(set.fits_extents(), n <= EXTENTS_MAX / 2, "{n} ranges");
        }
    }

    #[test]
    fn ranges_merge_and_split() {
        let mut r = RangeSet::default();
        r.add(0, 4096);
        r.add(8192, 4096);
        assert_eq!(r.count(), 2);
        r.add(4096, 4096);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(0, 12288)]);
        r.remove(4096, 100);
        assert_eq!(
            r.iter().collect::<Vec<_>>(),
            vec![(0, 4096), (4196, 12288 - 4196)]
        );
        assert!(r.overlaps(4000, 200) && !r.overlaps(4096, 100));
        r.add(20000, WHOLE);
        assert!(r.overlaps(1 << 40, 1));
        r.remove(0, WHOLE);
        assert!(r.is_empty());
        r.add(77, 0);
        assert!(r.is_empty());
    }

    #[test]
    fn inside_and_outside_split_a_range() {
        let mut r = RangeSet::default();
        r.add(100, 50);
        r.add(300, 100);
        assert_eq!(r.inside(120, 200), vec![(120, 30), (300, 20)]);
        assert_eq!(r.outside(120, 200), vec![(150, 150)]);
        assert_eq!(r.inside(0, 100), vec![]);
        assert_eq!(r.outside(0, 100), vec![(0, 100)]);
        assert_eq!(r.outside(100, 50), vec![]);
        assert_eq!(r.outside(350, WHOLE), vec![(400, WHOLE)]);
        r.add(1000, WHOLE);
        assert_eq!(r.inside(900, WHOLE), vec![(1000, WHOLE)]);
        assert_eq!(r.outside(900, 200), vec![(900, 100)]);
        // Against a bitmap.
        let mut bits = [false; 128];
        let mut x = 0x9e37_79b9u64;
        let mut r = RangeSet::default();
        for _ in 0..500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (off, len) = (x % 120, 1 + (x >> 20) % 8);
            if (x >> 40).is_multiple_of(2) {
                r.add(off, len);
                bits[off as usize..(off + len) as usize].fill(true);
            }
            let (qo, ql) = ((x >> 30) % 100, 1 + (x >> 50) % 28);
            let mut seen = [None; 128];
            for (s, l) in r.inside(qo, ql) {
                (s..s + l).for_each(|i| seen[i as usize] = Some(true));
            }
            for (s, l) in r.outside(qo, ql) {
                (s..s + l).for_each(|i| assert!(seen[i as usize].replace(false).is_none()));
            }
            for i in 0..128u64 {
                let want = (qo..qo + ql).contains(&i).then_some(bits[i as usize]);
                assert_eq!(seen[i as usize], want, "byte {i} of [{qo}, +{ql})");
            }
        }
    }

    #[test]
    fn random_ops_match_a_bitmap() {
        let mut r = RangeSet::default();
        let mut bits = [false; 256];
        let mut x = 0x1234_5678u64;
        for _ in 0..4000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = x % 240;
            let len = 1 + (x >> 20) % 16;
            if (x >> 40).is_multiple_of(3) {
                r.remove(off, len);
                bits[off as usize..(off + len) as usize].fill(false);
            } else {
                r.add(off, len);
                bits[off as usize..(off + len) as usize].fill(true);
            }
            let mut want = [false; 256];
            for (s, l) in r.iter() {
                want[s as usize..(s + l) as usize].fill(true);
            }
            assert_eq!(want, bits);
            // Merged: no two ranges touch.
            let v: Vec<_> = r.iter().collect();
            assert!(v.windows(2).all(|w| w[0].0 + w[0].1 < w[1].0));
        }
    }
}
