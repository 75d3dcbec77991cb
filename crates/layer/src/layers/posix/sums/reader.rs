//! The reader's side: data a brick shipped with its blocks' entries, checked where it landed.

use super::{crc, seal, BLOCK, NONE, ZEROS};

/// Checks data a brick shipped with its blocks' entries ([`Sums::shipped`]): `data` (its
/// pieces in order) was read at `offset`, `entries` came with it. `Err(block)`: the first
/// block whose bytes do not match; `Err(u64::MAX)`: the entries do not fit the data.
pub fn verify_shipped(offset: u64, entries: &[u32], data: &[&[u8]]) -> Result<(), u64> {
    let n: usize = data.iter().map(|d| d.len()).sum();
    let end = offset + n as u64;
    let first = offset / BLOCK;
    if entries.len() as u64 != end.div_ceil(BLOCK) - first || n == 0 {
        return Err(u64::MAX);
    }
    let mut pieces = data.iter().copied().filter(|d| !d.is_empty());
    let mut cur: &[u8] = &[];
    // Bytes of the data before block `first + 1` begins.
    let head = ((first + 1) * BLOCK).min(end) - offset;
    for (k, &want) in entries.iter().enumerate() {
        let b = first + k as u64;
        let take = if k == 0 {
            head as usize
        } else {
            (((b + 1) * BLOCK).min(end) - b * BLOCK) as usize
        };
        let mut d: Option<crc_fast::Digest> = None;
        let mut single: Option<&[u8]> = None;
        let mut left = take;
        while left > 0 {
            if cur.is_empty() {
                cur = pieces.next().ok_or(u64::MAX)?;
            }
            let t = left.min(cur.len());
            let (now, rest) = cur.split_at(t);
            if t == take && want != NONE {
                single = Some(now);
            } else if want != NONE {
                d.get_or_insert_with(|| crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
                    .update(now);
            }
            cur = rest;
            left -= t;
        }
        if want == NONE {
            continue;
        }
        if k == 0 && !offset.is_multiple_of(BLOCK) {
            // A block the data holds only in part is never shipped with a sum.
            return Err(b);
        }
        let got = if take == BLOCK as usize {
            single.map_or_else(|| d.map_or(0, |d| d.finalize() as u32), crc)
        } else {
            // The file ends inside the block: the rest reads as zeros.
            let mut dd =
                d.unwrap_or_else(|| crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi));
            if let Some(s) = single {
                dd.update(s);
            }
            dd.update(&ZEROS[..BLOCK as usize - take]);
            dd.finalize() as u32
        };
        if seal(got) != want {
            return Err(b);
        }
    }
    Ok(())
}
