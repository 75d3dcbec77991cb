//! Layouts: how a directory splits the 32-bit name-hash space among subvolumes, and the
//! stable name hash itself.

/// The stable 32-bit hash of a name: FNV-1a, then the murmur3 finaliser to spread the high
/// bits (layouts split the space by range, so the high bits decide).
pub fn name_hash(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in name.as_bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// One subvolume's share of the hash space: `start..=end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// First hash owned.
    pub start: u32,
    /// Last hash owned (inclusive).
    pub end: u32,
    /// The owner's index among the layer's subvolumes.
    pub subvol: u16,
}

/// A directory's layout: ranges sorted by start, covering the whole hash space without gaps or
/// overlaps. A subvolume may own no range (a new brick before fix-layout) or several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub(super) ranges: Vec<Range>,
}

/// Encoded layout: magic, version, flags (reserved, 0), range count (u16 LE), then per range
/// start (u32 LE), end (u32 LE), subvolume (u16 LE).
pub(super) const LAYOUT_MAGIC: &[u8; 4] = b"KLAY";
pub(super) const LAYOUT_VERSION: u8 = 1;
pub(super) const LAYOUT_HEADER: usize = 8;
pub(super) const LAYOUT_RANGE: usize = 10;

impl Layout {
    /// The default: the hash space in `n` equal ranges, subvolume `i` owning the `i`-th.
    /// `n` is taken as at least 1 and at most 65535 (the count is stored in 16 bits).
    pub fn equal(n: usize) -> Layout {
        let n = n.clamp(1, u16::MAX as usize) as u64;
        let ranges = (0..n)
            .map(|i| Range {
                start: ((i << 32) / n) as u32,
                end: ((((i + 1) << 32) / n) - 1) as u32,
                subvol: i as u16,
            })
            .collect();
        Layout { ranges }
    }

    /// The hash space in equal ranges over the subvolumes `active` (by index), the `i`-th
    /// range to `active[i]`; over subvolume 0 alone when `active` is empty.
    pub fn over(active: &[usize]) -> Layout {
        let mut l = Layout::equal(active.len());
        for (r, &i) in l.ranges.iter_mut().zip(active) {
            r.subvol = i.min(u16::MAX as usize) as u16;
        }
        l
    }

    /// The ranges, sorted by start.
    pub fn ranges(&self) -> &[Range] {
        &self.ranges
    }

    /// The subvolume that owns `hash`.
    pub fn subvol(&self, hash: u32) -> usize {
        let i = self.ranges.partition_point(|r| r.end < hash);
        self.ranges.get(i).map_or(0, |r| r.subvol as usize)
    }

    /// The subvolume of stripe `k` of something whose stripe 0 goes where `hash` does: the
    /// owner of the `k`-th range after the one `hash` falls in, round the space.
    pub fn stripe(&self, hash: u32, k: u64) -> usize {
        let n = self.ranges.len().max(1);
        let i = self.ranges.partition_point(|r| r.end < hash) % n;
        let j = ((i as u64 + k % n as u64) % n as u64) as usize;
        self.ranges.get(j).map_or(0, |r| r.subvol as usize)
    }

    /// The layout as stored in [`LAYOUT_XATTR`].
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(LAYOUT_HEADER + LAYOUT_RANGE * self.ranges.len());
        out.extend_from_slice(LAYOUT_MAGIC);
        out.push(LAYOUT_VERSION);
        out.push(0);
        out.extend_from_slice(&(self.ranges.len() as u16).to_le_bytes());
        for r in &self.ranges {
            out.extend_from_slice(&r.start.to_le_bytes());
            out.extend_from_slice(&r.end.to_le_bytes());
            out.extend_from_slice(&r.subvol.to_le_bytes());
        }
        out
    }

    /// Decodes a stored layout for a layer with `subvols` subvolumes: `None` unless it is well
    /// formed, covers the whole hash space exactly and names only existing subvolumes.
    pub fn decode(bytes: &[u8], subvols: usize) -> Option<Layout> {
        let header = bytes.get(..LAYOUT_HEADER)?;
        if &header[..4] != LAYOUT_MAGIC || header[4] != LAYOUT_VERSION || header[5] != 0 {
            return None;
        }
        let count = u16::from_le_bytes([header[6], header[7]]) as usize;
        let body = &bytes[LAYOUT_HEADER..];
        if count == 0 || body.len() != count * LAYOUT_RANGE {
            return None;
        }
        let mut ranges = Vec::with_capacity(count);
        let mut next: u64 = 0;
        for c in body.chunks_exact(LAYOUT_RANGE) {
            let start = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let end = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
            let subvol = u16::from_le_bytes([c[8], c[9]]);
            if u64::from(start) != next || end < start || subvol as usize >= subvols {
                return None;
            }
            next = u64::from(end) + 1;
            ranges.push(Range { start, end, subvol });
        }
        (next == 1 << 32).then_some(Layout { ranges })
    }
}
