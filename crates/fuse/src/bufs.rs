//! Read buffers kept for reuse.

use std::sync::Mutex;

use kiln_client::PageBuf;

use crate::MAX_IO;

/// Read buffers kept for reuse, each as large as the largest request: a fresh 1 MiB
/// allocation is a fresh mapping, and receiving into it page-faults 256 times (measured:
/// ~400 µs of a 640 µs 1 MiB read). They are page-aligned, as the application's own buffers
/// usually are: the kernel's copies into them (from the socket) and out of them (to
/// `/dev/fuse`) then run at full speed.
#[derive(Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<PageBuf>>,
}

impl BufPool {
    const KEEP: usize = 64;

    /// A buffer of at least `size` bytes (at most [`MAX_IO`]).
    pub(crate) fn get(&self, size: usize) -> PageBuf {
        debug_assert!(size <= MAX_IO as usize);
        let kept = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        kept.unwrap_or_else(|| PageBuf::new(MAX_IO as usize))
    }

    pub(crate) fn put(&self, b: PageBuf) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < Self::KEEP {
            free.push(b);
        }
    }
}
