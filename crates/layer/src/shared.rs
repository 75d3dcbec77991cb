//! The caller's memory of one change or read, shared by several requests: the replicas' of
//! one fop, or the tries of a fop sent again (a file that moved while open).

use std::sync::{Arc, Mutex};

use crate::IoBufs;

/// The memory of one change or read, shared by several requests.
pub struct Shared {
    iov: Vec<kiln_proto::iov::RawIov>,
    keep: Arc<Mutex<Option<Box<dyn std::any::Any + Send>>>>,
}

impl Shared {
    /// Takes the caller's memory, to share it.
    pub fn new(data: IoBufs) -> Shared {
        let (iov, keep) = data.into_parts();
        Shared {
            iov,
            keep: Arc::new(Mutex::new(keep)),
        }
    }

    /// A share for one request: same vectors, a reference to the owner.
    pub fn share(&self) -> IoBufs {
        // SAFETY: the vectors point into the memory `keep` owns (or raw memory the caller keeps
        // valid until completion); the share holds `keep` alive.
        unsafe { IoBufs::from_parts(self.iov.clone(), Some(Box::new(self.keep.clone()))) }
    }

    /// A share of `len` bytes from byte `at` of the memory (clipped to its end), for a
    /// request that moves part of it.
    pub fn slice(&self, at: usize, len: usize) -> IoBufs {
        let mut iov = Vec::new();
        let (mut skip, mut want) = (at, len);
        for v in &self.iov {
            if want == 0 {
                break;
            }
            if skip >= v.len {
                skip -= v.len;
                continue;
            }
            let n = (v.len - skip).min(want);
            iov.push(kiln_proto::iov::RawIov {
                base: v.base + skip,
                len: n,
            });
            skip = 0;
            want -= n;
        }
        // SAFETY: the vectors are within the ones `share` hands out, and the share holds
        // `keep` alive, as there.
        unsafe { IoBufs::from_parts(iov, Some(Box::new(self.keep.clone()))) }
    }

    /// The caller's memory back, once every share is gone.
    pub fn into_bufs(self) -> IoBufs {
        let keep = match Arc::try_unwrap(self.keep) {
            Ok(m) => m.into_inner().unwrap_or_else(|e| e.into_inner()),
            // A replica still holds a share (its request outlived its future): keep the share
            // as the owner; the memory is freed when both are done.
            Err(arc) => Some(Box::new(arc) as Box<dyn std::any::Any + Send>),
        };
        // SAFETY: as in `share`.
        unsafe { IoBufs::from_parts(self.iov, keep) }
    }
}

/// Iovecs kept beside the request without allocating, up to this many.
const INLINE: usize = 4;

/// The caller's memory for the tries of one fop sent again when it fails a certain way (a
/// file that moved while open): memory the caller lent raw is only described again (no
/// allocation for up to [`INLINE`] vectors); owned memory is [`Shared`].
pub struct Retry {
    first: Option<IoBufs>,
    inline: [kiln_proto::iov::RawIov; INLINE],
    spill: Vec<kiln_proto::iov::RawIov>,
    n: usize,
    shared: Option<Shared>,
    /// A read's other way out, given to every try.
    out: Option<Arc<crate::SpliceOut>>,
}

impl Retry {
    /// Takes the caller's memory.
    pub fn new(data: IoBufs) -> Retry {
        let out = data.splice_out().cloned();
        let (iov, keep) = data.into_parts();
        let none = kiln_proto::iov::RawIov { base: 0, len: 0 };
        let mut r = Retry {
            first: None,
            inline: [none; INLINE],
            spill: Vec::new(),
            n: iov.len(),
            shared: None,
            out,
        };
        match keep {
            None => {
                if iov.len() <= INLINE {
                    r.inline[..iov.len()].copy_from_slice(&iov);
                } else {
                    r.spill = iov.clone();
                }
                // SAFETY: the caller lent these vectors raw (`IoBufs::raw`): valid until the
                // fop completes, which every try is part of.
                r.first = Some(unsafe { IoBufs::raw(iov) });
            }
            // SAFETY: rebuilt exactly as `into_parts` gave them.
            Some(k) => r.shared = Some(Shared::new(unsafe { IoBufs::from_parts(iov, Some(k)) })),
        }
        r
    }

    /// The memory for the next try.
    pub fn take(&mut self) -> IoBufs {
        let b = self.take_memory();
        match &self.out {
            Some(o) => b.with_splice_out(o.clone()),
            None => b,
        }
    }

    fn take_memory(&mut self) -> IoBufs {
        if let Some(f) = self.first.take() {
            return f;
        }
        if let Some(s) = &self.shared {
            return s.share();
        }
        let iov = if self.n <= INLINE {
            self.inline[..self.n].to_vec()
        } else {
            self.spill.clone()
        };
        // SAFETY: as in `new`: the caller's raw vectors, valid until the fop completes.
        unsafe { IoBufs::raw(iov) }
    }

    /// The caller's memory back, from the try that succeeded (`used`, handed back by it).
    pub fn back(self, used: IoBufs) -> IoBufs {
        match self.shared {
            Some(s) => {
                drop(used);
                s.into_bufs()
            }
            None => used,
        }
    }
}
