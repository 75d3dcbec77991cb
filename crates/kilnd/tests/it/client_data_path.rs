//! Data read back equals data written, for random offsets, lengths and iovec shapes, over TCP
//! and Unix sockets, through every client API; many requests in flight, replies out of order.

use crate::common;

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use common::{seed, Kilnd, Rng};
use kiln_client::{block_on, Client, RawIov};

const FILE_MAX: u64 = 3 << 20;

/// Splits `len` bytes into a random iovec shape: odd sizes, zero-length entries.
fn shape(rng: &mut Rng, len: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = len;
    while left > 0 {
        if rng.below(6) == 0 {
            out.push(0);
        }
        let take = match rng.below(4) {
            0 => 1 + rng.below(7) as usize,
            1 => 1 + rng.below(4096) as usize,
            2 => 4096,
            _ => 1 + rng.below(300_000) as usize,
        }
        .min(left);
        out.push(take);
        left -= take;
    }
    if rng.below(3) == 0 {
        out.push(0);
    }
    out
}

fn random_roundtrip(addr: &str, test: &str) {
    let s = seed(test);
    let mut rng = Rng(s);
    let c = Client::connect(addr).expect("connect");
    let (fh, _) =
        block_on(c.create("/data.bin", libc::O_RDWR | libc::O_EXCL, 0o644)).expect("create");
    let mut model: Vec<u8> = Vec::new();
    for round in 0..200 {
        let off = rng.below(FILE_MAX) as usize;
        let max_len = if rng.below(4) == 0 { 2 << 20 } else { 70_000 };
        let len = rng.below(max_len) as usize;
        if rng.below(2) == 0 {
            // Write with a random shape through the owned async API or the blocking one.
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let parts = shape(&mut rng, len);
            let mut at = 0;
            let bufs: Vec<Vec<u8>> = parts
                .iter()
                .map(|&n| {
                    let b = data[at..at + n].to_vec();
                    at += n;
                    b
                })
                .collect();
            let n = if rng.below(2) == 0 {
                block_on(c.pwritev(fh, bufs, off as u64)).0
            } else {
                let slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
                c.pwritev_blocking(fh, &slices, off as u64)
            }
            .unwrap_or_else(|e| panic!("seed {s} round {round}: write failed: {e}"));
            assert_eq!(n, len, "seed {s} round {round}: short write");
            if len > 0 {
                if model.len() < off + len {
                    model.resize(off + len, 0);
                }
                model[off..off + len].copy_from_slice(&data);
            }
        } else {
            // Read with a random shape, often crossing the end of file.
            let parts = shape(&mut rng, len);
            let expect_n = model.len().saturating_sub(off).min(len);
            let got: Vec<u8> = if rng.below(2) == 0 {
                let bufs: Vec<Vec<u8>> = parts.iter().map(|&n| vec![0xAA; n]).collect();
                let (n, bufs) = block_on(c.preadv(fh, bufs, off as u64));
                let n = n.unwrap_or_else(|e| panic!("seed {s} round {round}: read failed: {e}"));
                assert_eq!(
                    n, expect_n,
                    "seed {s} round {round}: read length (off {off} len {len})"
                );
                bufs.concat()[..n].to_vec()
            } else {
                let mut bufs: Vec<Vec<u8>> = parts.iter().map(|&n| vec![0xAA; n]).collect();
                let mut slices: Vec<IoSliceMut<'_>> =
                    bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                let n = c
                    .preadv_blocking(fh, &mut slices, off as u64)
                    .unwrap_or_else(|e| panic!("seed {s} round {round}: read failed: {e}"));
                assert_eq!(
                    n, expect_n,
                    "seed {s} round {round}: read length (off {off} len {len})"
                );
                let all = bufs.concat();
                // Bytes past the end of file are left untouched.
                assert!(
                    all[n..].iter().all(|&b| b == 0xAA),
                    "seed {s} round {round}: bytes past EOF were written"
                );
                all[..n].to_vec()
            };
            assert!(
                got == model[off.min(model.len())..off.min(model.len()) + expect_n],
                "seed {s} round {round}: data differs at off {off} len {len}"
            );
        }
    }
    assert_eq!(
        c.stats().bytes_copied.load(Ordering::Relaxed),
        0,
        "the read path copied payload"
    );
    assert!(c.stats().payload_bytes_in.load(Ordering::Relaxed) > 0);
    block_on(c.close(fh)).expect("close");
}

#[test]
fn random_shapes_roundtrip_over_tcp() {
    let k = Kilnd::start();
    random_roundtrip(&k.tcp, "random_shapes_roundtrip_over_tcp");
}

#[test]
fn random_shapes_roundtrip_over_unix_socket() {
    let k = Kilnd::start();
    random_roundtrip(&k.unix, "random_shapes_roundtrip_over_unix_socket");
    // The file is real, on the brick, with the size the model says.
    assert!(
        std::fs::metadata(k.brick.join("data.bin"))
            .expect("brick file")
            .len()
            > 0
    );
}

#[test]
fn many_in_flight_with_replies_out_of_order() {
    let k = Kilnd::start();
    let c = Client::connect(&k.tcp).expect("connect");
    const N: usize = 96;
    const BS: usize = 8192;
    let (fh, _) = block_on(c.create("/oo.bin", libc::O_RDWR, 0o644)).expect("create");
    let mut content = vec![0u8; N * BS];
    for (i, b) in content.iter_mut().enumerate() {
        *b = (i / BS) as u8 ^ (i as u8).rotate_left(3);
    }
    assert_eq!(
        block_on(c.pwritev(fh, vec![content.clone()], 0))
            .0
            .expect("write"),
        content.len()
    );

    // One burst: an fsync first (served off the connection's thread), then N reads of distinct
    // blocks. The reads' replies overtake the fsync's.
    let (tx, rx) = mpsc::channel::<(usize, Result<usize, u32>)>();
    let mut bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; BS]).collect();
    let iovs: Vec<RawIov> = bufs.iter_mut().map(|b| RawIov::of_mut(b)).collect();
    c.batch(|| {
        let t = tx.clone();
        c.fsync_raw(
            fh,
            false,
            Box::new(move |r| t.send((usize::MAX, r.map(|_| 0))).expect("send")),
        )
        .expect("fsync");
        for (i, v) in iovs.iter().enumerate().rev() {
            let t = tx.clone();
            // SAFETY: `bufs` outlives every completion: we wait for all N + 1 below.
            unsafe {
                c.preadv_raw(
                    kiln_client::Fh(fh.0),
                    std::slice::from_ref(v),
                    (i * BS) as u64,
                    Box::new(move |r| t.send((i, r)).expect("send")),
                )
            }
            .expect("submit");
        }
    });
    let mut order = Vec::new();
    for _ in 0..=N {
        let (i, r) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a completion within 30 s");
        assert!(r.is_ok(), "request {i} failed: {r:?}");
        if i != usize::MAX {
            assert_eq!(r.unwrap(), BS);
        }
        order.push(i);
    }
    let fsync_pos = order
        .iter()
        .position(|&i| i == usize::MAX)
        .expect("fsync completed");
    assert!(
        fsync_pos > 0,
        "the fsync submitted first should not complete first: {order:?}"
    );
    // Reads were submitted in reverse block order; replies matched by id put every block's
    // data in its own buffer.
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(
            &b[..],
            &content[i * BS..(i + 1) * BS],
            "block {i} landed in the wrong buffer"
        );
    }
    let s = c.stats();
    assert!(
        s.send_calls.load(Ordering::Relaxed) < s.requests.load(Ordering::Relaxed),
        "the burst left in fewer sendmsg calls than frames"
    );
    assert_eq!(s.bytes_copied.load(Ordering::Relaxed), 0);
}

#[test]
fn server_killed_mid_request_fails_every_caller() {
    let mut k = Kilnd::start();
    let c = Client::connect(&k.tcp).expect("connect");
    let (fh, _) = block_on(c.create("/big.bin", libc::O_RDWR, 0o644)).expect("create");
    let big = vec![7u8; 8 << 20];
    block_on(c.pwritev(fh, vec![big], 0)).0.expect("write");
    // Keep 64 × 1 MiB reads in flight and kill the server under them.
    let (tx, rx) = mpsc::channel();
    let mut bufs: Vec<Vec<u8>> = (0..64).map(|_| vec![0u8; 1 << 20]).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        let t = tx.clone();
        let v = [RawIov::of_mut(b)];
        // SAFETY: `bufs` outlives the completions, all awaited below.
        unsafe {
            c.preadv_raw(
                fh,
                &v,
                ((i % 8) << 20) as u64,
                Box::new(move |r| t.send(r).expect("send")),
            )
        }
        .expect("submit");
    }
    k.kill();
    let mut errors = 0;
    for _ in 0..64 {
        let r = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("every request completes: no hang");
        errors += r.is_err() as usize;
    }
    assert!(
        errors > 0 || c.is_dead(),
        "killing the server must surface as errors"
    );
    // After the connection is gone, calls fail at once instead of hanging.
    let r = block_on(c.lookup("/big.bin"));
    assert!(r.is_err(), "a call on a dead connection must fail");
    assert!(c.is_dead());
}

/// Short reads from several threads on one connection: a reply shorter than its request's
/// buffer, received while another request is on its way, must not take the next reply's bytes
/// for its own (the receive that expects one reply may find two).
#[test]
fn short_replies_while_others_are_in_flight() {
    let k = Kilnd::start();
    let c = std::sync::Arc::new(Client::connect(&k.tcp).expect("connect"));
    let (fh, _) = block_on(c.create("short.bin", libc::O_RDWR, 0o644)).expect("create");
    let content = b"sixteen bytes!!!";
    assert_eq!(
        c.pwritev_blocking(fh, &[IoSlice::new(content)], 0)
            .expect("write"),
        content.len()
    );
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..3000 {
                    let mut buf = vec![0xAAu8; 256];
                    let n = c
                        .preadv_blocking(fh, &mut [IoSliceMut::new(&mut buf)], 0)
                        .unwrap_or_else(|e| panic!("thread {t} read {i}: {e}"));
                    assert_eq!(&buf[..n], content, "thread {t} read {i}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("reader thread");
    }
}

mod splice {
    //! A read's other way out ([`kiln_client::SpliceOut`]), with a real brick over TCP: the
    //! payload goes from the socket to the descriptor behind its head, never into the read's
    //! memory; where the descriptor refuses it, it lands in the memory as an ordinary read's
    //! would; over a Unix socket it is never tried. Many reads in flight, replies interleaved.

    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::mpsc;
    use std::sync::Arc;

    use super::common::Kilnd;
    use kiln_client::{block_on, RawIov, SpliceOut, Volume};

    const LEN: usize = 2 << 20;

    fn content(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i as u64 / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 7).to_le_bytes()[i % 8])
            .collect()
    }

    /// A pipe big enough for a few reads and their heads: (read end, write end).
    fn pipe() -> (std::fs::File, OwnedFd) {
        let mut fds = [0i32; 2];
        // SAFETY: room for the two descriptors.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: just made, ours.
        let (r, w) = unsafe {
            (
                std::fs::File::from_raw_fd(fds[0]),
                OwnedFd::from_raw_fd(fds[1]),
            )
        };
        // SAFETY: fcntl on our descriptor.
        assert!(unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) } > 0);
        (r, w)
    }

    /// Reads `len` bytes at each of `offsets` through `out` (a fresh way out per read, to the
    /// same descriptor), all in flight together; returns per read whether it went out, and the
    /// bytes that landed in its memory.
    fn reads(
        vol: &Volume,
        fd: &kiln_client::Fd,
        out: &Arc<OwnedFd>,
        offsets: &[u64],
        len: usize,
    ) -> Vec<(bool, Vec<u8>)> {
        let (tx, rx) = mpsc::channel();
        for (i, &off) in offsets.iter().enumerate() {
            let mut buf = vec![0u8; len];
            let iov = [RawIov::of_mut(&mut buf)];
            let tag = off;
            let way = Arc::new(SpliceOut::new(out.clone(), move |n| {
                let mut h = tag.to_le_bytes().to_vec();
                h.extend_from_slice(&(n as u64).to_le_bytes());
                h
            }));
            let (went, tx) = (way.clone(), tx.clone());
            let done = Box::new(move |r: Result<usize, u32>| {
                let n = r.expect("read");
                buf.truncate(n);
                tx.send((i, went.was_sent(), buf)).expect("send");
            });
            // SAFETY: `buf` moves into `done`, which runs after the read is over.
            unsafe { vol.preadv_raw_to(fd, &iov, off, way, done) };
        }
        let mut got: Vec<Option<(bool, Vec<u8>)>> = vec![None; offsets.len()];
        for _ in offsets {
            let (i, sent, buf) = rx.recv().expect("completion");
            got[i] = Some((sent, buf));
        }
        got.into_iter().map(|g| g.expect("every read")).collect()
    }

    #[test]
    fn over_tcp_the_payload_goes_out_behind_its_head() {
        let k = Kilnd::start();
        let data = content(LEN);
        std::fs::write(k.brick.join("f"), &data).expect("write");
        let vol = Volume::connect(&k.tcp).expect("connect");
        let fd = block_on(vol.open("f", libc::O_RDONLY)).expect("open");
        let (mut r, w) = pipe();
        let w = Arc::new(w);
        let offsets = [0u64, 131_072, 1 << 20, (LEN - 50_000) as u64];
        let got = reads(&vol, &fd, &w, &offsets, 128 << 10);
        let mut out = Vec::new();
        drop(w);
        // Every way out is dropped with its read: the pipe's write end is closed.
        r.read_to_end(&mut out).expect("the pipe");
        let mut at = 0;
        let mut seen = Vec::new();
        while at < out.len() {
            let tag = u64::from_le_bytes(out[at..at + 8].try_into().unwrap());
            let n = u64::from_le_bytes(out[at + 8..at + 16].try_into().unwrap()) as usize;
            let off = tag as usize;
            let want = &data[off..(off + (128 << 10)).min(LEN)];
            assert_eq!(n, want.len(), "the head says the payload's length");
            assert!(
                out[at + 16..at + 16 + n] == *want,
                "the payload at {off} is the file's"
            );
            seen.push(tag);
            at += 16 + n;
        }
        seen.sort();
        assert_eq!(seen, offsets, "each read went out once, whole");
        for (sent, buf) in got {
            assert!(sent, "went out");
            assert!(buf.iter().all(|b| *b == 0), "nothing landed in its memory");
        }
    }

    /// This process's connections' count of splices that fell back.
    fn fallbacks() -> u64 {
        let mut s = kiln_layer::metrics::Scrape::default();
        kiln_client::conn::render_metrics(&mut s);
        let text = s.encode();
        text.lines()
            .find_map(|l| l.strip_prefix("kiln_client_splice_fallbacks_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .expect("the counter") as u64
    }

    #[test]
    fn where_the_descriptor_refuses_the_payload_lands_in_memory() {
        let k = Kilnd::start();
        let data = content(LEN);
        std::fs::write(k.brick.join("f"), &data).expect("write");
        // Read-only: splicing into it fails, after the payload is in the pipe.
        let ro: OwnedFd = std::fs::File::open(k.brick.join("f")).expect("open").into();
        let ro = Arc::new(ro);
        // Both kept open to the end: the count sums the connections alive.
        let vols: Vec<(&String, Volume)> = [&k.tcp, &k.unix]
            .into_iter()
            .map(|a| (a, Volume::connect(a).expect("connect")))
            .collect();
        for (addr, vol) in &vols {
            let before = fallbacks();
            let fd = block_on(vol.open("f", libc::O_RDONLY)).expect("open");
            let offsets: Vec<u64> = (0..12).map(|i| i * 150_000).collect();
            for (i, (sent, buf)) in reads(vol, &fd, &ro, &offsets, 96 << 10)
                .into_iter()
                .enumerate()
            {
                let off = offsets[i] as usize;
                assert!(!sent, "{addr}: nothing went out");
                assert!(
                    buf == data[off..off + (96 << 10)],
                    "{addr}: the read at {off} landed in memory"
                );
            }
            let tried = fallbacks() - before;
            match addr.starts_with("tcp:") {
                true => assert!(tried >= 12, "over TCP each read tried splice ({tried} did)"),
                false => assert_eq!(tried, 0, "never over a Unix socket"),
            }
        }
    }
}
