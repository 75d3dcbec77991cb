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
        for i in 0..self.out.len() {
            if iov.len() + 2 > GATHER_MAX {
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
            let r = &self.out[i];
            if r.sent < r.head.len() {
                iov.push(raw(&r.head[r.sent..]));
            }
            match &r.body {
                Body::None => {}
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
        let n = sendmsg(sock, &iov, more)?;
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
                    Body::None => 0,
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

pub(super) fn sendfile(sock: i32, file: &File, offset: &mut u64, len: usize) -> io::Result<usize> {
    // SAFETY: `sock` is this connection's open socket for the duration of the call.
    let out = unsafe { std::os::fd::BorrowedFd::borrow_raw(sock) };
    rustix::fs::sendfile(out, file, Some(offset), len).map_err(io::Error::from)
}

pub(super) fn send_zeros(sock: i32, len: usize) -> io::Result<usize> {
    static ZEROS: [u8; 4096] = [0; 4096];
    sendmsg(sock, &[raw(&ZEROS[..len.min(ZEROS.len())])], false)
}
