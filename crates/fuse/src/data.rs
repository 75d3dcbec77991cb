//! File data: reads, writes (held behind, see [`crate::behind`]), flush, fsync and release.

use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use fuser::{Errno, FileHandle, INodeNo, ReplyData, ReplyEmpty, ReplyWrite};
use kiln_client::RawIov;

use crate::gate::{self, block_on};
use kiln_proto::Cred;

use crate::behind::Hold;
use crate::convert::errno;
use crate::{files, splice, KilnFs, MAX_IO};

impl KilnFs {
    /// READ: from a whole file read with its open, or from the brick, answered from the
    /// thread that completes it.
    pub(crate) fn data_read(
        &self,
        (unique, ino): (u64, INodeNo),
        fh: FileHandle,
        offset: u64,
        size: u32,
        reply: ReplyData,
    ) {
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let _ = self.send_behind(ino.0);
        let size = size.min(MAX_IO) as usize;
        let Some(reply) = self.read_whole(fh, offset, size, reply) else {
            return;
        };
        let fd = match self.fd(fh) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let mut buf = self.bufs.get(size);
        let iov = [RawIov {
            base: buf.as_mut_ptr() as usize,
            len: size,
        }];
        let (pool, counters) = (self.bufs.clone(), self.counters.clone());
        let out = self.splice_out(unique, size);
        let went = out.clone();
        // The reply goes to the kernel from the thread that completed the read (the
        // connection's receive thread), straight from `buf` — or it went already, from the
        // socket by splice, and `buf` holds nothing.
        let done = Box::new(move |r: Result<usize, u32>| {
            match r {
                _ if went.is_some_and(|o| o.was_sent()) => {
                    counters.spliced.fetch_add(1, Ordering::Relaxed);
                    splice::answered(reply)
                }
                Ok(n) => reply.data(&buf[..n.min(size)]),
                Err(e) => {
                    reply.error(Errno::from_i32(kiln_proto::errno::for_application(e) as i32))
                }
            }
            pool.put(buf);
        });
        // SAFETY: `buf` moves into the callback, so its memory (`size` bytes of it described
        // by `iov`) lives until the callback runs; nothing else touches it meanwhile.
        unsafe {
            match out {
                Some(out) => self.vol.preadv_raw_to(&fd, &iov, offset, out, done),
                None => self.vol.preadv_raw(&fd, &iov, offset, done),
            }
        }
    }

    /// WRITE: held behind when it continues the file's last write (general mode, not
    /// `O_DIRECT` or `O_SYNC`), else sent straight from the kernel's request buffer while this
    /// FUSE thread waits (others keep serving), after what was held for the file.
    ///
    /// `by`: the caller, when the kernel asks that the write drop the file's set-user-ID and
    /// set-group-ID bits (`FUSE_WRITE_KILL_SUIDGID`: the writer lacks `CAP_FSETID`). The
    /// brick then writes as that caller, and its own kernel drops them as for a local write;
    /// otherwise it writes as itself, which keeps them, as root's write does.
    pub(crate) fn data_write(
        &self,
        (ino, fh): (INodeNo, FileHandle),
        by: Option<Arc<Cred>>,
        offset: u64,
        data: &[u8],
        flags: i32,
        reply: ReplyWrite,
    ) {
        if let Some(e) = self.behind.error(fh.0) {
            return reply.error(e);
        }
        let fd = match self.fd(fh) {
            Ok(fd) => fd,
            Err(e) => return reply.error(e),
        };
        self.files.changing(ino.0);
        let sync = flags & (libc::O_DIRECT | libc::O_SYNC | libc::O_DSYNC) != 0;
        if self.write_behind && !sync {
            if let Hold::Held = self.behind.hold(ino.0, (fh.0, &fd), &by, offset, data) {
                self.files.changed_done();
                self.touched(ino.0);
                return reply.written(data.len() as u32);
            }
        }
        // What was held goes first (its error is its writer's to hear; this write goes on).
        let _ = self.send_behind(ino.0);
        let bufs = [IoSlice::new(data)];
        let r = gate::waiting(|| match by {
            // The common case (root, or the writeback cache) takes no view of the stack.
            None => self.vol.pwritev_blocking(&fd, &bufs, offset),
            by => self
                .vol
                .on_behalf_of(by)
                .pwritev_blocking(&fd, &bufs, offset),
        })
        .map_err(errno);
        self.files.changed_done();
        self.touched(ino.0);
        match r {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(e),
        }
    }

    /// Sends what is held behind for `ino`, if anything, and waits for a send of it under
    /// way; an error is also kept for the handle that wrote it (its next write, fsync or
    /// close reports it).
    pub(crate) fn send_behind(&self, ino: u64) -> Result<(), Errno> {
        if !self.behind.any() {
            return Ok(());
        }
        let _order = self.behind.order(ino);
        let Some(h) = self.behind.take(ino) else {
            return Ok(());
        };
        let bufs = [IoSlice::new(&h.data)];
        let r = gate::waiting(|| match &h.by {
            None => self.vol.pwritev_blocking(&h.fd, &bufs, h.offset),
            by => (self.vol.on_behalf_of(by.clone())).pwritev_blocking(&h.fd, &bufs, h.offset),
        });
        self.behind.sent(ino);
        self.touched(ino);
        let e = match r {
            Ok(n) if n == h.data.len() => return Ok(()),
            Ok(n) => {
                tracing::warn!(ino, n, held = h.data.len(), "short write of held data");
                Errno::EIO
            }
            Err(e) => errno(e),
        };
        self.behind.failed(h.fh, e);
        Err(e)
    }

    /// FLUSH (every `close(2)` of a handle that may write): what is held goes to the brick,
    /// and an error of a held write is reported. With the kernel's writeback cache, it
    /// writes its cached pages back before asking, so there is nothing more to do here.
    pub(crate) fn data_flush(&self, ino: INodeNo, fh: FileHandle, reply: ReplyEmpty) {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        if !self.write_behind && !self.writeback {
            // Every write was acknowledged by the brick before the kernel: a close has
            // nothing to send, and ENOSYS tells the kernel to stop asking (one crossing less
            // per close; vm-image mode, and --write-behind off).
            return reply.error(Errno::ENOSYS);
        }
        let _ = self.send_behind(ino.0);
        match self.behind.error(fh.0) {
            Some(e) => reply.error(e),
            None => reply.ok(),
        }
    }

    /// FSYNC: what is held goes first; then the stack flushes the file on every brick that
    /// holds it. A whole file read with its open has nothing to flush.
    pub(crate) fn data_fsync(
        &self,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _ = self.send_behind(ino.0);
        if let Some(e) = self.behind.error(fh.0) {
            return reply.error(e);
        }
        let f = match self.open_fd(fh) {
            Ok(Some(f)) => f,
            Ok(None) => return reply.ok(),
            Err(e) => return reply.error(e),
        };
        match block_on(self.vol.fsync(&f, datasync)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// RELEASE: the handle is closed on the brick (after FLUSH, so nothing is held), without
    /// holding this FUSE thread.
    pub(crate) fn data_release(&self, fh: FileHandle, reply: ReplyEmpty) {
        let Some(files::OpenFile { held, ino, backed }) = self.files.remove(fh.0) else {
            return reply.error(Errno::EBADF);
        };
        if self.send_behind(ino).is_err() || self.behind.error(fh.0).is_some() {
            tracing::warn!(
                ino,
                "a held write failed and its handle was closed without FLUSH"
            );
        }
        let files::Held::Fd(fd) = held else {
            // Nothing open on the brick.
            return reply.ok();
        };
        if backed {
            self.pass.released(&self.vol, ino);
        }
        // Answered when the brick has closed it, from the thread that completes the close:
        // nobody waits for a RELEASE (the kernel sends it after close(2) returned), so no FUSE
        // thread has to either.
        let vol = self.vol.clone();
        kiln_client::spawn(async move {
            match vol.close(fd).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(e)),
            }
        });
    }
}
