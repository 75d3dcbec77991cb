//! A read's other way out ([`kiln_client::SpliceOut`]), with a real brick over TCP: the
//! payload goes from the socket to the descriptor behind its head, never into the read's
//! memory; where the descriptor refuses it, it lands in the memory as an ordinary read's
//! would; over a Unix socket it is never tried. Many reads in flight, replies interleaved.

mod common;

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::Arc;

use common::Kilnd;
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
        let iov = [RawIov {
            base: buf.as_mut_ptr() as usize,
            len,
        }];
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
