//! READ answers that go from a brick's TCP socket to the kernel by `splice`, without landing in
//! this process's memory (see [`kiln_client::SpliceOut`]).
//!
//! Over TCP every read cost the connection's receive thread two copies: the socket's bytes
//! into a buffer here, then the buffer into the application's pages through `/dev/fuse`. That
//! thread held a whole vCPU at ~1.3 GB/s. With splice the socket's pages go into a pipe behind
//! the FUSE reply header and from the pipe to the device, which copies them into the
//! application's pages: one copy.
//!
//! The kernel matches a reply with its request on the device descriptor the request was read
//! from, so a mount that splices reads its requests from one shared descriptor (not one clone
//! per FUSE thread) and writes replies to a duplicate of it. Reads smaller than
//! [`SPLICE_MIN`] are received as before (a pipe's three system calls cost more than such a
//! copy); so are reads through a layer that needs their bytes (replicate, shard), over TLS or a
//! Unix socket: the connection decides, and the read's buffer is answered from as usual.

use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};

use fuser::ReplyData;
use kiln_client::SpliceOut;

use crate::KilnFs;

/// Reads of at least this many bytes may be spliced.
pub(crate) const SPLICE_MIN: usize = 32 << 10;

/// Whether this mount splices reads, and the device descriptor it writes their replies to.
pub(crate) struct Splice {
    on: bool,
    /// A duplicate of the session's `/dev/fuse` descriptor, once the session is made.
    dev: OnceLock<Arc<OwnedFd>>,
}

impl Default for Splice {
    fn default() -> Splice {
        Splice {
            on: true,
            dev: OnceLock::new(),
        }
    }
}

impl Splice {
    /// True unless turned off (`--splice off`): the session then reads requests from one
    /// shared descriptor.
    pub(crate) fn is_on(&self) -> bool {
        self.on
    }

    /// A mount that does not splice.
    pub(crate) fn off() -> Splice {
        Splice {
            on: false,
            dev: OnceLock::new(),
        }
    }

    /// The session's device descriptor, duplicated (the session keeps its own).
    pub(crate) fn set_device(&self, fd: std::os::fd::BorrowedFd<'_>) {
        match fd.try_clone_to_owned() {
            Ok(fd) => {
                let _ = self.dev.set(Arc::new(fd));
            }
            Err(e) => tracing::warn!("reads will not be spliced: cannot duplicate the device: {e}"),
        }
    }
}

impl KilnFs {
    /// What the session is to give its device descriptor to, when this mount splices.
    pub(crate) fn splice_handle(&self) -> Option<Arc<Splice>> {
        self.splice.on.then(|| self.splice.clone())
    }

    /// The way out for the answer to READ request `unique` of `size` bytes, if it may go by
    /// splice.
    pub(crate) fn splice_out(&self, unique: u64, size: usize) -> Option<Arc<SpliceOut>> {
        if !self.splice.on || size < SPLICE_MIN {
            return None;
        }
        let dev = self.splice.dev.get()?.clone();
        Some(Arc::new(SpliceOut::new(dev, move |n| {
            reply_head(unique, n)
        })))
    }
}

/// The FUSE reply header (`struct fuse_out_header`) in front of an `n`-byte READ answer.
fn reply_head(unique: u64, n: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(&(16 + n as u32).to_le_bytes());
    h.extend_from_slice(&0i32.to_le_bytes());
    h.extend_from_slice(&unique.to_le_bytes());
    h
}

/// The kernel has its answer to `reply`'s request already (spliced). fuser has no call for
/// a reply made elsewhere, and dropping `reply` would answer a second time (EIO, refused by
/// the kernel and logged as an error), so it is forgotten: that leaks one count of the
/// reference fuser holds on its device descriptor (no memory), which keeps the descriptor open
/// until the process ends rather than until the session does.
pub(crate) fn answered(reply: ReplyData) {
    std::mem::forget(reply);
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_head_is_fuse_out_header() {
        let h = super::reply_head(0x0102_0304_0506_0708, 4096);
        assert_eq!(h.len(), 16);
        assert_eq!(u32::from_le_bytes(h[0..4].try_into().unwrap()), 16 + 4096);
        assert_eq!(i32::from_le_bytes(h[4..8].try_into().unwrap()), 0);
        assert_eq!(
            u64::from_le_bytes(h[8..16].try_into().unwrap()),
            0x0102_0304_0506_0708
        );
    }
}
