//! A snapshot's copies agree on every replica even when one replica raises its write barrier
//! late: real kilnd bricks on an XFS file system (reflink) the test makes on a loop device,
//! brick 2 with every SNAP fop delayed 100 ms, a client writing 4 KiB blocks at random places
//! all along. Writes that ran on brick 2 while bricks 0 and 1 held them back leave brick 2's
//! copy different; the snapshot reports those ranges, marks them, and heal makes the copies
//! alike. Needs root, mkfs.xfs and losetup; skips (saying why) without.

mod replica;
mod xfs;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use replica::{volfile, wait_for, Brick};
use xfs::Xfs;

const MIB: u64 = 1 << 20;

/// One write the writer made: its sequence number (the block's content), block, and span.
struct Write {
    seq: u64,
    block: u64,
    began: Instant,
    ended: Instant,
}
const SIZE: u64 = 16 * MIB;

#[test]
fn snapshot_copies_agree_when_a_replica_freezes_late() {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipping: loop devices need root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let xfs = match Xfs::make(tmp.path(), 1 << 30) {
        Ok(x) => x,
        Err(e) => {
            println!("skipping: cannot make an XFS file system on a loop device: {e}");
            return;
        }
    };
    let bricks = vec![
        Brick::new(&xfs.mnt, 0),
        Brick::new(&xfs.mnt, 1),
        Brick::delayed(&xfs.mnt, 2, &["snap"], Some((100_000, 1.0))),
    ];
    let vf = volfile(&bricks);
    let vol = Arc::new(Volume::from_volfile(&vf).expect("client"));
    let (fd, _) = block_on(vol.create("disk.img", libc::O_RDWR, 0o644)).unwrap();
    let (r, _) = block_on(vol.pwritev(&fd, vec![vec![7u8; SIZE as usize]], 0));
    r.unwrap();

    // A writer of 4 KiB blocks at places a seeded generator picks, until told to stop. Block
    // contents are the write's sequence number (from 1), and each write's span in time is
    // kept: what the snapshot may hold of each block follows from them.
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let log: Arc<Mutex<Vec<Write>>> = Arc::default();
    let writer = {
        let (vol, fd, stop, written) = (vol.clone(), fd.clone(), stop.clone(), written.clone());
        let log = log.clone();
        std::thread::spawn(move || {
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                seq += 1;
                let block = x % (SIZE / 4096);
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
                written.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    wait_for("writes to flow", 10, || {
        written.load(Ordering::Relaxed) > 100
    });
    let snapper = Volume::from_volfile(&vf).expect("snapshotter");
    let from = Instant::now();
    let (alike, held) = block_on(snapper.snapshot("disk.img", "s", 5000)).expect("snapshot");
    let to = Instant::now();
    let during = written.load(Ordering::Relaxed);
    wait_for("more writes after the barrier", 10, || {
        written.load(Ordering::Relaxed) > during + 100
    });
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(
        alike > 0,
        "no write waited at a barrier while brick 2 froze 100 ms late"
    );

    let healer = Volume::from_volfile(&vf).expect("healer");
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    let copies: Vec<Vec<u8>> = bricks.iter().map(|b| b.file(".disk.img@s")).collect();
    assert_eq!(copies[0].len() as u64, SIZE);
    for (i, c) in copies.iter().enumerate().skip(1) {
        let diff = c.iter().zip(&copies[0]).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff, 0,
            "replica {i}'s copy differs from replica 0's in {diff} bytes"
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
        "writes held {held:?}; {alike} B written meanwhile made alike; heal moved {} B in {} \
         file(s)",
        report.bytes, report.files
    );
    block_on(vol.close(fd)).unwrap();
}
