//! Reads: from one replica that may serve them, the next when it fails, waiting (see
//! [`super::patience`]) when none can.
//!
//! A replica whose brick finds a block of the range damaged (its checksum does not match,
//! [`errno::ECKSUM`]) is passed over like a failed one; once another replica served the
//! read, the damaged ones are marked behind for the range on it, so heal copies the good
//! bytes over the bad, and this handle reads no more from them until then. When every
//! replica that could serve the read found damage, the read fails with `EIO`: never the
//! wrong bytes.

use std::sync::atomic::Ordering::Relaxed;

use super::{bit, Miss, RepFd, Replicate};
use crate::layers::posix::sums::BLOCK;
use crate::shared::Shared;
use crate::{errno, Ctx, Fd, FopResult, Fut, LayerRef, ReadDst, ReadOut};

impl Replicate {
    /// Reads from one replica, trying the next on failure.
    pub(super) async fn read_one(
        &self,
        cx: &Ctx,
        rfd: &RepFd,
        offset: u64,
        dst: ReadDst,
    ) -> FopResult<ReadOut> {
        let mut deadline = None;
        match dst {
            ReadDst::Any(n) => loop {
                let mut tried = Tried::default();
                for i in self.read_candidates(cx, rfd, offset, n.into()).await {
                    let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, ReadOut> {
                        let k = k.clone();
                        Box::pin(async move { k.read(cx, &fd, offset, ReadDst::Any(n)).await })
                    };
                    match self.on_child(cx, rfd, i, &op).await {
                        Ok(r) => {
                            self.repair(cx, rfd, i, &tried, offset, n.into()).await;
                            return Ok(r);
                        }
                        Err(e) => tried.failed(i, e),
                    }
                }
                if let Some(e) = tried.final_errno() {
                    return Err(e);
                }
                if !self.again(&mut deadline, tried.last).await {
                    return Err(tried.last);
                }
            },
            ReadDst::Into(bufs) => {
                let len = bufs.len() as u64;
                let shared = Shared::new(bufs);
                let sh = &shared;
                loop {
                    let mut tried = Tried::default();
                    for i in self.read_candidates(cx, rfd, offset, len).await {
                        let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, ReadOut> {
                            let k = k.clone();
                            let b = sh.share();
                            Box::pin(async move { k.read(cx, &fd, offset, ReadDst::Into(b)).await })
                        };
                        match self.on_child(cx, rfd, i, &op).await {
                            Ok(out) => {
                                let n = out.len();
                                drop(out);
                                self.repair(cx, rfd, i, &tried, offset, len).await;
                                return Ok(ReadOut::Into {
                                    n,
                                    bufs: shared.into_bufs(),
                                });
                            }
                            Err(e) => tried.failed(i, e),
                        }
                    }
                    if let Some(e) = tried.final_errno() {
                        return Err(e);
                    }
                    if !self.again(&mut deadline, tried.last).await {
                        return Err(tried.last);
                    }
                }
            }
        }
    }

    /// After replica `good` served a read that `tried` found damaged elsewhere: marks the
    /// damaged replicas behind for the range's blocks on `good`, for heal to repair.
    async fn repair(
        &self,
        cx: &Ctx,
        rfd: &RepFd,
        good: usize,
        tried: &Tried,
        offset: u64,
        len: u64,
    ) {
        if tried.damaged.is_empty() {
            return;
        }
        let start = offset / BLOCK * BLOCK;
        let end = offset.saturating_add(len.max(1)).div_ceil(BLOCK) * BLOCK;
        let bits = tried.damaged.iter().fold(0, |b, i| b | bit(*i));
        rfd.state.bad.fetch_or(bits, Relaxed);
        tracing::warn!(
            layer = self.name,
            path = rfd.path,
            replicas = ?tried.damaged,
            served_by = good,
            offset = start,
            len = end - start,
            "damaged copy read from another replica; marked for heal"
        );
        let miss = Miss::bytes(start, end - start);
        if let Err(e) = self
            .mark(cx, &rfd.path, &[good], &tried.damaged, miss)
            .await
        {
            tracing::error!(
                layer = self.name,
                path = rfd.path,
                "could not mark a damaged copy for heal: errno {e}"
            );
        }
    }
}

/// What the replicas tried for a read answered.
struct Tried {
    /// The last error.
    last: u32,
    /// Replicas that found the range damaged.
    damaged: Vec<usize>,
}

impl Default for Tried {
    fn default() -> Tried {
        Tried {
            last: errno::ENOTCONN,
            damaged: Vec::new(),
        }
    }
}

impl Tried {
    fn failed(&mut self, i: usize, e: u32) {
        if e == errno::ECKSUM {
            self.damaged.push(i);
        }
        self.last = e;
    }

    /// The read's error when no replica served it and waiting cannot help: `EIO` when one
    /// found damage (another replica may come back, but a damaged block is not worth the
    /// wait: the caller hears of it now).
    fn final_errno(&self) -> Option<u32> {
        (!self.damaged.is_empty()).then_some(errno::EIO)
    }
}
