//! A cursor over a list of raw I/O vectors, for partial `readv`/`writev` progress.
//!
//! [`RawIov`] has the layout of Linux `struct iovec`, so `IovCursor::as_iovecs` can be handed to a
//! vectored system call directly. The cursor only does pointer arithmetic; whoever builds it
//! promises the memory stays valid while a system call uses it.

/// Layout-compatible with `struct iovec`.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct RawIov {
    /// Start of the buffer, as an address (so the type is `Send`; the caller owns the promise
    /// that the memory is valid).
    pub base: usize,
    /// Length of the buffer in bytes.
    pub len: usize,
}

impl RawIov {
    /// The vector of a buffer to be filled (a read's sink). Taking the address promises
    /// nothing yet; whoever hands the vector on keeps `b` alive and unmoved while it is used.
    pub fn of_mut(b: &mut [u8]) -> RawIov {
        RawIov {
            base: b.as_mut_ptr() as usize,
            len: b.len(),
        }
    }

    /// The vector of a buffer to be sent (a write's payload), under the same promise.
    pub fn of(b: &[u8]) -> RawIov {
        RawIov {
            base: b.as_ptr() as usize,
            len: b.len(),
        }
    }
}

/// Largest number of vectors handed to one system call (Linux `UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// Vectors still to be filled or drained, front first.
#[derive(Debug, Default)]
pub struct IovCursor {
    iovs: Vec<RawIov>,
    first: usize,
    remaining: usize,
}

impl IovCursor {
    /// A cursor over `iovs`, skipping zero-length entries, limited to `limit` bytes in all.
    pub fn new(iovs: impl IntoIterator<Item = RawIov>, limit: usize) -> IovCursor {
        let mut left = limit;
        let mut out = Vec::new();
        for v in iovs {
            if left == 0 {
                break;
            }
            let len = v.len.min(left);
            if len > 0 {
                out.push(RawIov { base: v.base, len });
                left -= len;
            }
        }
        IovCursor {
            iovs: out,
            first: 0,
            remaining: limit - left,
        }
    }

    /// Bytes not yet transferred.
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// True when every byte has been transferred.
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// The vectors not yet done, at most `max` of them.
    pub fn pending(&self, max: usize) -> &[RawIov] {
        let end = self.iovs.len().min(self.first.saturating_add(max));
        &self.iovs[self.first..end]
    }

    /// Records that `n` bytes were transferred. `n` beyond what remains is clamped.
    pub fn advance(&mut self, mut n: usize) -> usize {
        let taken = n.min(self.remaining);
        n = taken;
        while n > 0 {
            let v = &mut self.iovs[self.first];
            if n >= v.len {
                n -= v.len;
                v.len = 0;
                self.first += 1;
            } else {
                v.base += n;
                v.len -= n;
                n = 0;
            }
        }
        self.remaining -= taken;
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_across_vectors_and_skips_empty_ones() {
        let mut a = [0u8; 3];
        let mut b = [0u8; 5];
        let iovs = [
            RawIov {
                base: a.as_mut_ptr() as usize,
                len: 3,
            },
            RawIov { base: 0, len: 0 },
            RawIov {
                base: b.as_mut_ptr() as usize,
                len: 5,
            },
        ];
        let mut c = IovCursor::new(iovs, 6);
        assert_eq!(c.remaining(), 6);
        assert_eq!(c.pending(8).len(), 2);
        assert_eq!(c.advance(4), 4);
        assert_eq!(c.pending(8).len(), 1);
        assert_eq!(c.pending(8)[0].len, 2);
        assert_eq!(c.pending(8)[0].base, b.as_mut_ptr() as usize + 1);
        assert_eq!(c.advance(10), 2);
        assert!(c.is_done());
        assert!(c.pending(8).is_empty());
    }
}
