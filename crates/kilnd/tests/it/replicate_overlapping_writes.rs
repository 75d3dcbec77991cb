//! Writes from one client that overlap while in flight reach every replica in the same order:
//! four writers hammer the same few 4 KiB blocks of one file (each writer its own byte) on a
//! replica-3 volume whose bricks delay some writes at random, so a brick would often run two
//! overlapping writes in the other order than its neighbours did. No brick is ever away, so
//! no mark may name a miss: the three copies must be the same byte for byte.

use crate::replica;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use replica::{index_empty, volfile, wait_for, writers, Brick};

const FILE: &str = "hot";
/// Four blocks: the writers collide all the time.
const SIZE: u64 = 4 * 4096;

#[test]
fn overlapping_writes_in_flight_leave_the_replicas_identical() {
    let root = tempfile::tempdir().unwrap();
    // Each brick delays a different share of writes by a different time: a write overtakes
    // an earlier one on one brick and not on another.
    let bricks = vec![
        Brick::slow(root.path(), 0, Some((150, 0.3))),
        Brick::slow(root.path(), 1, Some((400, 0.5))),
        Brick::slow(root.path(), 2, None),
    ];
    let vol = Arc::new(Volume::from_volfile(&volfile(&bricks)).expect("connect"));
    let (fd, _) = block_on(vol.create(FILE, libc::O_RDWR, 0o644)).expect("create");
    let fd = Arc::new(fd);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let ws = writers(&vol, &fd, SIZE, &stop, &done);
    let d = done.clone();
    wait_for("4000 writes", 120, move || {
        d.load(Ordering::Relaxed) >= 4000
    });
    stop.store(true, Ordering::Relaxed);
    for w in ws {
        let (_, errors) = w.join().expect("writer");
        assert!(errors.is_empty(), "writes failed: {errors:?}");
    }
    block_on(vol.fsync(&fd, false)).expect("fsync");
    block_on(vol.close((*fd).clone())).expect("close");
    assert!(index_empty(&vol), "a mark although no brick was away");
    let copies: Vec<Vec<u8>> = bricks.iter().map(|b| b.file(FILE)).collect();
    assert_eq!(copies[0].len() as u64, SIZE);
    for (i, c) in copies.iter().enumerate().skip(1) {
        let differ = (0..SIZE as usize / 4096)
            .filter(|b| c[b * 4096..(b + 1) * 4096] != copies[0][b * 4096..(b + 1) * 4096])
            .count();
        assert_eq!(
            differ, 0,
            "brick {i}'s copy differs from brick 0's in {differ} blocks"
        );
    }
}
