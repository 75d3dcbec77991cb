//! Scatter-gather direct I/O: one 1 MiB O_DIRECT preadv/pwritev of 256 × 4 KiB iovecs reaches
//! the brick as ONE READ / ONE WRITE of 1 MiB, counted by the brick itself. And reads from a
//! brick over TCP answered by splice (`splice`, below).

use crate::common;

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

mod splice {
    //! Reads from a brick over TCP answered by splice (socket → pipe → `/dev/fuse`, never in the
    //! mount's memory): the application gets the file's bytes at every size and offset, with many
    //! reads in flight, after the file changed on the brick, and at its end; the reads that can't
    //! go that way (too small, too big for the pipe) come the ordinary way; `--splice off` gives
    //! the same bytes without splicing any.

    use std::os::unix::fs::FileExt;
    use std::path::PathBuf;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::Duration;

    use super::common::{same_bytes, seed, Rng};
    use kiln_client::Volume;
    use kiln_fuse::Mode;
    use kiln_server::Listen;

    /// A mount of a brick reached over loopback TCP, both in this process.
    struct TcpMount {
        dir: tempfile::TempDir,
        counters: Arc<kiln_fuse::Counters>,
        session: Option<fuser::BackgroundSession>,
    }

    impl TcpMount {
        fn new(mode: Mode, splice: bool) -> TcpMount {
            let dir = tempfile::tempdir().expect("tempdir");
            std::fs::create_dir(dir.path().join("brick")).expect("brick");
            std::fs::create_dir(dir.path().join("mnt")).expect("mnt");
            let any = Listen::Tcp("127.0.0.1:0".parse().expect("address"));
            let server =
                kiln_server::spawn_background(&dir.path().join("brick"), &[any]).expect("server");
            let addr = server.tcp_addr().expect("a TCP address");
            let vol = Volume::connect(&addr).expect("connect");
            let fs = kiln_fuse::KilnFs::new(Arc::new(vol), mode, Duration::from_secs(1))
                .expect("the volume's root")
                .with_passthrough(false)
                .with_splice(splice);
            let counters = fs.counters();
            let session = kiln_fuse::serve_background(fs, "tcp:/vol", &dir.path().join("mnt"), 4)
                .expect("mount");
            TcpMount {
                dir,
                counters,
                session: Some(session),
            }
        }

        fn brick(&self, name: &str) -> PathBuf {
            self.dir.path().join("brick").join(name)
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join("mnt").join(name)
        }

        fn spliced(&self) -> u64 {
            self.counters.spliced.load(Relaxed)
        }
    }

    impl Drop for TcpMount {
        fn drop(&mut self) {
            if let Some(s) = self.session.take() {
                let _ = s.umount_and_join();
            }
        }
    }

    /// `len` bytes that differ at every 8-byte word of a file (a read from the wrong offset
    /// shows).
    fn content(len: usize, seed: u64) -> Vec<u8> {
        (0..len)
            .map(|i| {
                ((i as u64 / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes()[i % 8]
            })
            .collect()
    }

    /// 3 MiB and a ragged tail: the last reads are short.
    const LEN: usize = (3 << 20) + 5000;

    fn read_at(f: &std::fs::File, off: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        let mut got = 0;
        while got < len {
            let n = f.read_at(&mut buf[got..], off + got as u64).expect("read");
            if n == 0 {
                break;
            }
            got += n;
        }
        buf.truncate(got);
        buf
    }

    /// Reads of every kind through `m` give `data`'s bytes.
    fn reads_match(m: &TcpMount, data: &[u8]) {
        let f = std::fs::File::open(m.path("image.raw")).expect("open");
        for (off, len) in [
            (0usize, 128 << 10),
            (128 << 10, 64 << 10),
            (1 << 20, 256 << 10),
            (12288, 128 << 10),
            (0, 1 << 20),
            (4096, 4096),
            (LEN - 100_000, 128 << 10),
            (LEN - 10, 128 << 10),
        ] {
            let got = read_at(&f, off as u64, len);
            let want = &data[off.min(data.len())..(off + len).min(data.len())];
            same_bytes(&got, want, &format!("{len} bytes at {off}"));
        }
    }

    #[test]
    fn reads_over_tcp_are_spliced_and_give_the_files_bytes() {
        let m = TcpMount::new(Mode::VmImage, true);
        let data = content(LEN, 7);
        std::fs::write(m.brick("image.raw"), &data).expect("write on the brick");
        reads_match(&m, &data);
        let spliced = m.spliced();
        assert!(
            spliced >= 5,
            "the reads of 64 KiB to 256 KiB went by splice ({spliced} did)"
        );

        // Many in flight at once, at random page-aligned offsets.
        let mut rng = Rng(seed("reads_over_tcp_are_spliced"));
        let offsets: Vec<Vec<u64>> = (0..4)
            .map(|_| {
                (0..40)
                    .map(|_| rng.below((LEN >> 12) as u64) << 12)
                    .collect()
            })
            .collect();
        let data = Arc::new(data);
        let readers: Vec<_> = offsets
            .into_iter()
            .map(|offs| {
                let (data, path) = (data.clone(), m.path("image.raw"));
                std::thread::spawn(move || {
                    let f = std::fs::File::open(path).expect("open");
                    for off in offs {
                        let got = read_at(&f, off, 128 << 10);
                        let end = (off as usize + (128 << 10)).min(data.len());
                        same_bytes(&got, &data[off as usize..end], &format!("128 KiB at {off}"));
                    }
                })
            })
            .collect();
        for r in readers {
            r.join().expect("reader");
        }
        assert!(
            m.spliced() >= spliced + 100,
            "the readers' reads were spliced"
        );

        // Changed on the brick: the next reads give the new bytes (nothing is left in a pipe).
        let new = content(LEN, 91);
        std::fs::write(m.brick("image.raw"), &new).expect("rewrite on the brick");
        reads_match(&m, &new);
    }

    #[test]
    fn spliced_reads_beside_short_reads_stay_in_step() {
        // A short answer (10 bytes at the end) received into a read's memory together with the
        // start of the next reply, a spliced one: that reply is received the ordinary way.
        let m = TcpMount::new(Mode::VmImage, true);
        let data = Arc::new(content(LEN, 5));
        std::fs::write(m.brick("image.raw"), &*data).expect("write on the brick");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let short = {
            let (data, path, stop) = (data.clone(), m.path("image.raw"), stop.clone());
            std::thread::spawn(move || {
                let f = std::fs::File::open(path).expect("open");
                let mut n = 0;
                while !stop.load(Relaxed) || n < 200 {
                    let got = read_at(&f, (LEN - 10) as u64, 4096);
                    same_bytes(&got, &data[LEN - 10..], "the last 10 bytes");
                    n += 1;
                }
            })
        };
        let f = std::fs::File::open(m.path("image.raw")).expect("open");
        for i in 0..300usize {
            let off = (i * 4096 * 7) % (LEN - (128 << 10));
            let got = read_at(&f, off as u64, 128 << 10);
            same_bytes(
                &got,
                &data[off..off + (128 << 10)],
                &format!("128 KiB at {off}"),
            );
        }
        stop.store(true, Relaxed);
        short.join().expect("short reader");
        assert!(m.spliced() > 0);
    }

    #[test]
    fn page_cache_reads_over_tcp_are_spliced_too() {
        let m = TcpMount::new(Mode::General, true);
        let data = content(LEN, 13);
        std::fs::write(m.brick("image.raw"), &data).expect("write on the brick");
        let got = std::fs::read(m.path("image.raw")).expect("read through the page cache");
        same_bytes(&got, &data, "the whole file");
        assert!(m.spliced() > 0, "readahead's reads went by splice");
    }

    #[test]
    fn with_splice_off_nothing_is_spliced_and_the_bytes_are_the_same() {
        let m = TcpMount::new(Mode::VmImage, false);
        let data = content(LEN, 29);
        std::fs::write(m.brick("image.raw"), &data).expect("write on the brick");
        reads_match(&m, &data);
        assert_eq!(m.spliced(), 0);
    }
}
