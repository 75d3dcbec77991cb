//! A snapshot's copies agree on every replica, and hold a crash-consistent image, when one
//! replica is late: real kilnd bricks on an XFS file system (reflink) the test makes on a loop
//! device, and writers of 4 KiB blocks at random places all along.
//!
//! - Brick 2 raises its write barrier 100 ms late (every SNAP fop delayed): writes that ran on
//!   brick 2 while bricks 0 and 1 held them back leave brick 2's copy different; the snapshot
//!   reports those ranges, marks them, and heal makes the copies alike.
//! - Brick 2 runs one write per 50 ms (the delay holds its connection, as a slow disk would),
//!   so writes queue for it after bricks 0 and 1 ran them: writes in transit to brick 2 while
//!   the snapshot is taken run there after its barrier was lifted, never having waited at it. The bricks' records of which writes they ran find them.
//!
//! Needs root, mkfs.xfs and losetup; skips (saying why) without.

use crate::replica;
use kiln_testkit::xfs;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use replica::{volfile, wait_for, Brick};
use xfs::Xfs;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;
const BLOCKS: u64 = SIZE / 4096;

/// One write a writer made: its sequence number (the block's content), block, and span.
struct Write {
    seq: u64,
    block: u64,
    began: Instant,
    ended: Instant,
}

/// What a run's snapshot reported.
struct Outcome {
    /// Bytes the snapshot marked to be made alike.
    alike: u64,
    /// How long writes were held.
    held: Duration,
}

#[test]
fn snapshot_copies_agree_when_a_replica_freezes_late() {
    if let Some(o) = snapshot_under_writes("snap", 100_000, 1) {
        assert!(
            o.alike > 0,
            "no write waited at a barrier while brick 2 froze 100 ms late"
        );
    }
}

#[test]
fn snapshot_copies_agree_when_writes_reach_a_replica_late() {
    if let Some(o) = snapshot_under_writes("write", 50_000, 8) {
        assert!(
            o.alike > 0,
            "writes in transit to brick 2 were not found (held {:?})",
            o.held
        );
    }
}

/// Snapshots a 16 MiB image while `writers` threads write to it, brick 2's `slow` fops
/// delayed `delay_us`; checks that heal makes the snapshot's copies identical and that they
/// hold, per block, the last write done before the snapshot began or one overlapping it.
/// None (said why) where no XFS loop device can be made.
fn snapshot_under_writes(slow: &str, delay_us: u64, writers: u64) -> Option<Outcome> {
    if !kiln_testkit::is_root() {
        println!("skipping: loop devices need root");
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let xfs = match Xfs::make(tmp.path(), 1 << 30) {
        Ok(x) => x,
        Err(e) => {
            println!("skipping: cannot make an XFS file system on a loop device: {e}");
            return None;
        }
    };
    let bricks = vec![
        Brick::new(&xfs.mnt, 0),
        Brick::new(&xfs.mnt, 1),
        Brick::delayed(&xfs.mnt, 2, &[slow], Some((delay_us, 1.0))),
    ];
    let vf = volfile(&bricks);
    let vol = Arc::new(Volume::from_volfile(&vf).expect("client"));
    let (fd, _) = block_on(vol.create("disk.img", libc::O_RDWR, 0o644)).unwrap();
    let (r, _) = block_on(vol.pwritev(&fd, vec![vec![7u8; SIZE as usize]], 0));
    r.unwrap();

    // Writers of 4 KiB blocks at places a seeded generator picks, until told to stop; writer
    // t writes only blocks b with b % writers == t, so each block's writes are in order.
    // Block contents are the write's sequence number (from 1, rising), and each write's span
    // in time is kept: what the snapshot may hold of each block follows from them.
    let stop = Arc::new(AtomicBool::new(false));
    let seqs = Arc::new(AtomicU64::new(0));
    let log: Arc<Mutex<Vec<Write>>> = Arc::default();
    let threads: Vec<_> = (0..writers)
        .map(|t| {
            let (vol, fd, stop, seqs) = (vol.clone(), fd.clone(), stop.clone(), seqs.clone());
            let log = log.clone();
            std::thread::spawn(move || {
                let mut rng = kiln_testkit::rng::Rng(0x9e37_79b9_7f4a_7c15u64 ^ t);
                while !stop.load(Ordering::Relaxed) {
                    let block = rng.below(BLOCKS / writers) * writers + t;
                    let seq = seqs.fetch_add(1, Ordering::SeqCst) + 1;
                    let data = seq.to_le_bytes().repeat(512);
                    let began = Instant::now();
                    let (r, _) = block_on(vol.pwritev(&fd, vec![data], block * 4096));
                    r.expect("a write failed");
                    let ended = Instant::now();
                    log.lock().unwrap().push(Write {
                        seq,
                        block,
                        began,
                        ended,
                    });
                }
            })
        })
        .collect();
    let written = || log.lock().unwrap().len();
    // Enough writes to have some at every stage around the barrier; few, as brick 2 may be
    // slow (CI time).
    let enough = 20.max(4 * writers as usize);
    wait_for("writes to flow", 30, || written() > enough);
    let snapper = Volume::from_volfile(&vf).expect("snapshotter");
    let from = Instant::now();
    let (alike, held) = block_on(snapper.snapshot("disk.img", "s", 5000)).expect("snapshot");
    let to = Instant::now();
    let during = written();
    wait_for("more writes after the barrier", 30, || {
        written() > during + enough
    });
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }

    let healer = Volume::from_volfile(&vf).expect("healer");
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    let copies: Vec<Vec<u8>> = bricks.iter().map(|b| b.file(".disk.img@s")).collect();
    assert_eq!(copies[0].len() as u64, SIZE);
    for (i, c) in copies.iter().enumerate().skip(1) {
        let diff = c
            .chunks(4096)
            .zip(copies[0].chunks(4096))
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            diff, 0,
            "replica {i}'s copy differs from replica 0's in {diff} blocks"
        );
    }
    // Crash-consistent: each block holds the last write acknowledged before the snapshot
    // began, or one that overlapped it in time — never an older one, never a later one.
    let log = log.lock().unwrap();
    for (b, chunk) in copies[0].chunks(4096).enumerate() {
        let got = u64::from_le_bytes(chunk[..8].try_into().unwrap());
        let writes: Vec<&Write> = log.iter().filter(|w| w.block == b as u64).collect();
        let settled = writes
            .iter()
            .filter(|w| w.ended < from)
            .map(|w| w.seq)
            .max();
        let overlapping = |seq: u64| {
            writes
                .iter()
                .any(|w| w.seq == seq && w.began < to && w.ended >= from)
        };
        let ok = match settled {
            None if chunk.iter().all(|c| *c == 7) => true,
            Some(s) if got == s => true,
            _ => overlapping(got),
        };
        assert!(
            ok,
            "block {b} holds write {got}; the last one done before the snapshot was {settled:?}"
        );
    }
    println!(
        "{slow} delayed {delay_us} µs on brick 2, {writers} writer(s): writes held {held:?}; \
         {alike} B made alike; heal moved {} B in {} file(s)",
        report.bytes, report.files
    );
    block_on(vol.close(fd)).unwrap();
    Some(Outcome { alike, held })
}
