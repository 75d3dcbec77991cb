//! A reply as it is received: its arguments, its payload's place in the request's sink, and
//! what of it has arrived.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use kiln_layer::trace::Trace;
use kiln_proto::iov::{IovCursor, RawIov, IOV_MAX};

use super::Pending;

/// The pieces (address, length) of `len` bytes of the memory `iov` describes, from `skip`
/// bytes in.
pub(super) fn window(
    iov: &[RawIov],
    mut skip: usize,
    mut len: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    iov.iter().filter_map(move |v| {
        if len == 0 {
            return None;
        }
        if skip >= v.len {
            skip -= v.len;
            return None;
        }
        let take = (v.len - skip).min(len);
        let at = v.base + skip;
        skip = 0;
        len -= take;
        Some((at, take))
    })
}

/// Copies `len` bytes starting `skip` bytes into the memory `iov` describes onto `out`.
pub(super) fn gather(iov: &[RawIov], skip: usize, len: usize, out: &mut Vec<u8>) {
    for (at, take) in window(iov, skip, len) {
        // SAFETY: the vectors were just filled by a receive and stay valid (the request's sink
        // is kept alive until its completion, which has not run).
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(at as *const u8, take) });
    }
}

/// Copies as much of `src` as fits into the memory `iov` describes; returns how much.
pub(super) fn scatter(src: &[u8], iov: &[RawIov]) -> usize {
    let mut done = 0;
    for v in iov {
        let take = v.len.min(src.len() - done);
        // SAFETY: the vectors point at buffers the receive loop may write (see `receive`).
        unsafe {
            std::ptr::copy_nonoverlapping(src[done..].as_ptr(), v.base as *mut u8, take);
        }
        done += take;
        if done == src.len() {
            break;
        }
    }
    done
}

/// A reply being received.
pub(super) struct InReply {
    pub(super) id: u64,
    /// A trace frame (the brick's stamps for a completed request), not a reply.
    pub(super) trace_frame: bool,
    /// A push frame (with `trace_frame` set too: no request of its own).
    pub(super) push: bool,
    /// For a trace frame: the trace its stamps belong to, if still wanted.
    pub(super) trace: Option<Arc<Trace>>,
    pub(super) status: u32,
    pub(super) args: Vec<u8>,
    pub(super) args_got: usize,
    /// The request's sink, limited to the payload length.
    pub(super) sink: IovCursor,
    pub(super) payload_len: usize,
    /// Payload bytes beyond the sink's room: read into scratch and dropped.
    pub(super) discard: usize,
    pub(super) discard_got: usize,
    pub(super) pending: Option<Pending>,
    /// Descriptors that came with it.
    pub(super) fds: Vec<OwnedFd>,
    /// Its payload may still be moved on to a descriptor (see [`super::Sink`]).
    pub(super) splice: bool,
}

impl InReply {
    pub(super) fn discard_left(&self) -> usize {
        self.discard - self.discard_got
    }

    pub(super) fn is_complete(&self) -> bool {
        self.args_got == self.args.len() && self.sink.is_done() && self.discard_left() == 0
    }

    /// Appends vectors for the rest of this reply; returns true when they cover all of it, so
    /// that the next header may be read in the same call.
    pub(super) fn vectors(&mut self, iov: &mut Vec<RawIov>, scratch: &mut [u8]) -> bool {
        if self.args_got < self.args.len() {
            iov.push(RawIov {
                base: self.args[self.args_got..].as_mut_ptr() as usize,
                len: self.args.len() - self.args_got,
            });
        }
        let room = IOV_MAX - 2 - iov.len();
        let sink = self.sink.pending(room);
        iov.extend_from_slice(sink);
        let sink_all = sink.iter().map(|v| v.len).sum::<usize>() == self.sink.remaining();
        if !sink_all {
            return false;
        }
        let d = self.discard_left().min(scratch.len());
        if d > 0 {
            iov.push(RawIov {
                base: scratch.as_mut_ptr() as usize,
                len: d,
            });
        }
        d == self.discard_left()
    }

    /// Accounts received bytes; returns those that belong to the next header.
    pub(super) fn advance(&mut self, mut n: usize) -> usize {
        let a = n.min(self.args.len() - self.args_got);
        self.args_got += a;
        n -= a;
        // Part of the payload received the ordinary way: the rest follows it.
        self.splice &= n == 0;
        n -= self.sink.advance(n);
        let d = n.min(self.discard_left());
        self.discard_got += d;
        n - d
    }
}
