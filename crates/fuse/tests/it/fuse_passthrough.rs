//! FUSE passthrough on a vm-image mount of a brick on this host: a file opened read-only is
//! read by the kernel straight from the brick's file — the brick serves no READ for it, and
//! the bytes are the brick file's — while a writer opening the same file meanwhile still goes
//! through the mount (its writes reach the brick as WRITEs, and the reader sees them). With
//! `--passthrough off` the same reads reach the brick.

use crate::common;

use std::os::unix::fs::FileExt;

use common::Mounted;
use kiln_fuse::Mode;
use kiln_proto::Op;

const SIZE: usize = 4 << 20;

fn pattern() -> Vec<u8> {
    (0..SIZE).map(|i| (i * 31 % 251) as u8).collect()
}

#[test]
fn read_only_opens_read_the_bricks_file_and_writers_still_go_through() {
    let m = Mounted::with_passthrough(Mode::VmImage, true);
    std::fs::write(m.brick().join("base.img"), pattern()).unwrap();
    let reads = m.stats.calls(Op::Read);
    let r = std::fs::File::open(m.path("base.img")).unwrap();
    let mut got = vec![0u8; SIZE];
    r.read_exact_at(&mut got, 0).unwrap();
    assert!(got == pattern(), "the bytes read are the brick file's");
    assert_eq!(m.stats.calls(Op::Read), reads, "no read reached the brick");

    // A writer of the same file, while the reader has it open: not refused by the kernel, and
    // its writes go through the brick (replication would need them there).
    let writes = m.stats.calls(Op::Write);
    let w = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("base.img"))
        .unwrap();
    w.write_all_at(&[0xEE; 8192], 4096).unwrap();
    assert!(
        m.stats.calls(Op::Write) > writes,
        "the write reached the brick"
    );
    let mut back = vec![0u8; 8192];
    r.read_exact_at(&mut back, 4096).unwrap();
    assert_eq!(back, vec![0xEE; 8192], "the reader sees the write");
    // A second reader shares the inode's backing file.
    let r2 = std::fs::File::open(m.path("base.img")).unwrap();
    let mut one = [0u8; 1];
    r2.read_exact_at(&mut one, 4096).unwrap();
    assert_eq!(one[0], 0xEE);
    drop((r, w, r2));
    // Closed and opened again: a fresh backing file, same bytes.
    let again = std::fs::read(m.path("base.img")).unwrap();
    assert_eq!(again, std::fs::read(m.brick().join("base.img")).unwrap());
}

#[test]
fn with_passthrough_off_reads_reach_the_brick() {
    let m = Mounted::with_passthrough(Mode::VmImage, false);
    std::fs::write(m.brick().join("base.img"), pattern()).unwrap();
    let reads = m.stats.calls(Op::Read);
    assert!(std::fs::read(m.path("base.img")).unwrap() == pattern());
    assert!(
        m.stats.calls(Op::Read) > reads,
        "reads went through the brick"
    );
}
