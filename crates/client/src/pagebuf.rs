//! Page-aligned buffers for payload.
//!
//! The kernel copies into and out of a buffer that starts on a page boundary at the speed it
//! copies for fio's and QEMU's buffers, which are aligned; a large `Vec` starts 16 bytes into
//! its page, and measured here a copy from the page cache into one ran at three quarters of
//! that speed (`bench/README.md`, "Steady streaming").

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// A zero-filled buffer of a fixed size, starting on a page boundary.
pub struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value alone.
unsafe impl Send for PageBuf {}
// SAFETY: shared references only read it.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1), 4096).expect("a valid layout")
    }

    /// `len` zero bytes (a large one is a fresh mapping: its pages cost nothing until used).
    pub fn new(len: usize) -> PageBuf {
        // SAFETY: a non-zero-sized layout; the result is checked.
        let raw = unsafe { std::alloc::alloc_zeroed(PageBuf::layout(len)) };
        let ptr = NonNull::new(raw)
            .unwrap_or_else(|| std::alloc::handle_alloc_error(PageBuf::layout(len)));
        PageBuf { ptr, len }
    }

    /// `len` bytes of `fill`.
    pub fn filled(len: usize, fill: u8) -> PageBuf {
        let mut b = PageBuf::new(len);
        b.fill(fill);
        b
    }
}

impl Deref for PageBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised (zeroed at allocation) bytes at `ptr`, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), PageBuf::layout(self.len)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_a_page_and_hold_what_they_were_given() {
        for len in [1, 4096, 128 << 10, (1 << 20) + 16] {
            let b = PageBuf::filled(len, 7);
            assert_eq!(b.as_ptr() as usize % 4096, 0, "{len}");
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 7));
            assert!(PageBuf::new(len).iter().all(|&x| x == 0));
        }
    }
}
