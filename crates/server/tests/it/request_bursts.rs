//! How the brick reads a burst of requests: small requests in a few `readv` calls, not one
//! each, while a stream of writes keeps its payloads out of the stage (bounded copies).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::time::Duration;

use kiln_client::{block_on, Client, Fh, RawIov};
use kiln_server::Listen;

const BS: usize = 4096;
const N: usize = 256;

/// Submits `N` reads of 4 KiB in one batch (one or a few sends) and waits for all of them.
fn read_burst(c: &Client, fh: Fh, bufs: &mut [Vec<u8>]) {
    let (tx, rx) = mpsc::channel::<Result<usize, u32>>();
    let iovs: Vec<RawIov> = bufs.iter_mut().map(|b| RawIov::of_mut(b)).collect();
    c.batch(|| {
        for (i, v) in iovs.iter().enumerate() {
            let t = tx.clone();
            // SAFETY: `bufs` outlives every completion: all N are awaited below.
            unsafe {
                c.preadv_raw(
                    fh,
                    std::slice::from_ref(v),
                    (i % 16 * BS) as u64,
                    Box::new(move |r| t.send(r).expect("send")),
                )
            }
            .expect("submit");
        }
    });
    for _ in 0..N {
        let r = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a completion within 30 s");
        assert_eq!(r, Ok(BS));
    }
}

#[test]
fn a_burst_of_small_reads_arrives_in_few_readv_calls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("b.sock");
    let bg = kiln_server::spawn_background(dir.path(), &[Listen::Unix(sock)]).expect("brick");
    let c = Client::connect(&bg.unix_addr().expect("unix address")).expect("connect");
    let (fh, _) = block_on(c.create("/f", libc::O_RDWR, 0o644)).expect("create");
    let data: Vec<u8> = (0..16 * BS).map(|i| (i * 7) as u8).collect();
    let (r, _) = block_on(c.pwritev(fh, vec![data.clone()], 0));
    assert_eq!(r.expect("write"), data.len());
    let fh = Fh(fh.0);
    let mut bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; BS]).collect();
    // The first burst follows a WRITE: the brick still reads frame by frame.
    read_burst(&c, fh, &mut bufs);
    let before = bg.stats.recv_calls.load(Relaxed);
    read_burst(&c, fh, &mut bufs);
    let calls = bg.stats.recv_calls.load(Relaxed) - before;
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(&b[..], &data[i % 16 * BS..][..BS], "read {i}");
    }
    // 256 read requests are 14 KiB; one readv per request would be 256 calls.
    assert!(
        calls <= N as u64 / 8,
        "{N} small reads took {calls} readv calls"
    );

    // Writes after the reads: at most one stage's worth of payload is copied, then the stage
    // is short again and each WRITE copies at most the short stage.
    let copied = bg.stats.bytes_copied.load(Relaxed);
    for i in 0..32u64 {
        let (r, _) = block_on(c.pwritev(
            kiln_client::Fh(fh.0),
            vec![vec![i as u8; BS]],
            i * BS as u64,
        ));
        assert_eq!(r.expect("write"), BS);
    }
    let copied = bg.stats.bytes_copied.load(Relaxed) - copied;
    assert!(
        copied <= (BS + 31 * 64) as u64,
        "32 writes copied {copied} bytes"
    );
}
