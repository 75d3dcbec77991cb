//! A replica that is behind for a file becomes current again, range by range, as it takes
//! new writes — not only through heal.
//!
//! Without this, marks could only grow while replicas come and go: A misses a range while
//! it is away (marked on B and C), comes back, then B misses the same range while A and C
//! take it (marked on A and C). A now holds the newest bytes, yet C still says A missed
//! them; after C has its turn away too, every replica is marked behind for the range and
//! no read or heal can choose a source. So when a write goes to a file that has replicas
//! behind, the layer first reads the marks' generations from the replicas that are up; a
//! replica behind that took the whole write has its marks for the written range cleared on
//! each holder, conditionally on that generation (`mark_clear_if`): a mark added for it
//! since — a concurrent write it missed — makes the clear a no-op (`EAGAIN`), so a clear
//! never hides a miss. A file with every replica current pays nothing for this.

use super::{bit, Replicate};
use crate::exec::join_all;
use crate::marks::CondMark;
use crate::Ctx;

/// A holder's generation of marks for one target, read before a write.
pub(super) struct Held {
    holder: usize,
    target: u32,
    gen: u64,
}

impl Replicate {
    /// The generations, on each replica that is up, of the marks against the replicas in
    /// `behind` for `path`.
    pub(super) async fn held_marks(&self, cx: &Ctx, path: &str, behind: u32) -> Vec<Held> {
        let mut held = Vec::new();
        for (holder, page) in self.pages_of_up(cx, path).await {
            let Ok(page) = page else { continue };
            for t in page.targets.0 {
                if (t.target as usize) < self.kids.len() && behind & bit(t.target as usize) != 0 {
                    held.push(Held {
                        holder,
                        target: t.target,
                        gen: t.gen,
                    });
                }
            }
        }
        held
    }

    /// Clears, where `held` says they are, the marks for `[offset, offset+len)` against the
    /// replicas in `took` (they took the whole write of that range).
    pub(super) async fn clear_taken(
        &self,
        cx: &Ctx,
        path: &str,
        held: &[Held],
        took: u32,
        offset: u64,
        len: u64,
    ) {
        let conds: Vec<(usize, CondMark)> = held
            .iter()
            .filter(|h| took & bit(h.target as usize) != 0 && h.gen != 0)
            .map(|h| {
                let c = CondMark {
                    target: h.target,
                    offset,
                    len,
                    gen: h.gen,
                };
                (h.holder, c)
            })
            .collect();
        let futs = conds
            .iter()
            .map(|(h, c)| Some(self.kids[*h].mark_clear_if(cx, path, c)))
            .collect();
        for (r, (h, c)) in join_all(futs).await.into_iter().zip(&conds) {
            if let Some(Err(e)) = r {
                tracing::debug!(
                    layer = self.name,
                    path,
                    holder = h,
                    target = c.target,
                    "marks kept (errno {e})"
                );
            }
        }
    }
}
