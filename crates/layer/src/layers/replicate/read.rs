//! Reads: from one replica that may serve them, the next when it fails, waiting (see
//! [`super::patience`]) when none can.

use super::{RepFd, Replicate};
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
                let mut last = errno::ENOTCONN;
                for i in self.read_candidates(cx, rfd, offset, n.into()).await {
                    let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, ReadOut> {
                        let k = k.clone();
                        Box::pin(async move { k.read(cx, &fd, offset, ReadDst::Any(n)).await })
                    };
                    match self.on_child(cx, rfd, i, &op).await {
                        Ok(r) => return Ok(r),
                        Err(e) => last = e,
                    }
                }
                if !self.again(&mut deadline, last).await {
                    return Err(last);
                }
            },
            ReadDst::Into(bufs) => {
                let len = bufs.len() as u64;
                let shared = Shared::new(bufs);
                let sh = &shared;
                loop {
                    let mut last = errno::ENOTCONN;
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
                                return Ok(ReadOut::Into {
                                    n,
                                    bufs: shared.into_bufs(),
                                });
                            }
                            Err(e) => last = e,
                        }
                    }
                    if !self.again(&mut deadline, last).await {
                        return Err(last);
                    }
                }
            }
        }
    }
}
