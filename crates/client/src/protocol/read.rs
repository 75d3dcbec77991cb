//! Reads through the brick, and their check against the block sums the brick ships with them
//! (`FLAG_SUMS`, see [`kiln_proto::ops::HELLO_SUMS`]).

use std::sync::atomic::{AtomicU64, Ordering};

use kiln_layer::{errno, fail, Ctx, FopResult, Fut, ReadDst, ReadOut};
use kiln_proto::codec::Wire;
use kiln_proto::ops::ReadReq;
use kiln_proto::Op;

use super::{check_len, landed, take_back, ProtocolClient, RemoteFd, Shape};

static SHIPPED_CHECKED: AtomicU64 = AtomicU64::new(0);
static SHIPPED_DAMAGED: AtomicU64 = AtomicU64::new(0);

/// Reads this process checked against sums its bricks shipped, and those that did not match
/// (and were read again with the brick checking).
pub fn shipped_checks() -> (u64, u64) {
    (
        SHIPPED_CHECKED.load(Ordering::Relaxed),
        SHIPPED_DAMAGED.load(Ordering::Relaxed),
    )
}

impl ProtocolClient {
    /// A read through the brick.
    pub(super) fn read_brick<'a>(
        &'a self,
        cx: &'a Ctx,
        rfd: &'a RemoteFd,
        offset: u64,
        dst: ReadDst,
    ) -> Fut<'a, ReadOut> {
        self.read_brick_with(cx, rfd, offset, dst, true)
    }

    /// READ through the brick. A read the brick answers from its file (sendfile) is checked
    /// here, against the sums it ships (`sums`), rather than read twice on the brick; one
    /// spliced on to the kernel never reaches this process's memory, so the brick checks it.
    /// A shipped read that does not match is read again with the brick checking it: the
    /// bytes may have changed between the brick taking the sums and sending the file (a write
    /// racing the read), which the brick's own check tells from damage.
    fn read_brick_with<'a>(
        &'a self,
        cx: &'a Ctx,
        rfd: &'a RemoteFd,
        offset: u64,
        dst: ReadDst,
        sums: bool,
    ) -> Fut<'a, ReadOut> {
        let len = try_fut!(check_len(dst.len()));
        let args = ReadReq { fh: 0, offset, len }.to_wire();
        let mut req = self.request(cx, Op::Read, args, Some(rfd));
        req.sums = sums && len >= kiln_layer::layers::posix::SENDFILE_MIN;
        match dst {
            ReadDst::Into(bufs) => {
                req.out = bufs.splice_out().cloned();
                req.sums &= req.out.is_none();
                let (iov, keep) = bufs.into_parts();
                req.shape = Shape::ReadInto;
                let f = self.send(cx, req, Some(Box::new((iov, keep))));
                Box::pin(async move {
                    let mut c = f.await?;
                    let bufs = take_back(&mut c);
                    let r = c.result?;
                    let n = r.payload_len;
                    if !r.args.is_empty() {
                        // SAFETY: the reply's `n` bytes landed in these vectors, which
                        // `bufs` owns (or its caller keeps valid) and nothing writes until
                        // it is handed back.
                        let pieces = unsafe { crate::shortcut::filled(bufs.iov(), n) };
                        if self.check_shipped(rfd, offset, &r.args, &pieces).is_err() {
                            drop(pieces);
                            let dst = ReadDst::Into(bufs);
                            return self.read_brick_with(cx, rfd, offset, dst, false).await;
                        }
                    }
                    Ok(ReadOut::Into { n, bufs })
                })
            }
            ReadDst::Any(len) => {
                req.shape = Shape::ReadAny;
                let f = self.send(
                    cx,
                    req,
                    Some(Box::new(Vec::<u8>::with_capacity(len as usize))),
                );
                Box::pin(async move {
                    let c = f.await?;
                    let r = c.result?;
                    let buf = landed(c.keep, r.payload_len);
                    if !r.args.is_empty()
                        && self.check_shipped(rfd, offset, &r.args, &[&buf]).is_err()
                    {
                        return self
                            .read_brick_with(cx, rfd, offset, ReadDst::Any(len), false)
                            .await;
                    }
                    Ok(ReadOut::Buf(buf))
                })
            }
        }
    }

    /// Checks read data against the block sums its brick shipped: `ECKSUM` (logged, counted in
    /// [`shipped_checks`]) for a block that does not match, `EPROTO` for entries that do not
    /// fit the data. Either way the caller reads again with the brick checking.
    pub(super) fn check_shipped(
        &self,
        rfd: &RemoteFd,
        offset: u64,
        args: &[u8],
        data: &[&[u8]],
    ) -> FopResult<()> {
        let entries: Vec<u32> = args
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if !args.len().is_multiple_of(4) {
            return Err(errno::EPROTO);
        }
        SHIPPED_CHECKED.fetch_add(1, Ordering::Relaxed);
        match kiln_layer::layers::posix::sums::verify_shipped(offset, &entries, data) {
            Ok(()) => Ok(()),
            Err(u64::MAX) => {
                tracing::warn!(path = %rfd.path, "a brick shipped sums that do not fit its data");
                Err(errno::EPROTO)
            }
            Err(b) => {
                SHIPPED_DAMAGED.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    path = %rfd.path,
                    offset = b * kiln_layer::layers::posix::sums::BLOCK,
                    "data received from the brick does not match its checksum (damaged, or \
                     changed as it was sent): reading it again with the brick checking"
                );
                Err(errno::ECKSUM)
            }
        }
    }
}
