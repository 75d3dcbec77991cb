//! Replies whose payload goes on to a descriptor without landing in user memory (see
//! [`SpliceOut`]): the receive thread puts the head the descriptor wants into a pipe, moves
//! the payload from the socket behind it with `splice` (the kernel passes the socket buffers'
//! pages, it does not copy them), and moves the whole from the pipe to the descriptor — for a
//! FUSE mount over TCP, one copy (into the application's pages) where receiving into a buffer
//! and writing it to `/dev/fuse` made two, both on the receive thread.
//!
//! Whatever goes wrong on the way comes back to the ordinary path: the pipe's bytes are read
//! back into the request's memory (the rest of the payload is then received as usual) and the
//! request completes as if nothing had been tried. Only plain TCP connections do this: TLS
//! must decrypt in user space, and a Unix socket's replies may carry descriptors.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use std::sync::atomic::Ordering::Relaxed;

use kiln_layer::SpliceOut;
use kiln_proto::errno;
use kiln_proto::iov::RawIov;

use super::{Conn, InReply};

impl Conn {
    /// The current reply's payload, when it may go on to a descriptor: moved (see
    /// [`Conn::splice`]), the reply completed if that was all of it. True when it was tried.
    pub(super) fn splice_current(
        &self,
        fd: i32,
        cur: &mut Option<InReply>,
        pipe: &mut Option<Pipe>,
    ) -> io::Result<bool> {
        // Only a payload none of which was received yet (not one begun from a carry).
        let Some(r) = cur
            .as_mut()
            .filter(|r| r.splice && r.sink.remaining() == r.payload_len)
        else {
            return Ok(false);
        };
        r.splice = false;
        let Some(moved) = self.splice(fd, r, pipe)? else {
            return Ok(false);
        };
        // Bytes from the brick, though not through `recvmsg`: the watchdog hears them too.
        self.health.heard();
        if r.advance(moved) != 0 {
            tracing::warn!("a spliced payload overran its reply");
            return Err(io::Error::from_raw_os_error(errno::EPROTO as i32));
        }
        if r.is_complete() {
            let r = cur.take().expect("current reply");
            self.complete(r);
        }
        Ok(true)
    }

    /// Moves the payload of reply `r`, none of which is received yet, on to its descriptor
    /// (see [`Sink`]); returns how many of its bytes are dealt with (all of them, or those that
    /// came back into its memory), or nothing when it was not tried.
    fn splice(
        &self,
        fd: i32,
        r: &mut InReply,
        pipe: &mut Option<Pipe>,
    ) -> io::Result<Option<usize>> {
        let Some(out) = r.pending.as_ref().and_then(|p| p.out.clone()) else {
            return Ok(None);
        };
        if pipe.is_none() {
            match Pipe::new() {
                Ok(p) => *pipe = Some(p),
                Err(e) => {
                    tracing::debug!("no pipe for replies: {e}");
                    return Ok(None);
                }
            }
        }
        let p = pipe.as_ref().expect("made above");
        if !p.fits(r.payload_len) {
            return Ok(None);
        }
        let sink = r.sink.pending(usize::MAX);
        Ok(Some(
            match p.move_payload(fd, r.payload_len, &out, sink)? {
                Moved::Out => {
                    out.set_sent();
                    self.stats
                        .bytes_spliced
                        .fetch_add(r.payload_len as u64, Relaxed);
                    r.payload_len
                }
                Moved::Back(n) => {
                    self.stats.splice_fallbacks.fetch_add(1, Relaxed);
                    n
                }
                Moved::Lost => {
                    self.stats.splice_fallbacks.fetch_add(1, Relaxed);
                    r.status = errno::EIO;
                    r.payload_len
                }
            },
        ))
    }
}

/// A pipe owned by one connection's receive thread, empty between replies.
pub(super) struct Pipe {
    r: OwnedFd,
    w: OwnedFd,
    /// Payload bytes it is trusted to hold: each of its pages holds one socket buffer's
    /// piece, which may be less than a page.
    room: usize,
}

/// Pipe size asked for: a 1 MiB read and its head in whole pages, with room to spare.
const PIPE_SIZE: i32 = 4 << 20;

/// How a reply's payload went.
enum Moved {
    /// Out to the descriptor, behind its head.
    Out,
    /// Its first so many bytes are in the request's memory; the rest is still in the socket.
    Back(usize),
    /// Taken by the descriptor and dropped: it knows no such request (one cut short, or a
    /// descriptor other than the one the request came from), or it took the bytes from the
    /// pipe and then refused them. The request fails.
    Lost,
}

impl Pipe {
    pub(super) fn new() -> io::Result<Pipe> {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both descriptors are open and ours alone.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // Bigger than the unprivileged limit; a smaller pipe only moves fewer replies this way.
        let mut size = PIPE_SIZE;
        let got = loop {
            // SAFETY: fcntl on a descriptor we own.
            let n = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, size) };
            if n > 0 || size <= 1 << 16 {
                break n.max(1 << 16);
            }
            size /= 2;
        };
        Ok(Pipe {
            r,
            w,
            // A worst case of one 1,500-byte socket buffer per page would need far more room
            // than a reply: count on 4 KiB pages holding at least 2 KiB each, and keep a page
            // for the head.
            room: (got as usize / 2).saturating_sub(4096),
        })
    }

    /// True when a payload of `n` bytes may be tried.
    fn fits(&self, n: usize) -> bool {
        n > 0 && n <= self.room
    }

    /// Moves the `n`-byte payload now at the front of `sock` out through `out` ([`Moved::Out`]),
    /// or as much of it as came into `sink` (the request's memory, at least `n` bytes) when
    /// that could not be done ([`Moved::Back`]). An error is the socket's: the connection
    /// is dead.
    fn move_payload(
        &self,
        sock: i32,
        n: usize,
        out: &SpliceOut,
        sink: &[RawIov],
    ) -> io::Result<Moved> {
        let head = (out.head)(n);
        // SAFETY: writing our own bytes into our pipe; it is empty, so a head of a page or
        // less goes in whole.
        let w = unsafe { libc::write(self.w.as_raw_fd(), head.as_ptr().cast(), head.len()) };
        if w != head.len() as isize {
            tracing::debug!(
                "pipe refused a reply's head: {}",
                io::Error::last_os_error()
            );
            self.drain();
            return Ok(Moved::Back(0));
        }
        let mut moved = 0;
        while moved < n {
            // SAFETY: splice between two descriptors we hold open; no memory is passed.
            let r = unsafe {
                libc::splice(
                    sock,
                    std::ptr::null_mut(),
                    self.w.as_raw_fd(),
                    std::ptr::null_mut(),
                    n - moved,
                    0,
                )
            };
            if r > 0 {
                moved += r as usize;
                continue;
            }
            if r == 0 {
                self.drain();
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // The pipe is full (the socket's buffers were small), or the socket had
                // nothing yet.
                Some(libc::EAGAIN) if !writable(self.w.as_raw_fd()) => {
                    return Ok(Moved::Back(self.back(head.len(), moved, sink)?));
                }
                Some(libc::EAGAIN) => super::poll_fd(sock, libc::POLLIN)?,
                _ if moved == 0 => {
                    // Splice from this socket is not to be had: receive as usual.
                    tracing::debug!("splice from the socket: {e}");
                    return Ok(Moved::Back(self.back(head.len(), 0, sink)?));
                }
                _ => {
                    self.drain();
                    return Err(e);
                }
            }
        }
        let len = head.len() + n;
        // SAFETY: splice between two descriptors we hold open; no memory is passed.
        let r = unsafe {
            libc::splice(
                self.r.as_raw_fd(),
                std::ptr::null_mut(),
                out.fd.as_raw_fd(),
                std::ptr::null_mut(),
                len,
                0,
            )
        };
        if r == len as isize {
            return Ok(Moved::Out);
        }
        let e = io::Error::last_os_error();
        if r < 0 && e.raw_os_error() == Some(libc::ENOENT) {
            self.drain();
            tracing::debug!("the descriptor knows no such request: {e}");
            return Ok(Moved::Lost);
        }
        tracing::debug!(r, "splice to the descriptor: {e}");
        if self.held() != len {
            // Taken from the pipe and then refused: gone, as a refused write would be.
            self.drain();
            return Ok(Moved::Lost);
        }
        // Refused whole (the pipe still holds it): answered the ordinary way.
        Ok(Moved::Back(self.back(head.len(), n, sink)?))
    }

    /// Reads the pipe's head (dropped) and then `n` payload bytes back into `sink`; returns
    /// `n`. Bytes that did not come back are lost to the stream: the connection is failed.
    fn back(&self, head: usize, n: usize, sink: &[RawIov]) -> io::Result<usize> {
        let mut skip = vec![0u8; head];
        // SAFETY: reading into our own buffer of `head` bytes.
        let h = unsafe { libc::read(self.r.as_raw_fd(), skip.as_mut_ptr().cast(), head) };
        let mut got = 0usize;
        if h == head as isize {
            while got < n {
                let iov = vectors(sink, got, n - got);
                // SAFETY: the vectors are the request's sink, which stays valid and is ours
                // to write until its completion (see `Conn::submit`).
                let r = unsafe {
                    libc::readv(self.r.as_raw_fd(), iov.as_ptr(), iov.len().min(1024) as i32)
                };
                if r <= 0 {
                    break;
                }
                got += r as usize;
            }
        }
        self.drain();
        if got != n {
            tracing::warn!(got, n, "a reply's payload did not come back from the pipe");
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(n)
    }

    /// Bytes in the pipe.
    fn held(&self) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int.
        match unsafe { libc::ioctl(self.r.as_raw_fd(), libc::FIONREAD, &mut n) } {
            0 => n.max(0) as usize,
            _ => 0,
        }
    }

    /// Empties the pipe (what is in it belongs to no reply any more).
    fn drain(&self) {
        let mut scratch = [0u8; 4096];
        // SAFETY: reading into a stack buffer; the pipe is non-blocking.
        while unsafe { libc::read(self.r.as_raw_fd(), scratch.as_mut_ptr().cast(), 4096) } > 0 {}
    }
}

/// `len` bytes of the memory `sink` describes, from `skip` bytes in, as `iovec`s.
fn vectors(sink: &[RawIov], skip: usize, len: usize) -> Vec<libc::iovec> {
    super::inreply::window(sink, skip, len)
        .map(|(at, take)| libc::iovec {
            iov_base: at as *mut libc::c_void,
            iov_len: take,
        })
        .collect()
}

/// True when the pipe's write end has room.
fn writable(fd: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}
