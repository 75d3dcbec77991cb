//! The distribute layer over in-memory subvolumes.

use super::layout::LAYOUT_HEADER;
use super::*;
use crate::exec::block_on;
use std::sync::Arc;

#[test]
fn hash_is_stable() {
    // Part of the on-disk format: these values must never change.
    assert_eq!(name_hash(""), 0xab3e_7c0b);
    assert_eq!(name_hash("a"), 0x1a80_b1b3);
    assert_eq!(name_hash("file-1"), 0x74de_da27);
}

#[test]
fn hash_spreads_names_evenly() {
    for n in [2usize, 3, 4, 7, 16] {
        let l = Layout::equal(n);
        let mut counts = vec![0u32; n];
        let total = 60_000u32;
        for i in 0..total {
            counts[l.subvol(name_hash(&format!("file-{i}")))] += 1;
        }
        let want = total as f64 / n as f64;
        for (s, &c) in counts.iter().enumerate() {
            let dev = (c as f64 - want).abs() / want;
            assert!(
                dev < 0.05,
                "{n} subvolumes: subvolume {s} got {c}, want ~{want}"
            );
        }
    }
}

#[test]
fn equal_layout_covers_the_space() {
    for n in [0usize, 1, 2, 3, 4, 5, 100, 1 << 16, 1 << 20] {
        let l = Layout::equal(n);
        let n = n.clamp(1, u16::MAX as usize);
        assert_eq!(l.ranges().len(), n);
        assert_eq!(l.ranges()[0].start, 0);
        assert_eq!(l.ranges().last().unwrap().end, u32::MAX);
        assert_eq!(Layout::decode(&l.encode(), n), Some(l.clone()));
        assert_eq!(l.subvol(0), 0);
        assert_eq!(l.subvol(u32::MAX), n - 1);
    }
}

#[test]
fn layout_round_trips() {
    let l = Layout {
        ranges: vec![
            Range {
                start: 0,
                end: 9,
                subvol: 2,
            },
            Range {
                start: 10,
                end: 0x8000_0000,
                subvol: 0,
            },
            Range {
                start: 0x8000_0001,
                end: u32::MAX,
                subvol: 2,
            },
        ],
    };
    let b = l.encode();
    assert_eq!(Layout::decode(&b, 3), Some(l.clone()));
    assert_eq!(l.subvol(5), 2);
    assert_eq!(l.subvol(10), 0);
    assert_eq!(l.subvol(0x8000_0000), 0);
    assert_eq!(l.subvol(0x8000_0001), 2);
    // Subvolume 2 does not exist in a two-subvolume layer.
    assert_eq!(Layout::decode(&b, 2), None);
}

#[test]
fn bad_layouts_are_refused() {
    let good = Layout::equal(4).encode();
    let mut cases: Vec<Vec<u8>> = vec![
        vec![],
        b"KLAY".to_vec(),
        good[..good.len() - 1].to_vec(),
        [good.clone(), vec![0]].concat(),
    ];
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    cases.push(bad_magic);
    let mut bad_version = good.clone();
    bad_version[4] = 2;
    cases.push(bad_version);
    let mut zero = good[..LAYOUT_HEADER].to_vec();
    zero[6] = 0;
    zero[7] = 0;
    cases.push(zero);
    let gap = Layout {
        ranges: vec![
            Range {
                start: 0,
                end: 9,
                subvol: 0,
            },
            Range {
                start: 11,
                end: u32::MAX,
                subvol: 1,
            },
        ],
    };
    cases.push(gap.encode());
    let overlap = Layout {
        ranges: vec![
            Range {
                start: 0,
                end: 9,
                subvol: 0,
            },
            Range {
                start: 9,
                end: u32::MAX,
                subvol: 1,
            },
        ],
    };
    cases.push(overlap.encode());
    let short = Layout {
        ranges: vec![Range {
            start: 0,
            end: 0xffff,
            subvol: 0,
        }],
    };
    cases.push(short.encode());
    let backwards = Layout {
        ranges: vec![
            Range {
                start: 0,
                end: 9,
                subvol: 0,
            },
            Range {
                start: 10,
                end: 5,
                subvol: 1,
            },
        ],
    };
    cases.push(backwards.encode());
    for c in &cases {
        assert_eq!(Layout::decode(c, 4), None, "{c:?}");
    }
    // Random bytes, with and without a valid header: never a panic.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..20_000 {
        let len = (round % 64) as usize;
        let mut b: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        if round % 2 == 0 && b.len() >= LAYOUT_HEADER {
            b[..6].copy_from_slice(&good[..6]);
        }
        if let Some(l) = Layout::decode(&b, 4) {
            assert_eq!(l.ranges().last().unwrap().end, u32::MAX);
        }
    }
}

/// A subvolume with nothing in it.
struct Stub;

impl Layer for Stub {
    fn name(&self) -> &str {
        "stub"
    }
}

fn stubs(n: usize) -> Vec<LayerRef> {
    (0..n).map(|_| Arc::new(Stub) as LayerRef).collect()
}

#[test]
fn the_layout_is_the_graphs_whatever_a_directory_stored() {
    // Every directory hashes by the equal split over the subvolumes.
    let d = Distribute::new("dist", stubs(3));
    assert_eq!(*d.layout(), Layout::equal(3));
    let names: Vec<String> = (0..3000).map(|i| format!("f{i}")).collect();
    let mut seen = [0usize; 3];
    for n in &names {
        let i = d.hashed(&format!("dir/{n}")).unwrap();
        assert_eq!(i, Layout::equal(3).subvol(name_hash(n)));
        seen[i] += 1;
    }
    assert!(seen.iter().all(|&c| c > 800), "{seen:?}");
    // Draining subvolume 1: nothing new lands there; the others share the space.
    let d = Distribute::draining("dist", stubs(3), &[1]);
    assert_eq!(*d.layout(), Layout::over(&[0, 2]));
    let mut seen = [0usize; 3];
    for n in &names {
        seen[d.hashed(&format!("dir/{n}")).unwrap()] += 1;
    }
    assert_eq!(seen[1], 0, "{seen:?}");
    assert!(seen[0] > 1200 && seen[2] > 1200, "{seen:?}");
    // All draining: all still take files (there is nowhere else).
    let d = Distribute::draining("dist", stubs(2), &[0, 1]);
    assert_eq!(*d.layout(), Layout::equal(2));
}

#[test]
fn no_subvolumes_is_an_error_not_a_panic() {
    let d = Distribute::new("dist", Vec::new());
    let cx = Ctx::NONE;
    assert_eq!(block_on(d.lookup(&cx, "a")).err(), Some(ENOTCONN));
    assert!(block_on(d.create(&cx, "a", 0, 0o644)).is_err());
    assert!(block_on(d.mkdir(&cx, "a", 0o755)).is_err());
    assert!(block_on(d.readdir(&cx, "", 0, 10)).is_err());
    assert!(block_on(d.statfs(&cx, "")).is_err());
    assert!(block_on(d.rename(&cx, "a", "b", 0)).is_err());
    let foreign = Fd::new(5u32);
    assert_eq!(block_on(d.fstat(&cx, &foreign)).err(), Some(EBADF));
}

#[test]
fn copies_a_dead_mover_left_go_and_live_ones_stay() {
    use crate::layers::posix::{brick::Brick, Posix};
    let tmp = tempfile::tempdir().unwrap();
    let kids: Vec<LayerRef> = (0..2)
        .map(|i| {
            let d = tmp.path().join(format!("b{i}"));
            std::fs::create_dir(&d).unwrap();
            Arc::new(Posix::new("posix", Arc::new(Brick::open(&d).unwrap()))) as LayerRef
        })
        .collect();
    let cx = Ctx::NONE;
    let rw = (libc::O_RDWR | libc::O_CREAT) as u32;
    let (old, fresh) = (
        format!("{MOVING_PREFIX}old"),
        format!("{MOVING_PREFIX}fresh"),
    );
    for name in [&old, &fresh] {
        let (fd, _) = block_on(kids[1].create(&cx, name, rw, 0o600)).unwrap();
        block_on(kids[1].release(&cx, fd)).unwrap();
    }
    // An hour-old mtime is no sign of a dead mover (the mover sets the source's times).
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let an_hour_ago = SetAttrs {
        valid: kiln_proto::ops::SETATTR_MTIME,
        mtime: kiln_proto::ops::Time {
            sec: now - 3600,
            nsec: 0,
        },
        ..SetAttrs::default()
    };
    block_on(kids[1].setattr(&cx, &old, &an_hour_ago)).unwrap();
    let d = Distribute::new("dist", kids.clone());
    let (found, _) = block_on(d.misplaced("")).unwrap();
    assert!(found.is_empty(), "copies are not names to move");
    for name in [&old, &fresh] {
        assert!(
            block_on(kids[1].lookup(&cx, name)).is_ok(),
            "a live copy was removed"
        );
    }
    // Unchanged for an hour, as its ctime would say: it goes.
    let mut a = block_on(kids[1].lookup(&cx, &old)).unwrap();
    a.ctime.sec -= 3600;
    block_on(super::migrate::drop_if_stale(&kids[1], &old, &a));
    assert_eq!(block_on(kids[1].lookup(&cx, &old)).err(), Some(ENOENT));
}
