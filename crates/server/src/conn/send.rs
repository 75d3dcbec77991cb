//! Replies out: gathered with `sendmsg`, file data with `sendfile`, and sealed into TLS
//! records when the connection is encrypted.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use kiln_proto::iov::RawIov;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::*;

impl Conn {
    /// True while replies (or, over TLS, sealed records) wait to be sent.
    pub(super) fn has_output(&self) -> bool {
        !self.out.is_empty() || self.tls_out.as_ref().is_some_and(|w| w.pending())
    }

    /// Sends queued replies until done or the socket would block.
    pub(super) fn flush(&mut self, fd: &AsyncFd<OwnedFd>) -> io::Result<()> {
        while self.has_output() {
            let r = fd.try_io(Interest::WRITABLE, |s| self.send_some(s.as_raw_fd()));
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One step of sending: a gathered `sendmsg` of in-memory parts, or one `sendfile`.
    pub(super) fn send_some(&mut self, sock: i32) -> io::Result<()> {
        if let Some(mut w) = self.tls_out.take() {
            let r = self.seal_some(&mut w, sock);
            self.tls_out = Some(w);
            return r;
        }
        let front = self.out.front_mut().expect("non-empty queue");
        // The front reply's file body goes out once its head is sent.
        if front.sent >= front.head.len() {
            if let Body::File { file, offset, len } = &front.body {
                let done = front.sent - front.head.len();
                let mut off = offset + done as u64;
                let want = len - done;
                let n = sendfile(sock, file, &mut off, want)?;
                let n = if n == 0 {
                    // The file shrank under us; the header promised `len` bytes, so pad.
                    tracing::warn!("file shrank during a read; padding the reply with zeros");
                    send_zeros(sock, want)?
                } else {
                    n
                };
                front.sent += n;
                self.out_bytes -= n;
                if front.sent == front.total() {
                    self.reply_sent();
                }
                return Ok(());
            }
        }
        let mut iov: Vec<RawIov> = Vec::with_capacity(GATHER_MAX);
        let mut more = false;
        // Descriptors go with the first byte of their frame, one frame's per `sendmsg`.
        let mut with_fds = false;
        for i in 0..self.out.len() {
            if iov.len() + 2 > GATHER_MAX {
                break;
            }
            // A frame with descriptors goes alone in its `sendmsg`, with nothing after it.
            if self.out[i].carries_fds() && i > 0 {
                break;
            }
            if self.out[i].stamps_next && self.out[i].sent == 0 {
                self.out[i].stamps_next = false;
                if let Some(next) = self.out.get_mut(i + 1) {
                    if let Some(at) = next.stamp_at.take() {
                        let t = kiln_layer::trace::now_ns().to_le_bytes();
                        next.head[at..at + 8].copy_from_slice(&t);
                    }
                }
            }
            if self.out[i].carries_fds() {
                with_fds = true;
                iov.push(raw(&self.out[0].head[self.out[0].sent..]));
                break;
            }
            let r = &self.out[i];
            if r.sent < r.head.len() {
                iov.push(raw(&r.head[r.sent..]));
            }
            match &r.body {
                Body::None | Body::Fds(_) => {}
                Body::Buf(b) => {
                    let skip = r.sent.saturating_sub(r.head.len());
                    if skip < b.len() {
                        iov.push(raw(&b[skip..]));
                    }
                }
                Body::File { .. } => {
                    more = true;
                    break;
                }
            }
        }
        let n = self.send_gathered(sock, &iov, with_fds, more)?;
        self.out_bytes -= n;
        let mut left = n;
        while left > 0 {
            let r = self
                .out
                .front_mut()
                .expect("sent bytes belong to queued replies");
            let in_memory = match r.body {
                Body::File { .. } => r.head.len(),
                _ => r.total(),
            };
            let take = left.min(in_memory - r.sent);
            r.sent += take;
            left -= take;
            if r.sent == r.total() {
                self.reply_sent();
            } else {
                break;
            }
        }
        debug_assert_eq!(left, 0, "every byte sent is accounted to a reply");
        Ok(())
    }
}

impl Conn {
    /// Over TLS, one step of sending: write sealed records, or seal a batch of queued replies
    /// (heads and buffers copied into the record slots, file data read into them from the
    /// page cache) and start writing it. `WouldBlock` when the socket is full.
    pub(super) fn seal_some(
        &mut self,
        w: &mut kiln_tls::RecordWriter,
        sock: i32,
    ) -> io::Result<()> {
        // SAFETY: `sock` is this connection's open socket for the duration of the call.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(sock) };
        if w.pending() {
            return match w.flush(fd)? {
                true => Ok(()),
                false => Err(io::ErrorKind::WouldBlock.into()),
            };
        }
        if self.out.is_empty() {
            return Ok(());
        }
        let cap = kiln_tls::RecordWriter::BATCH;
        let out = &mut self.out;
        let (mut idx, mut pos, mut taken) = (0usize, out[0].sent, 0usize);
        while taken < cap && idx < out.len() {
            if pos == 0 && out[idx].stamps_next {
                out[idx].stamps_next = false;
                if let Some(next) = out.get_mut(idx + 1) {
                    if let Some(at) = next.stamp_at.take() {
                        let t = kiln_layer::trace::now_ns().to_le_bytes();
                        next.head[at..at + 8].copy_from_slice(&t);
                    }
                }
            }
            let r = &out[idx];
            let room = cap - taken;
            let n = if pos < r.head.len() {
                let k = (r.head.len() - pos).min(room);
                w.put(taken, &r.head[pos..pos + k]);
                k
            } else {
                let at = pos - r.head.len();
                match &r.body {
                    Body::None | Body::Fds(_) => 0,
                    Body::Buf(b) => {
                        let k = (b.len() - at).min(room);
                        w.put(taken, &b[at..at + k]);
                        k
                    }
                    Body::File { file, offset, len } => {
                        let k = (len - at).min(room);
                        match w.read_file(taken, k, file, offset + at as u64)? {
                            0 => {
                                // The header promised `len` bytes: pad, as for sendfile.
                                tracing::warn!("file shrank during a read; padding with zeros");
                                w.zero(taken, k);
                                k
                            }
                            got => got,
                        }
                    }
                }
            };
            taken += n;
            pos += n;
            if pos == r.total() {
                idx += 1;
                pos = 0;
            }
        }
        w.seal(taken)?;
        self.out_bytes -= taken;
        let mut left = taken;
        while left > 0 {
            let r = self
                .out
                .front_mut()
                .expect("sealed bytes belong to queued replies");
            let take = left.min(r.total() - r.sent);
            r.sent += take;
            left -= take;
            if r.sent == r.total() {
                self.reply_sent();
            }
        }
        match w.flush(fd)? {
            true => Ok(()),
            false => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

/// `sendmsg` of gathered vectors; `more` tells the kernel that file data follows at once.
pub(super) fn sendmsg(sock: i32, iov: &[RawIov], more: bool) -> io::Result<usize> {
    // SAFETY: a zeroed msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len();
    let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT | if more { libc::MSG_MORE } else { 0 };
    // SAFETY: `msg` points at `iov`, whose vectors point into live reply buffers.
    let r = unsafe { libc::sendmsg(sock, &msg, flags) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

impl Conn {
    /// `sendmsg` of vectors gathered from the queue's front; `with_fds`: the front reply's
    /// descriptors go along.
    fn send_gathered(
        &mut self,
        sock: i32,
        iov: &[RawIov],
        with_fds: bool,
        more: bool,
    ) -> io::Result<usize> {
        let Body::Fds(fds) = &mut self.out[0].body else {
            return sendmsg(sock, iov, more);
        };
        if !with_fds {
            return sendmsg(sock, iov, more);
        }
        match sendmsg_fds(sock, iov, fds) {
            Ok(n) => {
                // They went with the first byte: never again with the rest.
                fds.clear();
                Ok(n)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Err(e)
            }
            Err(e) => {
                // The descriptors cannot go (too many in flight, …): the client gets the error
                // instead of the grant, and the connection lives on.
                tracing::warn!(peer = %self.peer, "cannot pass descriptors: {e}");
                let hdr = Header::parse(&self.out[0].head[..HEADER_LEN])
                    .map_err(|_| io::Error::from_raw_os_error(libc::EPROTO))?;
                let errno = e.raw_os_error().unwrap_or(libc::EIO) as u32;
                let r = OutReply::new(hdr.opcode.get(), hdr.request_id.get(), Err(errno));
                self.out_bytes = self.out_bytes - self.out[0].total() + r.total();
                self.out[0] = r;
                Err(io::ErrorKind::Interrupted.into())
            }
        }
    }
}

impl OutReply {
    /// Descriptors still to go with this reply's first byte.
    fn carries_fds(&self) -> bool {
        matches!(&self.body, Body::Fds(f) if !f.is_empty())
    }
}

/// `sendmsg` of `iov` with `fds` attached (`SCM_RIGHTS`): they arrive with its first byte.
fn sendmsg_fds(sock: i32, iov: &[RawIov], fds: &[OwnedFd]) -> io::Result<usize> {
    const MAX: usize = 4;
    assert!(
        fds.len() <= MAX,
        "a frame carries at most {MAX} descriptors"
    );
    let raw_fds: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let data_len = std::mem::size_of_val(&raw_fds[..]);
    // u64s: aligned for `cmsghdr`.
    let mut space = [0u64; 8];
    // SAFETY: CMSG_SPACE only computes a size.
    let space_len = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
    assert!(space_len <= std::mem::size_of_val(&space));
    // SAFETY: a zeroed msghdr is valid; it points at `iov` and at `space`, both live for the
    // call, and the control message is written inside `space` (its size checked above).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len();
        msg.msg_control = space.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space_len;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(data_len as u32) as usize;
        std::ptr::copy_nonoverlapping(raw_fds.as_ptr() as *const u8, libc::CMSG_DATA(c), data_len);
        let r = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

pub(super) fn sendfile(sock: i32, file: &File, offset: &mut u64, len: usize) -> io::Result<usize> {
    // SAFETY: `sock` is this connection's open socket for the duration of the call.
    let out = unsafe { std::os::fd::BorrowedFd::borrow_raw(sock) };
    rustix::fs::sendfile(out, file, Some(offset), len).map_err(io::Error::from)
}

pub(super) fn send_zeros(sock: i32, len: usize) -> io::Result<usize> {
    static ZEROS: [u8; 4096] = [0; 4096];
    sendmsg(sock, &[raw(&ZEROS[..len.min(ZEROS.len())])], false)
}
