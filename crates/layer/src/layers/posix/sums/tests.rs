use super::*;

fn brick() -> (tempfile::TempDir, Registry) {
    let d = tempfile::tempdir().unwrap();
    let root = rfs::open(d.path(), OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
    let r = Registry::new(&root).unwrap();
    (d, r)
}

fn file(d: &tempfile::TempDir, name: &str) -> File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(d.path().join(name))
        .unwrap()
}

fn write(s: &Sums, f: &File, offset: u64, data: &[u8]) {
    let iov = [RawIov::of(data)];
    let n = s
        .write(f, offset, &iov, data.len(), || {
            f.write_all_at(data, offset).unwrap();
            Ok(data.len())
        })
        .unwrap();
    assert_eq!(n, data.len());
}

fn read(s: &Sums, f: &File, offset: u64, len: usize) -> FopResult<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let n = read_full(f, &mut buf, offset).unwrap();
    buf.truncate(n);
    s.check(f, offset, &buf, len).map(|_| buf)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn a_written_file_reads_back_checked_and_damage_is_found() {
    let (d, r) = brick();
    let f = file(&d, "a");
    let s = r.of(&f).unwrap();
    let data = pattern(5 * BLOCK as usize + 100, 1);
    write(&s, &f, 0, &data);
    for b in 0..6 {
        let e = s.entry(b);
        assert!(e != NONE && e != DIRTY, "block {b} has a sum");
    }
    assert_eq!(read(&s, &f, 0, data.len() + 10).unwrap(), data);
    assert_eq!(read(&s, &f, 100, 9000).unwrap(), data[100..9100]);
    // One byte flipped behind the layer's back (a disk that went bad).
    f.write_all_at(&[data[3 * 4096 + 7] ^ 0x40], 3 * 4096 + 7)
        .unwrap();
    let (_, damaged, _) = counts();
    assert_eq!(read(&s, &f, 0, data.len()), Err(errno::ECKSUM));
    assert_eq!(read(&s, &f, 3 * 4096 + 4000, 10), Err(errno::ECKSUM));
    assert!(counts().1 >= damaged + 2, "damage counted");
    // The blocks around it still read.
    assert_eq!(read(&s, &f, 0, 3 * 4096).unwrap(), data[..3 * 4096]);
    assert_eq!(
        read(&s, &f, 4 * 4096, 4096).unwrap(),
        data[4 * 4096..5 * 4096]
    );
    assert!(s.check_file(&f, 0, 3 * 4096).is_ok());
    assert_eq!(s.check_file(&f, 0, data.len()), Err(errno::ECKSUM));
    // A write over the block repairs it.
    write(&s, &f, 3 * 4096, &data[3 * 4096..4 * 4096]);
    assert_eq!(read(&s, &f, 0, data.len()).unwrap(), data);
}

#[test]
fn partial_block_writes_and_growth_keep_sums_right() {
    let (d, r) = brick();
    let f = file(&d, "a");
    let s = r.of(&f).unwrap();
    let mut model = vec![0u8; 0];
    let writes: [(u64, usize, u8); 6] = [
        (0, 1000, 1),
        (500, 7000, 2),
        (20_000, 3, 3),
        (4095, 2, 4),
        (8192, 4096, 5),
        (70_000, 9000, 6),
    ];
    for (o, n, seed) in writes {
        let data = pattern(n, seed);
        write(&s, &f, o, &data);
        let end = o as usize + n;
        if model.len() < end {
            model.resize(end, 0);
        }
        model[o as usize..end].copy_from_slice(&data);
        assert_eq!(
            read(&s, &f, 0, model.len() + 1).unwrap(),
            model,
            "after write at {o}"
        );
    }
    // Growing by truncate reads zeros and keeps every sum valid; cutting mid-block too.
    s.truncate(&f, 100_000, || f.set_len(100_000).map_err(|_| errno::EIO))
        .unwrap();
    model.resize(100_000, 0);
    assert_eq!(read(&s, &f, 0, 100_001).unwrap(), model);
    s.truncate(&f, 6000, || f.set_len(6000).map_err(|_| errno::EIO))
        .unwrap();
    model.truncate(6000);
    assert_eq!(read(&s, &f, 0, 100_001).unwrap(), model);
    assert_eq!(s.entry(2), NONE, "no sum past the end");
    s.truncate(&f, 50_000, || f.set_len(50_000).map_err(|_| errno::EIO))
        .unwrap();
    model.resize(50_000, 0);
    assert_eq!(read(&s, &f, 0, 100_001).unwrap(), model);
}

#[test]
fn punched_ranges_lose_their_sums_and_edges_are_sealed_again() {
    let (d, r) = brick();
    let f = file(&d, "a");
    let s = r.of(&f).unwrap();
    let mut data = pattern(64 * 4096, 9);
    write(&s, &f, 0, &data);
    let (o, n) = (4096 + 100, 40 * 4096u64);
    s.zero(&f, o, n, || {
        let flags = rfs::FallocateFlags::PUNCH_HOLE | rfs::FallocateFlags::KEEP_SIZE;
        rfs::fallocate(&f, flags, o, n).map_err(|e| e.raw_os_error() as u32)
    })
    .unwrap();
    data[o as usize..(o + n) as usize].fill(0);
    assert_eq!(read(&s, &f, 0, data.len()).unwrap(), data);
    assert_eq!(s.entry(5), NONE, "a block wholly punched keeps no sum");
    assert!(
        s.entry(1) != NONE && s.entry(41) != NONE,
        "the edges keep theirs"
    );
}

#[test]
fn a_change_cut_short_is_sealed_as_found_not_reported() {
    let (d, r) = brick();
    let f = file(&d, "a");
    let s = r.of(&f).unwrap();
    let data = pattern(3 * 4096, 2);
    write(&s, &f, 0, &data);
    // A write that died after its data landed and before its sums (the brick was killed).
    let new = pattern(4096, 7);
    let _ = s.write(&f, 4096, &[RawIov::of(&new)], 4096, || {
        f.write_all_at(&new, 4096).unwrap();
        Err(errno::EIO)
    });
    assert_eq!(s.entry(1), DIRTY);
    let resealed = counts().2;
    let got = read(&s, &f, 0, 3 * 4096).unwrap();
    assert_eq!(&got[4096..8192], &new[..]);
    assert!(counts().2 > resealed);
    assert!(s.entry(1) != DIRTY);
}

#[test]
fn sums_follow_the_inode_and_a_reused_number_starts_afresh() {
    let (d, r) = brick();
    let f = file(&d, "a");
    let s = r.of(&f).unwrap();
    write(&s, &f, 0, &pattern(8192, 3));
    drop(s);
    // Another handle of the same inode, after the first is gone, finds the sidecar.
    let g = File::open(d.path().join("a")).unwrap();
    let s2 = r.of(&g).unwrap();
    assert!(s2.entry(0) != NONE);
    // A sidecar whose header names another birth time is not this file's.
    let other = Sums {
        key: Key {
            born: (1, 2),
            ..s2.key
        },
        dirs: s2.dirs.clone(),
        side: RwLock::new(Side::Unknown),
        writing: Mutex::new(()),
    };
    assert_eq!(other.entry(0), NONE);
}

#[test]
fn payload_blocks_spanning_vectors_sum_like_one_buffer() {
    let data = pattern(3 * 4096, 5);
    let (a, b) = data.split_at(5000);
    let (b, c) = b.split_at(100);
    let iov = [RawIov::of(a), RawIov::of(b), RawIov::of(c)];
    let mut blocks = Blocks::new(&iov, data.len());
    for i in 0..3 {
        assert_eq!(
            blocks.crc_at(i * 4096),
            Some(crc(&data[i * 4096..(i + 1) * 4096]))
        );
    }
    assert_eq!(blocks.crc_at(3 * 4096 - 1), None);
    assert_eq!(
        crc_padded(&data[..100]),
        crc(&[&data[..100], &[0u8; 3996][..]].concat())
    );
}

#[test]
fn shipped_sums_check_on_the_reader_and_find_damage() {
    let (d, r) = brick();
    let f = file(&d, "a");
    let s = r.of(&f).unwrap();
    let data = pattern(10 * 4096 + 300, 4);
    write(&s, &f, 0, &data);
    let size = data.len() as u64;
    // Aligned, to the end of the file (the last block partial: shipped, padded).
    let e = s
        .shipped(&f, 4096, data.len() - 4096, size)
        .unwrap()
        .unwrap();
    assert_eq!(e.len(), 10);
    assert!(e.iter().all(|x| *x != NONE && *x != DIRTY));
    let d1 = &data[4096..];
    assert_eq!(verify_shipped(4096, &e, &[d1]), Ok(()));
    // In pieces that split blocks.
    assert_eq!(
        verify_shipped(4096, &e, &[&d1[..100], &d1[100..9000], &d1[9000..]]),
        Ok(())
    );
    // Unaligned: the partial edge blocks are checked on the brick and shipped as NONE.
    let e = s.shipped(&f, 1000, 3 * 4096, size).unwrap().unwrap();
    assert_eq!((e[0], e[3]), (NONE, NONE));
    assert_eq!(
        verify_shipped(1000, &e, &[&data[1000..1000 + 3 * 4096]]),
        Ok(())
    );
    // A flipped byte in what was received is found, and which block.
    let mut bad = d1.to_vec();
    bad[5 * 4096 + 17] ^= 1;
    let e = s.shipped(&f, 4096, bad.len(), size).unwrap().unwrap();
    assert_eq!(verify_shipped(4096, &e, &[&bad]), Err(6));
    // Entries that do not fit the data.
    assert_eq!(verify_shipped(4096, &e[1..], &[d1]), Err(u64::MAX));
    // Damage on the brick in a block the data covers only in part is found there.
    f.write_all_at(&[data[2 * 4096 + 5] ^ 2], 2 * 4096 + 5)
        .unwrap();
    assert_eq!(
        s.shipped(&f, 2 * 4096 + 100, 8192, size),
        Err(errno::ECKSUM)
    );
    // A file without sums ships nothing.
    let g = file(&d, "b");
    g.write_all_at(&data, 0).unwrap();
    let sg = r.of(&g).unwrap();
    assert_eq!(sg.shipped(&g, 0, 8192, size), Ok(None));
}

#[test]
fn a_rebuild_seals_bytes_changed_behind_the_layer() {
    let (d, r) = brick();
    let f = file(&d, "a");
    let s = r.of(&f).unwrap();
    write(&s, &f, 0, &pattern(5 * 4096, 1));
    // Rewritten in place, shorter, by someone else: the old sums no longer match.
    let new = pattern(2 * 4096 + 10, 2);
    f.set_len(0).unwrap();
    f.write_all_at(&new, 0).unwrap();
    assert_eq!(read(&s, &f, 0, 8 * 4096), Err(errno::ECKSUM));
    assert_eq!(rebuild_at(d.path(), "a").unwrap(), 3);
    assert_eq!(read(&s, &f, 0, 8 * 4096).unwrap(), new);
    assert_eq!(s.entry(3), NONE, "no sum past the end");
}

#[test]
fn a_write_only_handle_seals_its_partial_blocks_through_a_read_side() {
    let (d, r) = brick();
    let wf = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(d.path().join("w"))
        .unwrap();
    let s = r.of(&wf).unwrap();
    let reads = read_side(&wf).expect("the owner may read it");
    let data = pattern(4096 + 100, 6);
    let iov = [RawIov::of(&data)];
    s.write(&reads, 0, &iov, data.len(), || {
        wf.write_all_at(&data, 0).unwrap();
        Ok(data.len())
    })
    .unwrap();
    assert_eq!(
        s.entry(1),
        block_entry(&data[4096..]),
        "the partial last block is sealed"
    );
    // Through the write-only handle itself its bytes cannot be read: it stays mid-change.
    s.write(&wf, 0, &iov, data.len(), || Ok(data.len()))
        .unwrap();
    assert_eq!(s.entry(1), DIRTY);
}

#[test]
fn payload_blocks_over_many_small_vectors_sum_like_one_buffer() {
    // As NBD or vhost hand a write over: one vector per 512 bytes, some empty, blocks in order
    // and then one asked for again.
    let data = pattern(8 * 4096, 8);
    let mut iov = Vec::new();
    for c in data.chunks(512) {
        iov.push(RawIov::of(c));
        iov.push(RawIov::of(&[]));
    }
    let mut blocks = Blocks::new(&iov, data.len());
    for i in 0..8 {
        assert_eq!(
            blocks.crc_at(i * 4096),
            Some(crc(&data[i * 4096..(i + 1) * 4096]))
        );
    }
    assert_eq!(blocks.crc_at(4096), Some(crc(&data[4096..8192])));
}
