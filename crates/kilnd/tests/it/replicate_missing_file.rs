//! A write to a file that one replica lacks — a new brick before heal made it, or a name it
//! missed — costs the other replicas one request each: the write itself records that the
//! third missed it (WRITE_MARKED), with no MARK_ADD round trip after it. Three real brick
//! processes; io-stats between the replicate layer and each protocol-client counts the fops
//! each brick was sent; heal then makes the three copies identical.

use crate::replica;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use kiln_proto::Op;
use replica::{calls, counted, index_empty, volfile, wait_for, Brick};

#[test]
fn a_write_to_a_file_a_replica_lacks_records_the_miss_in_the_same_request() {
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let vol = Volume::from_volfile(&counted(&bricks)).expect("connect");

    // The file is made while brick 2 is down: it misses the create.
    bricks[2].kill9();
    let flags = libc::O_RDWR | libc::O_CREAT;
    let (fd, _) = block_on(vol.create("img", flags, 0o644)).unwrap();
    let (r, _) = block_on(vol.pwritev(&fd, vec![vec![1u8; 256 << 10]], 0));
    assert_eq!(r.unwrap(), 256 << 10);
    block_on(vol.close(fd)).unwrap();
    bricks[2].start();
    let rep = heal::replicate_layers(vol.top()).remove(0);
    wait_for("the client to reconnect", 30, || rep.children()[2].up());
    let fd = block_on(vol.open("img", libc::O_RDWR)).unwrap();
    assert!(!bricks[2].dir.join("img").exists());
    let before: Vec<[u64; 3]> = (0..3)
        .map(|i| {
            let s = format!("stats-{i}");
            [Op::Write, Op::WriteMarked, Op::MarkAdd].map(|op| calls(&s, op))
        })
        .collect();
    let writes = 32u64;
    for k in 0..writes {
        let (r, _) = block_on(vol.pwritev(&fd, vec![vec![k as u8 + 2; 4096]], k * 8192));
        assert_eq!(r.expect("a write with a replica lacking the file"), 4096);
    }
    for (i, was) in before.iter().enumerate().take(2) {
        let s = format!("stats-{i}");
        let now = [Op::Write, Op::WriteMarked, Op::MarkAdd].map(|op| calls(&s, op));
        let d: Vec<u64> = now.iter().zip(was).map(|(a, b)| a - b).collect();
        assert_eq!(
            d,
            vec![0, writes, 0],
            "brick {i}: (write, write_marked, mark_add) calls for {writes} writes"
        );
    }
    block_on(vol.close(fd)).unwrap();

    // What the members recorded is what heal needs: the copies end identical.
    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer");
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(index_empty(&healer), "marks left after heal");
    let want = bricks[0].file("img");
    assert_eq!(want.len(), 256 << 10);
    for k in 0..writes {
        let at = (k * 8192) as usize;
        assert!(
            want[at..at + 4096].iter().all(|b| *b == k as u8 + 2),
            "block {k}"
        );
    }
    for b in &bricks[1..] {
        assert!(b.file("img") == want, "{} differs", b.dir.display());
    }
}
