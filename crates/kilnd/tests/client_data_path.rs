//! Data read back equals data written, for random offsets, lengths and iovec shapes, over TCP
//! and Unix sockets, through every client API; many requests in flight, replies out of order.

mod common;

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
    let iovs: Vec<RawIov> = bufs
        .iter_mut()
        .map(|b| RawIov {
            base: b.as_mut_ptr() as usize,
            len: BS,
        })
        .collect();
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
        let v = [RawIov {
            base: b.as_mut_ptr() as usize,
            len: b.len(),
        }];
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
