//! Damaged copies on a replica-3 volume: real kilnd bricks, bytes flipped in one brick's file
//! (or in its checksum file) behind its back, reads through a fresh client that must return
//! the right bytes, heal that repairs the copy, and `EIO` for a block damaged on every replica
//! while the rest of the file still reads.

use std::os::unix::fs::FileExt;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;

use crate::replica;
use replica::{index_empty, seeds, volfile, Brick, Rng};

const FILE: &str = "disk.img";
const SIZE: usize = 4 << 20;

fn pattern(seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let mut v = Vec::with_capacity(SIZE);
    while v.len() < SIZE {
        v.extend_from_slice(&rng.next().to_le_bytes());
    }
    v
}

/// Writes the file through the volume and syncs it.
fn write_file(bricks: &[Brick], data: &[u8]) {
    let vol = Volume::from_volfile(&volfile(bricks)).expect("connect");
    let (fd, _) = block_on(vol.create(FILE, libc::O_RDWR | libc::O_CREAT, 0o644)).expect("create");
    let (r, _) = block_on(vol.pwritev(&fd, vec![data.to_vec()], 0));
    assert_eq!(r.expect("write"), data.len());
    block_on(vol.fsync(&fd, false)).expect("fsync");
    block_on(vol.close(fd)).expect("close");
    drop(vol);
    // The client went away seconds after it made the name: the bricks hold it suspect (see
    // `kiln_layer::marks`), and a suspect file is read from one replica only. Heal settles
    // that first, as the heal service would.
    heal_all(bricks, "after the write");
}

/// Flips 16 bytes at each of `offsets` in brick `b`'s copy, as a failing disk would.
fn damage(b: &Brick, offsets: &[u64]) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(b.dir.join(FILE))
        .unwrap();
    for &o in offsets {
        let mut buf = [0u8; 16];
        f.read_exact_at(&mut buf, o).unwrap();
        for x in &mut buf {
            *x ^= 0x5a;
        }
        f.write_all_at(&buf, o).unwrap();
    }
    // The bricks read through the page cache, as they would from a disk that returned the
    // damaged bytes.
}

/// Reads the whole file through a new client (no cache of it anywhere) in `piece`-byte
/// reads, once through each of three handles (a new handle reads from the next replica
/// first, so each replica serves a pass unless it was found damaged); each read's result.
fn read_all(bricks: &[Brick], piece: usize) -> Vec<std::io::Result<Vec<u8>>> {
    let vol = Volume::from_volfile(&volfile(bricks)).expect("connect");
    let mut out = Vec::new();
    for _ in 0..bricks.len() {
        let fd = block_on(vol.open(FILE, libc::O_RDONLY)).expect("open");
        for at in (0..SIZE).step_by(piece) {
            let (r, mut back) = block_on(vol.preadv(&fd, vec![vec![0u8; piece]], at as u64));
            out.push(r.map(|n| {
                let mut b = back.remove(0);
                b.truncate(n);
                b
            }));
        }
        let _ = block_on(vol.close(fd));
    }
    out
}

fn assert_reads(bricks: &[Brick], want: &[u8], what: &str) {
    // 1 MiB reads come by sendfile from the file, with the blocks' sums, checked here; 16 KiB
    // ones in a buffer, checked on the brick.
    for piece in [1 << 20, 16 << 10] {
        for (k, r) in read_all(bricks, piece).into_iter().enumerate() {
            let got = r.unwrap_or_else(|e| panic!("{what}: read {k} of {piece} B failed: {e}"));
            let at = k * piece % SIZE;
            assert!(
                got == want[at..at + piece],
                "{what}: read {k} of {piece} B returned the wrong bytes"
            );
        }
    }
}

/// Heals until no marks remain (a suspect file takes a pass to settle and one to copy).
fn heal_all(bricks: &[Brick], what: &str) -> heal::Report {
    let healer = Volume::from_volfile(&volfile(bricks)).expect("healer connects");
    let mut total = heal::Report::default();
    for _ in 0..4 {
        if index_empty(&healer) {
            break;
        }
        let r = block_on(heal::run(healer.top(), &|_, _| {}));
        assert!(r.errors.is_empty(), "{what}: heal errors {:?}", r.errors);
        total.bytes += r.bytes;
        total.files += r.files;
    }
    assert!(index_empty(&healer), "{what}: marks remain after heal");
    total
}

fn assert_copies_equal(bricks: &[Brick], want: &[u8], what: &str) {
    for (i, b) in bricks.iter().enumerate() {
        assert!(
            b.file(FILE) == want,
            "{what}: brick {i}'s copy differs after heal"
        );
    }
}

#[test]
fn a_damaged_copy_is_read_around_and_repaired() {
    for seed in seeds(2) {
        let root = tempfile::tempdir().unwrap();
        let bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
        let data = pattern(seed);
        write_file(&bricks, &data);
        let mut rng = Rng(seed ^ 0x77);
        let victim = (rng.next() % 3) as usize;
        let offsets: Vec<u64> = (0..4).map(|_| rng.next() % (SIZE as u64 - 16)).collect();
        damage(&bricks[victim], &offsets);
        let what = format!("seed {seed}, brick {victim} damaged at {offsets:?}");
        let found = kiln_server::posix::sums::check_tree(&bricks[victim].dir).unwrap();
        assert!(
            !found.damaged.is_empty(),
            "{what}: a check of the brick finds nothing"
        );

        // A read that meets damage marks that range and reads no more from the copy until
        // heal: each round of reads and heal repairs at least one damaged place.
        let before = kiln_client::protocol::shipped_checks();
        for round in 0.. {
            assert_reads(&bricks, &data, &what);
            if bricks[victim].file(FILE) == data {
                break;
            }
            assert!(
                round < offsets.len(),
                "{what}: still damaged after {round} rounds"
            );
            let info = {
                let v = Volume::from_volfile(&volfile(&bricks)).unwrap();
                block_on(heal::info(v.top()))
            };
            assert!(
                info.iter().any(|n| n.path == FILE && n.target == victim),
                "{what}: heal info does not name the damaged copy (round {round}): {info:?}"
            );
            let report = heal_all(&bricks, &what);
            assert!(report.bytes > 0, "{what}: heal moved nothing");
        }
        let after = kiln_client::protocol::shipped_checks();
        assert!(
            after.0 > before.0,
            "{what}: no read was checked against shipped sums"
        );
        assert!(
            after.1 > before.1,
            "{what}: no damage was found in shipped data"
        );
        assert_copies_equal(&bricks, &data, &what);
        replica::sums_clean(&bricks, seed);
    }
}

#[test]
fn a_damaged_checksum_record_is_found_and_repaired() {
    let seed = seeds(1)[0];
    let root = tempfile::tempdir().unwrap();
    let bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let data = pattern(seed);
    write_file(&bricks, &data);
    let victim = (seed % 3) as usize;
    // The brick's checksum file for the image: flip one entry's bits.
    let ino = std::os::unix::fs::MetadataExt::ino(
        &std::fs::metadata(bricks[victim].dir.join(FILE)).unwrap(),
    );
    let side = bricks[victim].dir.join(".kiln/sums").join(ino.to_string());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&side)
        .unwrap();
    let block = seed % (SIZE as u64 / 4096);
    let at = 4096 + 4 * block;
    let mut e = [0u8; 4];
    f.read_exact_at(&mut e, at).unwrap();
    e[1] ^= 0x10;
    f.write_all_at(&e, at).unwrap();
    let what = format!("seed {seed}, brick {victim}'s sum of block {block} damaged");
    assert_reads(&bricks, &data, &what);
    heal_all(&bricks, &what);
    assert_copies_equal(&bricks, &data, &what);
    replica::sums_clean(&bricks, seed);
}

#[test]
fn a_block_damaged_everywhere_fails_with_eio_and_the_rest_reads() {
    let seed = seeds(1)[0];
    let root = tempfile::tempdir().unwrap();
    let bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let data = pattern(seed);
    write_file(&bricks, &data);
    let block = (seed % (SIZE as u64 / 4096 - 2)) + 1;
    for (i, b) in bricks.iter().enumerate() {
        damage(b, &[block * 4096 + 100 * i as u64]);
    }
    let piece = 4096;
    for (k, r) in read_all(&bricks, piece).into_iter().enumerate() {
        let k = k % (SIZE / piece);
        if k as u64 == block {
            let e = r.expect_err("a block damaged on every replica reads");
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "block {block}: {e}");
        } else {
            let got = r.unwrap_or_else(|e| panic!("seed {seed}: block {k} failed: {e}"));
            assert!(
                got == data[k * piece..(k + 1) * piece],
                "seed {seed}: block {k} wrong"
            );
        }
    }
}
