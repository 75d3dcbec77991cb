//! Read buffers kept for reuse.

use std::sync::Mutex;

use kiln_client::PageBuf;
use kiln_proto::sync::MutexExt as _;

/// Read buffers kept for reuse: a fresh 1 MiB allocation is a fresh mapping, and receiving
/// into it page-faults 256 times (measured: ~400 µs of a 640 µs 1 MiB read). They are
/// page-aligned, as the application's own buffers usually are: the kernel's copies into them
/// (from the socket) and out of them (to `/dev/fuse`) then run at full speed.
#[derive(Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<PageBuf>>,
}

impl BufPool {
    const KEEP: usize = 64;

    /// A buffer of at least `size` bytes (a power of two: requests of one size reuse them).
    pub(crate) fn get(&self, size: usize) -> PageBuf {
        let kept = self.free.locked().pop();
        match kept {
            Some(b) if b.len() >= size => b,
            _ => PageBuf::new(size.next_power_of_two()),
        }
    }

    pub(crate) fn put(&self, b: PageBuf) {
        let mut free = self.free.locked();
        if free.len() < Self::KEEP {
            free.push(b);
        }
    }
}
