//! Read buffers kept for reuse.

use std::sync::Mutex;

/// Read buffers kept for reuse: a fresh 1 MiB allocation is a fresh mapping, and receiving
/// into it page-faults 256 times (measured: ~400 µs of a 640 µs 1 MiB read).
#[derive(Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl BufPool {
    const KEEP: usize = 64;

    pub(crate) fn get(&self, size: usize) -> Vec<u8> {
        let mut b = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        b.clear();
        b.reserve(size);
        b
    }

    pub(crate) fn put(&self, b: Vec<u8>) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < Self::KEEP {
            free.push(b);
        }
    }
}
