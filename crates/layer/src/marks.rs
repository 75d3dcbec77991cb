//! What replicas missed, as the replicate layer and the bricks' marks layer speak of it.
//!
//! When a change reaches some replicas of a file but not all, the replicate layer records, on
//! every replica that has it, which byte ranges each other replica missed ("pending marks").
//! A replica with marks against it never serves a read of that file; heal copies exactly the
//! marked ranges to it and then clears them.
//!
//! Marks travel as extended attributes in a reserved `kiln.` namespace that the brick's marks
//! layer answers itself (they never reach the file system):
//!
//! | name                 | fop      | value                                              |
//! |----------------------|----------|----------------------------------------------------|
//! | `kiln.pending.add`   | setxattr | [`Mark`]: `target` missed `[offset, offset+len)`    |
//! | `kiln.pending.clear` | setxattr | [`Mark`]: `target` has that range now              |
//! | `kiln.pending`       | getxattr | [`PendingPage`]: this file's marks                  |
//! | `kiln.pending.index` | getxattr | [`IndexPage`] (on the root): files with marks      |
//! | `kiln.lock`          | setxattr | [`LockReq`]: heal's range lock on the file          |
//!
//! `len == WHOLE` means the whole file (it was created, truncated or punched while the replica
//! was away). A getxattr answer holds at most [`PAGE_BYTES`]; a heal that clears what it healed
//! and asks again sees the rest.

#![allow(missing_docs)] // wire struct fields are described in the table above

use std::collections::BTreeMap;

use kiln_proto::codec::Seq;
use kiln_proto::wire_struct;

/// Add a mark.
pub const ADD: &str = "kiln.pending.add";
/// Clear a range of a mark.
pub const CLEAR: &str = "kiln.pending.clear";
/// Read a file's marks.
pub const PENDING: &str = "kiln.pending";
/// Read the brick's index of files with marks.
pub const INDEX: &str = "kiln.pending.index";
/// Take or drop a heal lock.
pub const LOCK: &str = "kiln.lock";
/// The reserved namespace.
pub const PREFIX: &str = "kiln.";
/// A range length meaning "to the end of the file, whatever its size".
pub const WHOLE: u64 = u64::MAX;
/// Most bytes of marks in one getxattr answer.
pub const PAGE_BYTES: usize = 60 * 1024;
/// How long a heal lock lasts unless dropped or renewed: a heal that dies cannot hold writes
/// back for longer.
pub const LOCK_LEASE: std::time::Duration = std::time::Duration::from_secs(10);

wire_struct! {
    /// One pending mark: replica `target` (its index in the replicate layer) missed a range.
    pub struct Mark { pub target: u32, pub offset: u64, pub len: u64 }
    /// One range.
    pub struct Range { pub offset: u64, pub len: u64 }
    /// The ranges a replica missed.
    pub struct TargetRanges { pub target: u32, pub ranges: Seq<Range> }
    /// A file's marks (possibly the first page of them).
    pub struct PendingPage { pub targets: Seq<TargetRanges>, pub more: bool }
    /// One file with marks, and the bytes it needs, per target.
    pub struct IndexEntry { pub path: String, pub target: u32, pub ranges: u64, pub bytes: u64 }
    /// Files with marks (possibly the first page).
    pub struct IndexPage { pub entries: Seq<IndexEntry>, pub more: bool }
    /// A heal lock request: `lock` 1 takes `[offset, offset+len)`, 0 drops it.
    pub struct LockReq { pub offset: u64, pub len: u64, pub lock: u32 }
}

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
