//! Scatter-gather direct I/O: one 1 MiB O_DIRECT preadv/pwritev of 256 × 4 KiB iovecs reaches
//! the brick as ONE READ / ONE WRITE of 1 MiB, counted by the brick itself.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use common::Mounted;
use kiln_fuse::Mode;
use kiln_proto::Op;

/// A page-aligned buffer, as O_DIRECT wants.
struct Aligned {
    ptr: *mut u8,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Aligned { ptr, len }
    }
    fn slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `len` initialised bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr,
                std::alloc::Layout::from_size_align(self.len, 4096).expect("layout"),
            )
        }
    }
}

fn iovecs(buf: &mut Aligned) -> Vec<libc::iovec> {
    (0..256)
        .map(|i| libc::iovec {
            iov_base: buf.ptr.wrapping_add(i * 4096).cast(),
            iov_len: 4096,
        })
        .collect()
}

fn one_request_each_way(mode: Mode) {
    let m = Mounted::new(mode);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("image.raw"))
        .expect("open O_DIRECT");
    let mut src = Aligned::new(1 << 20);
    for (i, b) in src.slice().iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2654435761).to_le_bytes()[1];
    }
    let (w0, r0) = (m.stats.calls(Op::Write), m.stats.calls(Op::Read));
    let iov = iovecs(&mut src);
    // SAFETY: 256 valid iovecs over `src`.
    let n = unsafe { libc::pwritev(f.as_raw_fd(), iov.as_ptr(), 256, 0) };
    assert_eq!(n, 1 << 20, "pwritev: {}", std::io::Error::last_os_error());
    assert_eq!(
        m.stats.calls(Op::Write) - w0,
        1,
        "256 × 4 KiB O_DIRECT pwritev must be ONE brick WRITE"
    );

    let mut dst = Aligned::new(1 << 20);
    let iov = iovecs(&mut dst);
    // SAFETY: 256 valid iovecs over `dst`.
    let n = unsafe { libc::preadv(f.as_raw_fd(), iov.as_ptr(), 256, 0) };
    assert_eq!(n, 1 << 20, "preadv: {}", std::io::Error::last_os_error());
    assert_eq!(
        m.stats.calls(Op::Read) - r0,
        1,
        "256 × 4 KiB O_DIRECT preadv must be ONE brick READ"
    );
    assert!(src.slice() == dst.slice(), "data read back differs");
    assert_eq!(
        std::fs::read(m.brick().join("image.raw")).expect("brick file"),
        src.slice(),
        "brick holds the data"
    );
}

#[test]
fn one_read_and_one_write_per_megabyte_in_vm_image_mode() {
    one_request_each_way(Mode::VmImage);
}

#[test]
fn one_read_and_one_write_per_megabyte_in_general_mode() {
    one_request_each_way(Mode::General);
}
