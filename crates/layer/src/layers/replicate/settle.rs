//! Settling a change: a quorum or an error, and the misses marked on the replicas that took it.

use std::sync::atomic::Ordering::Relaxed;

use super::{bit, quorum_errno, FileState, Miss, Replicate};
use crate::exec::join_all;
use crate::marks::{FlagMark, Mark};
use crate::{errno, Ctx, FopResult};

/// A lease held by another writer refused the change ([`crate::layers::marks`]).
const EBUSY: u32 = libc::EBUSY as u32;

impl Replicate {
    /// Settles a change: a quorum or an error; misses marked on the replicas that took it.
    /// `miss` is what a miss needs healed.
    pub(super) async fn settle(
        &self,
        cx: &Ctx,
        path: &str,
        state: Option<&FileState>,
        outcomes: &[Option<FopResult<()>>],
        miss: Miss<'_>,
    ) -> FopResult<()> {
        let mut ok = Vec::new();
        let mut missed = Vec::new();
        let mut errs = Vec::new();
        for (i, o) in outcomes.iter().enumerate() {
            match o {
                Some(Ok(_)) => ok.push(i),
                Some(Err(e)) => {
                    errs.push(*e);
                    missed.push(i);
                }
                None => missed.push(i),
            }
        }
        if errs.contains(&errno::EMOVED) {
            // The file is being moved to another set (frozen on some replicas already): the
            // caller sends the change again where it went; replicas that took it here had it
            // recorded for the mover.
            return Err(errno::EMOVED);
        }
        if ok.is_empty() {
            return Err(quorum_errno(&errs));
        }
        let fenced: Vec<usize> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, Some(Err(EBUSY))))
            .map(|(i, _)| i)
            .collect();
        let took = ok.iter().filter(|i| !self.kids[**i].joining()).count();
        if !fenced.is_empty() && took < self.quorum {
            // Another holder's lease refused the change where it counts: the replicas that
            // took it are the ones behind (they missed that lease), not the ones that refused
            // it. Heal copies the refusers' bytes over what slipped through. (A refusal by a
            // minority while a quorum took it is an ordinary miss, below.)
            tracing::warn!(
                layer = self.name,
                path,
                "change refused by another holder's lease"
            );
            if let Some(s) = state {
                s.bad
                    .fetch_or(ok.iter().fold(0, |b, i| b | bit(*i)), Relaxed);
            }
            if miss.range.is_some() {
                self.mark(cx, path, &fenced, &ok, miss).await?;
            }
            return Err(EBUSY);
        }
        if !missed.is_empty() {
            if let Some(s) = state {
                s.bad
                    .fetch_or(missed.iter().fold(0, |b, i| b | bit(*i)), Relaxed);
            }
            missed.retain(|i| miss.marked & bit(*i) == 0);
            if !missed.is_empty() && (miss.range.is_some() || miss.flags != 0) {
                self.mark(cx, path, &ok, &missed, miss).await?;
            }
        }
        // A new brick that took the change is not an up-to-date replica yet.
        let counted = ok.iter().filter(|i| !self.kids[**i].joining()).count();
        if counted < self.quorum {
            tracing::warn!(
                layer = self.name,
                path,
                ok = counted,
                quorum = self.quorum,
                "change refused: no quorum"
            );
            return Err(quorum_errno(&errs));
        }
        Ok(())
    }

    /// Records on each replica in `on` that every replica in `missed` lacks a range, or
    /// missed a change of the name or attributes.
    pub(super) async fn mark(
        &self,
        cx: &Ctx,
        path: &str,
        on: &[usize],
        missed: &[usize],
        miss: Miss<'_>,
    ) -> FopResult<()> {
        let mut marks: Vec<Mark> = Vec::new();
        let mut flags: Vec<(&str, FlagMark)> = Vec::new();
        for t in missed {
            let target = *t as u32;
            if let Some((offset, len)) = miss.range {
                marks.push(Mark {
                    target,
                    offset,
                    len,
                });
            }
            if miss.flags != 0 {
                let v = FlagMark {
                    target,
                    flags: miss.flags,
                };
                if let Some(also) = miss.also {
                    flags.push((also, v.clone()));
                }
                flags.push((path, v));
            }
        }
        let values = marks.len() + flags.len();
        let mut futs = Vec::new();
        for i in on {
            let k = &self.kids[*i];
            futs.extend(marks.iter().map(|v| Some(k.mark_add(cx, path, v))));
            futs.extend(flags.iter().map(|(p, v)| Some(k.flag_add(cx, p, v))));
        }
        let done = join_all(futs).await;
        let marked = done.iter().filter(|r| matches!(r, Some(Ok(())))).count();
        if marked < values {
            // Not one replica holding the change could record the miss: do not acknowledge.
            tracing::error!(layer = self.name, path, "could not record a missed change");
            return Err(errno::EIO);
        }
        Ok(())
    }
}
