//! The shard layer over distribute over two posix bricks, in process.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::file::ShardFd;
use super::*;
use crate::distribute::Distribute;
use crate::exec::block_on;
use crate::layers::posix::{brick::Brick, Posix};
use crate::{Ctx, Fd, IoBufs, Layer, ReadDst, ReadOut, SetAttrs};

const B: u64 = MIN_BLOCK;
const RW: u32 = libc::O_RDWR as u32;
const CREAT: u32 = (libc::O_RDWR | libc::O_CREAT) as u32;

struct Vol {
    top: Shard,
    dirs: Vec<PathBuf>,
    _tmp: tempfile::TempDir,
}

fn vol() -> Vol {
    let tmp = tempfile::tempdir().unwrap();
    let dirs: Vec<PathBuf> = (0..2).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let kids: Vec<LayerRef> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            std::fs::create_dir(d).unwrap();
            let brick = Arc::new(Brick::open(d).unwrap());
            Arc::new(Posix::new(&format!("posix-{i}"), brick)) as LayerRef
        })
        .collect();
    let dist: LayerRef =
        Arc::new(Distribute::new("dht", kids).with_placement(Arc::new(super::Pieces)));
    Vol {
        top: Shard::new("shard", dist, B).unwrap(),
        dirs,
        _tmp: tmp,
    }
}

fn write(v: &Vol, fd: &Fd, off: u64, data: &[u8]) {
    let w = block_on(
        v.top
            .write(&Ctx::NONE, fd, off, IoBufs::owned(vec![data.to_vec()])),
    );
    assert_eq!(w.unwrap().n, data.len(), "write at {off}");
}

fn read(v: &Vol, fd: &Fd, off: u64, len: usize, into: bool) -> Vec<u8> {
    let dst = if into {
        ReadDst::Into(IoBufs::owned(vec![vec![0xeeu8; len]]))
    } else {
        ReadDst::Any(len as u32)
    };
    match block_on(v.top.read(&Ctx::NONE, fd, off, dst)).unwrap() {
        ReadOut::Into { n, bufs } => {
            let mut b = bufs.into_owned::<Vec<u8>>().unwrap().remove(0);
            b.truncate(n);
            b
        }
        ReadOut::Buf(b) => b,
        ReadOut::File {
            file, offset, len, ..
        } => {
            let mut b = vec![0; len];
            std::os::unix::fs::FileExt::read_exact_at(&*file, &mut b, offset).unwrap();
            b
        }
    }
}

fn truncate(v: &Vol, fd: &Fd, size: u64) {
    let a = SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size,
        ..SetAttrs::default()
    };
    assert_eq!(
        block_on(v.top.fsetattr(&Ctx::NONE, fd, &a)).unwrap().size,
        size
    );
}

/// Pieces on each brick: (brick, piece name).
fn pieces(v: &Vol) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, d) in v.dirs.iter().enumerate() {
        if let Ok(rd) = std::fs::read_dir(d.join(SHARD_DIR)) {
            out.extend(rd.map(|e| (i, e.unwrap().file_name().into_string().unwrap())));
        }
    }
    out.sort();
    out
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

#[test]
fn random_io_reads_back_what_a_plain_file_would_hold() {
    let v = vol();
    let cx = Ctx::NONE;
    let (mut fd, _) = block_on(v.top.create(&cx, "img", CREAT, 0o644)).unwrap();
    let mut model: Vec<u8> = Vec::new();
    let mut r = Rng(0x5eed_1234_abcd);
    for op in 0..1500u32 {
        let size = model.len() as u64;
        match r.next(10) {
            0..=3 => {
                let off = r.next(5 * B);
                let len = 1 + r.next(300 << 10) as usize;
                let data: Vec<u8> = (0..len).map(|i| (op as usize * 7 + i) as u8 | 1).collect();
                write(&v, &fd, off, &data);
                let end = off as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
            }
            4..=6 => {
                let off = r.next(size + B);
                let len = 1 + r.next(3 * B / 2) as usize;
                let got = read(&v, &fd, off, len, op % 2 == 0);
                let want = model
                    .get(off as usize..(off as usize + len).min(model.len()))
                    .unwrap_or(&[]);
                assert_eq!(
                    got.len(),
                    want.len(),
                    "op {op}: read {len} at {off} of {size}"
                );
                assert!(
                    got == want,
                    "op {op}: read {len} at {off} of {size}: bytes differ"
                );
            }
            7 => {
                let to = r.next(5 * B);
                truncate(&v, &fd, to);
                model.resize(to as usize, 0);
            }
            8 => {
                let off = r.next(size + 1);
                let len = 1 + r.next(2 * B);
                let mode = (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u32;
                block_on(v.top.fallocate(&cx, &fd, mode, off, len)).unwrap();
                let (s, e) = (off as usize, ((off + len) as usize).min(model.len()));
                if s < e {
                    model[s..e].fill(0);
                }
            }
            _ => {
                block_on(v.top.release(&cx, fd)).unwrap();
                fd = block_on(v.top.open(&cx, "img", RW)).unwrap();
            }
        }
        assert_eq!(
            block_on(v.top.fstat(&cx, &fd)).unwrap().size,
            model.len() as u64,
            "op {op}"
        );
    }
    let whole = read(&v, &fd, 0, model.len() + 10, true);
    assert!(whole == model, "the whole file differs");
    // No piece is past the end.
    let ps = pieces(&v);
    let last = (model.len() as u64).saturating_sub(1) / B;
    for (_, name) in &ps {
        let k: u64 = name.rsplit('.').next().unwrap().parse().unwrap();
        assert!(
            k >= 1 && k <= last,
            "piece {name} past the end ({} bytes)",
            model.len()
        );
    }
    block_on(v.top.release(&cx, fd)).unwrap();
    block_on(v.top.unlink(&cx, "img")).unwrap();
    assert_eq!(
        pieces(&v),
        Vec::<(usize, String)>::new(),
        "unlink left pieces"
    );
}

#[test]
fn pieces_are_striped_over_the_subvolumes() {
    let v = vol();
    let cx = Ctx::NONE;
    let (fd, _) = block_on(v.top.create(&cx, "img", CREAT, 0o644)).unwrap();
    for k in 0..8 {
        write(&v, &fd, k * B, &[k as u8 + 1; 4096]);
    }
    let ps = pieces(&v);
    assert_eq!(ps.len(), 7, "{ps:?}");
    let on = |k: u64| {
        ps.iter()
            .find(|p| p.1.ends_with(&format!(".{k}")))
            .unwrap()
            .0
    };
    for k in 2..8 {
        assert_ne!(
            on(k),
            on(k - 1),
            "pieces {} and {k} on one brick: {ps:?}",
            k - 1
        );
    }
    // The base holds piece 0 only, and the whole file's size.
    let base = std::fs::metadata(
        v.dirs
            .iter()
            .map(|d| d.join("img"))
            .find(|p| p.exists())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(base.len(), 7 * B + 4096);
    assert!(std::os::unix::fs::MetadataExt::blocks(&base) * 512 < 2 * B);
    block_on(v.top.release(&cx, fd)).unwrap();
}

#[test]
fn the_shard_directory_and_mark_are_hidden() {
    let v = vol();
    let cx = Ctx::NONE;
    let (fd, _) = block_on(v.top.create(&cx, "f", CREAT, 0o644)).unwrap();
    write(&v, &fd, 2 * B, b"x");
    let names: Vec<String> = block_on(v.top.readdir(&cx, "", 0, 100))
        .unwrap()
        .entries
        .0
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(
        names.contains(&"f".to_owned()) && !names.iter().any(|n| n == SHARD_DIR),
        "{names:?}"
    );
    assert_eq!(block_on(v.top.lookup(&cx, SHARD_DIR)).err(), Some(ENOENT));
    assert_eq!(
        block_on(v.top.open(&cx, &format!("{SHARD_DIR}/x"), RW)).err(),
        Some(ENOENT)
    );
    assert_eq!(
        block_on(v.top.mkdir(&cx, SHARD_DIR, 0o755)).err(),
        Some(EPERM)
    );
    assert_eq!(
        block_on(v.top.rename(&cx, "f", ".shards/g", 0)).err(),
        Some(EPERM)
    );
    assert_eq!(
        block_on(v.top.getxattr(&cx, "f", SHARD_XATTR)).err(),
        Some(ENODATA)
    );
    assert_eq!(
        block_on(v.top.setxattr(&cx, "f", SHARD_XATTR, b"x", 0)).err(),
        Some(EPERM)
    );
    assert!(!block_on(v.top.listxattr(&cx, "f"))
        .unwrap()
        .iter()
        .any(|n| n == SHARD_XATTR));
    block_on(v.top.release(&cx, fd)).unwrap();
}

#[test]
fn rename_over_and_links_keep_exactly_the_pieces_in_use() {
    let v = vol();
    let cx = Ctx::NONE;
    for name in ["a", "b"] {
        let (fd, _) = block_on(v.top.create(&cx, name, CREAT, 0o644)).unwrap();
        write(&v, &fd, 3 * B, name.as_bytes());
        block_on(v.top.release(&cx, fd)).unwrap();
    }
    assert_eq!(pieces(&v).len(), 2);
    // b replaced by a: b's piece goes, a's stays and reads back under b.
    block_on(v.top.rename(&cx, "a", "b", 0)).unwrap();
    assert_eq!(pieces(&v).len(), 1);
    let fd = block_on(v.top.open(&cx, "b", RW)).unwrap();
    assert_eq!(read(&v, &fd, 3 * B, 1, true), b"a");
    block_on(v.top.release(&cx, fd)).unwrap();
    // A second name keeps the pieces until the last name goes.
    block_on(v.top.link(&cx, "b", "c")).unwrap();
    block_on(v.top.unlink(&cx, "b")).unwrap();
    assert_eq!(pieces(&v).len(), 1);
    block_on(v.top.rename(&cx, "c", "c", 0)).unwrap();
    assert_eq!(pieces(&v).len(), 1, "rename onto itself removed pieces");
    block_on(v.top.unlink(&cx, "c")).unwrap();
    assert!(pieces(&v).is_empty());
    // Truncation by path and O_TRUNC remove pieces too.
    let (fd, _) = block_on(v.top.create(&cx, "d", CREAT, 0o644)).unwrap();
    write(&v, &fd, 4 * B, b"d");
    let a = SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: 2 * B + 5,
        ..SetAttrs::default()
    };
    block_on(v.top.setattr(&cx, "d", &a)).unwrap();
    assert!(pieces(&v).is_empty(), "{:?}", pieces(&v));
    write(&v, &fd, 4 * B, b"d");
    let again = block_on(v.top.open(&cx, "d", RW | libc::O_TRUNC as u32)).unwrap();
    assert!(pieces(&v).is_empty());
    for f in [fd, again] {
        block_on(v.top.release(&cx, f)).unwrap();
    }
}

#[test]
fn bytes_a_crash_left_past_the_end_are_never_read() {
    let v = vol();
    let cx = Ctx::NONE;
    let (fd, _) = block_on(v.top.create(&cx, "img", CREAT, 0o644)).unwrap();
    write(&v, &fd, 0, b"head");
    block_on(v.top.release(&cx, fd)).unwrap();
    // A piece past the end, as a crash between writing it and growing the base leaves it.
    let mark = block_on(v.top.mark_of(&cx, "img")).unwrap().unwrap();
    let path = piece_path(&mark.id, 2);
    let icx = inner(&cx);
    let kid = v.top.kid();
    let _ = block_on(kid.mkdir(&icx, SHARD_DIR, 0o700));
    let (pfd, _) = block_on(kid.create(&icx, &path, CREAT, 0o600)).unwrap();
    block_on(kid.write(&icx, &pfd, 0, IoBufs::owned(vec![vec![7u8; 100]]))).unwrap();
    block_on(kid.release(&icx, pfd)).unwrap();
    let fd = block_on(v.top.open(&cx, "img", RW)).unwrap();
    assert_eq!(read(&v, &fd, 2 * B, 100, true), b"", "read past the end");
    // Growing over it makes it a hole first.
    write(&v, &fd, 3 * B, b"tail");
    assert_eq!(read(&v, &fd, 2 * B, 100, false), vec![0u8; 100]);
    assert_eq!(read(&v, &fd, 3 * B, 4, true), b"tail");
    block_on(v.top.release(&cx, fd)).unwrap();
}

#[test]
fn files_made_whole_stay_whole() {
    let v = vol();
    let cx = Ctx::NONE;
    // Made below the shard layer: no mark.
    let kid = v.top.kid();
    let (fd, _) = block_on(kid.create(&cx, "old", CREAT, 0o644)).unwrap();
    block_on(kid.write(&cx, &fd, 2 * B, IoBufs::owned(vec![b"whole".to_vec()]))).unwrap();
    block_on(kid.release(&cx, fd)).unwrap();
    let fd = block_on(v.top.open(&cx, "old", RW)).unwrap();
    assert_eq!(read(&v, &fd, 2 * B, 5, true), b"whole");
    write(&v, &fd, 3 * B, b"more");
    assert!(pieces(&v).is_empty());
    block_on(v.top.release(&cx, fd)).unwrap();
    // The mark round-trips; junk is no mark.
    let m = Mark::new(B).unwrap();
    assert_eq!(Mark::decode(&m.encode()), Some(m.clone()));
    assert_eq!(Mark::decode(b"KSH1"), None);
    let mut bad = m.encode();
    bad[4] = 3;
    assert_eq!(Mark::decode(&bad), None);
    assert_eq!(piece_of(&piece_path(&m.id, 12)), Some((m.id.as_str(), 12)));
    assert_eq!(piece_of(".shards/x.1"), None);
    assert_eq!(piece_of("a/.shards/x.1"), None);
    let _ = Path::new("");
}

#[test]
fn a_file_of_many_pieces_keeps_a_bounded_number_open() {
    let v = vol();
    let cx = Ctx::NONE;
    let (fd, _) = block_on(v.top.create(&cx, "big", CREAT, 0o644)).unwrap();
    let n = 400u64;
    for k in 1..n {
        write(&v, &fd, k * B + k, &k.to_le_bytes());
    }
    let ShardFd::Split(p) = fd.get::<file::ShardFd>().unwrap() else {
        panic!("not sharded");
    };
    let open = p.open_pieces();
    assert!(open <= 256, "{open} piece handles open");
    for k in (1..n).rev() {
        assert_eq!(
            read(&v, &fd, k * B + k, 8, k % 2 == 0),
            k.to_le_bytes(),
            "piece {k}"
        );
    }
    assert!(p.open_pieces() <= 256);
    block_on(v.top.release(&cx, fd)).unwrap();
}

#[test]
fn what_a_sharded_file_refuses_and_what_links_and_creates_keep() {
    let v = vol();
    let cx = Ctx::NONE;
    let (fd, _) = block_on(v.top.create(&cx, "f", CREAT, 0o644)).unwrap();
    write(&v, &fd, 3 * B, b"data");
    // Shifting ranges would move bytes between pieces: refused.
    let collapse = libc::FALLOC_FL_COLLAPSE_RANGE as u32;
    let e = block_on(v.top.fallocate(&cx, &fd, collapse, 0, B)).err();
    assert_eq!(e, Some(libc::EOPNOTSUPP as Errno));
    // A read-only handle writes nothing.
    let ro = block_on(v.top.open(&cx, "f", libc::O_RDONLY as u32)).unwrap();
    let w = block_on(
        v.top
            .write(&cx, &ro, 3 * B, IoBufs::owned(vec![b"x".to_vec()])),
    );
    assert_eq!(w.err(), Some(libc::EBADF as Errno));
    // Truncating a file with two names cuts its pieces: growing again shows zeros.
    block_on(v.top.link(&cx, "f", "g")).unwrap();
    truncate(&v, &fd, 0);
    let a = SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: 0,
        ..SetAttrs::default()
    };
    block_on(v.top.setattr(&cx, "g", &a)).unwrap();
    truncate(&v, &fd, 4 * B);
    assert_eq!(read(&v, &fd, 3 * B, 4, true), vec![0u8; 4]);
    assert!(pieces(&v).is_empty(), "{:?}", pieces(&v));
    for f in [fd, ro] {
        block_on(v.top.release(&cx, f)).unwrap();
    }
    // create of a file made whole (not by this create) leaves it whole.
    let kid = v.top.kid();
    let (k, _) = block_on(kid.create(&cx, "whole", CREAT, 0o644)).unwrap();
    block_on(kid.release(&cx, k)).unwrap();
    let (fd, _) = block_on(v.top.create(&cx, "whole", CREAT, 0o644)).unwrap();
    write(&v, &fd, 3 * B, b"w");
    assert!(pieces(&v).is_empty(), "a file made whole was sharded");
    block_on(v.top.release(&cx, fd)).unwrap();
}
