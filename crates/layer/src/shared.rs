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
