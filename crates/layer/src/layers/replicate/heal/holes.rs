//! Holes stay holes. Where heal's source has a hole that the target has too, heal clears the
//! target's marks there without copying: zeros read from a hole would be written as data,
//! so a sparse image (a 100 GiB disk holding 1 GiB) would heal its whole size and come out
//! fully allocated.
//!
//! The source's extents are first read unlocked, far ahead, as a hint of where holes are
//! (data costs nothing more to heal than before). A hole the hint shows is then checked
//! again under heal's lock, on the source and on the target, and only the part that is a
//! hole on both now is skipped: under the lock no client writes it, and outside it a write
//! goes to every replica or marks the one that missed it. A range to the end of the file is
//! locked to the end, and a target shorter than the hole is first extended to cover it, so
//! that a skipped range reads as zeros on the target as it does on the source.

use crate::marks::{self as m, LockReq, RangeSet};
use crate::{Ctx, Extent, FopResult};

use super::data::Healing;
use super::{on_all, rest, CHUNK};

/// The source's extents are read this far ahead for the hint.
const HINT: u64 = 1 << 30;

/// Where the source had holes (absolute `[start, end)`), on `[from, to)`, as read unlocked.
pub(super) struct Hint {
    src: usize,
    from: u64,
    to: u64,
    holes: Vec<(u64, u64)>,
    size: u64,
}

/// Bytes from the start of `runs` that are a hole.
fn leading_hole(runs: &[Extent]) -> u64 {
    runs.iter().take_while(|r| r.hole).map(|r| r.len).sum()
}

impl Healing<'_> {
    /// The length of the hole at `pos` on source `src` by the hint (read again when it does
    /// not cover `pos`), within the source's size and `end`; 0 where the hint shows data or
    /// a hole shorter than a chunk (copied as usual).
    pub(super) async fn hole_ahead(
        &mut self,
        hint: &mut Option<Hint>,
        src: usize,
        pos: u64,
        end: u64,
    ) -> u64 {
        let fresh = hint
            .as_ref()
            .is_some_and(|h| h.src == src && h.from <= pos && pos < h.to);
        if !fresh {
            *hint = Some(self.read_hint(src, pos, end).await);
        }
        let Some(h) = hint else { return 0 };
        let Some(&(_, e)) = h.holes.iter().find(|(s, e)| *s <= pos && pos < *e) else {
            return 0;
        };
        let n = e.min(h.size).min(end).saturating_sub(pos);
        if n < CHUNK {
            0
        } else {
            n
        }
    }

    async fn read_hint(&mut self, src: usize, pos: u64, end: u64) -> Hint {
        let to = pos.saturating_add((end - pos).min(HINT));
        let mut h = Hint {
            src,
            from: pos,
            to,
            holes: Vec::new(),
            size: 0,
        };
        let Ok(sfd) = self.source_fd(src).await else {
            return h;
        };
        // A brick that cannot tell (an older one) leaves the hint empty: copy as before.
        let Ok(l) = self.kids[src]
            .extents(&Ctx::NONE, &sfd, pos, to - pos)
            .await
        else {
            return h;
        };
        h.size = l.size;
        let mut at = pos;
        for r in l.runs.0 {
            if r.hole {
                h.holes.push((at, at + r.len));
            }
            at += r.len;
        }
        // The runs may stop short of `to`: what they did not cover is asked again later.
        h.to = at.max(pos + 1);
        h
    }

    /// Under heal's lock from `pos`: the part of `[pos, pos+len)` that is a hole on the
    /// source (within its size) and on the target now, its marks cleared without a copy; its
    /// length (0: copy it as usual). `whole`: the range runs to the end of the file.
    pub(super) async fn skip_hole(
        &mut self,
        src: usize,
        gens: &[Option<u64>],
        pos: u64,
        len: u64,
        whole: bool,
    ) -> FopResult<u64> {
        let (kids, path, target) = (self.kids, self.path, self.target);
        let sfd = self.source_fd(src).await?;
        let lock = |on: u32| LockReq {
            offset: pos,
            len: if whole { m::WHOLE } else { len },
            lock: on,
        };
        let (take, drop) = (lock(1), lock(0));
        let t0 = std::time::Instant::now();
        on_all(kids, self.up, |k| k.heal_lock(&Ctx::NONE, path, &take)).await?;
        let step = async {
            let cx = &Ctx::NONE;
            let Ok(s) = kids[src].extents(cx, &sfd, pos, len).await else {
                return Ok(0);
            };
            let hole = leading_hole(&s.runs.0)
                .min(s.size.saturating_sub(pos))
                .min(len);
            if hole == 0 {
                return Ok(0);
            }
            let Ok(t) = kids[target].extents(cx, self.tfd, pos, hole).await else {
                return Ok(0);
            };
            let n = leading_hole(&t.runs.0).min(hole);
            if n == 0 {
                return Ok(0);
            }
            if t.size < pos + n {
                if !whole {
                    // A missed extension is another mark's to copy.
                    return Ok(0);
                }
                // Past its end the target has no bytes at all: extend it so the range reads
                // as zeros, as on the source. Refused (a client wrote past it): copy.
                let size = crate::SetAttrs {
                    valid: kiln_proto::ops::SETATTR_SIZE,
                    size: pos + n,
                    ..Default::default()
                };
                if kids[target].fsetattr(cx, self.tfd, &size).await.is_err() {
                    return Ok(0);
                }
            }
            self.clear(gens, &RangeSet::default(), pos, n).await?;
            Ok(n)
        }
        .await;
        let _ = on_all(kids, self.up, |k| k.heal_lock(&Ctx::NONE, path, &drop)).await;
        rest(t0.elapsed()).await;
        step
    }
}
