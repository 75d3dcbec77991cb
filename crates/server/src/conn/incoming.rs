//! Receiving a request: a frame's arguments and payload as they arrive, read straight into
//! the buffers they end in.

use std::io;

use kiln_layer::Errno;
use kiln_proto::frame::Header;
use kiln_proto::iov::RawIov;

/// A frame whose header has been read and whose arguments and payload are being received.
pub(super) struct Incoming {
    pub(super) hdr: Header,
    pub(super) args: Vec<u8>,
    pub(super) args_got: usize,
    pub(super) payload: Vec<u8>,
    pub(super) payload_len: usize,
}

impl Incoming {
    pub(super) fn new(hdr: Header) -> Incoming {
        let payload_len = hdr.payload_len.get() as usize;
        Incoming {
            args: vec![0u8; hdr.args_len.get() as usize],
            args_got: 0,
            payload: Vec::with_capacity(payload_len),
            payload_len,
            hdr,
        }
    }

    pub(super) fn is_complete(&self) -> bool {
        self.args_got == self.args.len() && self.payload.len() == self.payload_len
    }

    /// Takes this frame's bytes from the front of `src` (arguments, then payload); returns the
    /// bytes used and how many of them were payload (copied).
    pub(super) fn fill_from(&mut self, src: &[u8]) -> (usize, usize) {
        let a = src.len().min(self.args.len() - self.args_got);
        self.args[self.args_got..self.args_got + a].copy_from_slice(&src[..a]);
        self.args_got += a;
        let p = (src.len() - a).min(self.payload_len - self.payload.len());
        self.payload.extend_from_slice(&src[a..a + p]);
        (a + p, p)
    }

    /// Accounts `n` received bytes to args then payload; returns what is left over (bytes that
    /// belong to the next header).
    pub(super) fn advance(&mut self, mut n: usize) -> usize {
        let a = n.min(self.args.len() - self.args_got);
        self.args_got += a;
        n -= a;
        let p = n.min(self.payload_len - self.payload.len());
        // SAFETY: `recv_into` pointed the kernel at the spare capacity starting at `len`, and the
        // kernel reported `p` of those bytes written, so they are initialised.
        unsafe { self.payload.set_len(self.payload.len() + p) };
        n - p
    }
}

/// Fills `buf` from the kernel's random source.
pub(super) fn fill_random(buf: &mut [u8]) -> Result<(), Errno> {
    rustix::rand::getrandom(buf, rustix::rand::GetRandomFlags::empty())
        .map(|_| ())
        .map_err(|e| e.raw_os_error() as u32)
}

pub(super) fn raw(b: &[u8]) -> RawIov {
    RawIov {
        base: b.as_ptr() as usize,
        len: b.len(),
    }
}

/// `readv` into the current frame's remaining arguments and payload, then the next header, then
/// (at a frame boundary) the stage. Returns the bytes received and the bytes asked for.
pub(super) fn recv_into(
    sock: i32,
    cur: Option<&mut Incoming>,
    next_hdr: &mut [u8],
    stage: Option<&mut [u8]>,
) -> io::Result<(usize, usize)> {
    let mut iov = [RawIov { base: 0, len: 0 }; 4];
    let mut n = 0;
    if let Some(inc) = cur {
        if inc.args_got < inc.args.len() {
            iov[n] = raw(&inc.args[inc.args_got..]);
            n += 1;
        }
        let spare = inc.payload_len - inc.payload.len();
        if spare > 0 {
            let base = inc.payload.spare_capacity_mut().as_mut_ptr() as usize;
            iov[n] = RawIov { base, len: spare };
            n += 1;
        }
    }
    iov[n] = raw(next_hdr);
    n += 1;
    if let Some(stage) = stage {
        iov[n] = raw(stage);
        n += 1;
    }
    // SAFETY: every vector points at memory this connection owns and does not otherwise touch
    // during the call (argument buffer, payload spare capacity, header buffer, stage); `RawIov` has the
    // layout of `struct iovec`.
    let r = unsafe { libc::readv(sock, iov.as_ptr().cast(), n as i32) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok((r as usize, iov[..n].iter().map(|v| v.len).sum()))
    }
}
