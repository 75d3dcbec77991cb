//! The callback API on raw vectors: reads land in, and writes are sent from, memory the
//! caller owns (a guest's RAM for a vhost-user device, a C caller's buffers for libkiln),
//! completing on the thread that finished the request.

use std::sync::Arc;

use kiln_layer::{exec, Ctx, Errno, Fd, IoBufs, RawIov, ReadDst, ReadOut, SpliceOut};

use super::Volume;

/// What a raw read or write calls when it completes: the byte count or the errno.
pub type RawDone = Box<dyn FnOnce(Result<usize, Errno>) + Send>;

impl Volume {
    /// Reads into raw vectors; `cb` gets the byte count or the errno, on the thread that
    /// completed the request.
    ///
    /// # Safety
    /// The vectors' memory must stay valid and untouched until `cb` has been called.
    pub unsafe fn preadv_raw(&self, fd: &Fd, iov: &[RawIov], offset: u64, cb: RawDone) {
        // SAFETY: forwarded to the caller.
        unsafe { self.preadv_raw_in(self.ctx(), fd, iov, offset, cb) }
    }

    /// [`Volume::preadv_raw`], whose payload may go out through `out` instead of into the
    /// vectors (see [`SpliceOut`]; `out.was_sent()` tells which, once `cb` is called).
    ///
    /// # Safety
    /// As [`Volume::preadv_raw`].
    pub unsafe fn preadv_raw_to(
        &self,
        fd: &Fd,
        iov: &[RawIov],
        offset: u64,
        out: Arc<SpliceOut>,
        cb: RawDone,
    ) {
        // SAFETY: forwarded to the caller.
        let bufs = unsafe { IoBufs::raw(iov.to_vec()) }.with_splice_out(out);
        self.io_in(self.ctx(), fd, bufs, offset, false, cb)
    }

    /// [`Volume::preadv_raw`] in the context `cx` (from [`Volume::ctx`]; a caller that stamps
    /// its own edges on a sampled request's trace, as a vhost-user device does).
    ///
    /// # Safety
    /// As [`Volume::preadv_raw`].
    pub unsafe fn preadv_raw_in(&self, cx: Ctx, fd: &Fd, iov: &[RawIov], offset: u64, cb: RawDone) {
        // SAFETY: forwarded to the caller.
        unsafe { self.raw_in(cx, fd, iov, offset, false, cb) }
    }

    /// Writes from raw vectors; `cb` gets the byte count or the errno.
    ///
    /// # Safety
    /// The vectors' memory must stay valid and unchanged until `cb` has been called.
    pub unsafe fn pwritev_raw(&self, fd: &Fd, iov: &[RawIov], offset: u64, cb: RawDone) {
        // SAFETY: forwarded to the caller.
        unsafe { self.pwritev_raw_in(self.ctx(), fd, iov, offset, cb) }
    }

    /// [`Volume::pwritev_raw`] in the context `cx` (see [`Volume::preadv_raw_in`]).
    ///
    /// # Safety
    /// As [`Volume::pwritev_raw`].
    pub unsafe fn pwritev_raw_in(
        &self,
        cx: Ctx,
        fd: &Fd,
        iov: &[RawIov],
        offset: u64,
        cb: RawDone,
    ) {
        // SAFETY: forwarded to the caller.
        unsafe { self.raw_in(cx, fd, iov, offset, true, cb) }
    }

    /// The read (`write` false) or write of [`Volume::preadv_raw_in`] and
    /// [`Volume::pwritev_raw_in`].
    ///
    /// # Safety
    /// As those.
    unsafe fn raw_in(
        &self,
        cx: Ctx,
        fd: &Fd,
        iov: &[RawIov],
        offset: u64,
        write: bool,
        cb: RawDone,
    ) {
        // SAFETY: forwarded to the caller.
        let bufs = unsafe { IoBufs::raw(iov.to_vec()) };
        self.io_in(cx, fd, bufs, offset, write, cb)
    }

    /// The read (`write` false) into or write from `bufs`, completing through `cb`.
    fn io_in(&self, cx: Ctx, fd: &Fd, bufs: IoBufs, offset: u64, write: bool, cb: RawDone) {
        let (top, fd) = (self.stack.top.clone(), fd.clone());
        exec::spawn(async move {
            let r = if write {
                top.write(&cx, &fd, offset, bufs).await.map(|w| w.n)
            } else {
                // Only bytes in the caller's memory count: anything else left it unwritten.
                top.read(&cx, &fd, offset, ReadDst::Into(bufs))
                    .await
                    .and_then(|o| match o {
                        ReadOut::Into { n, .. } => Ok(n),
                        _ => Err(kiln_proto::errno::EIO),
                    })
            };
            Volume::finish(&cx);
            cb(r);
        });
    }
}
