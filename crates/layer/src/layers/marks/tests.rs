//! The marks layer against a real brick directory.

use std::path::Path;

use super::*;
use crate::marks::{self as m, CondFlag, CondMark, HealInfo, HealReq, Mark};
use crate::{Ctx, IoBufs, Layer, SetAttrs};
use kiln_proto::ops::SETATTR_SIZE;
use kiln_proto::Wire;

const K: u64 = 1024;

fn stack(dir: &Path) -> Marks {
    let brick = Arc::new(crate::layers::posix::brick::Brick::open(dir).unwrap());
    let posix: LayerRef = Arc::new(crate::layers::posix::Posix::new("posix", brick));
    Marks::new("marks", posix, dir).unwrap()
}

fn run<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

fn cx(owner: u64) -> Ctx {
    Ctx::NONE.with_owner(owner)
}

async fn write(l: &Marks, cx: &Ctx, fd: &Fd, off: u64, byte: u8, len: u64) -> FopResult<u64> {
    let data = vec![byte; len as usize];
    l.write(cx, fd, off, IoBufs::owned(vec![data]))
        .await
        .map(|w| w.n as u64)
}

async fn session(l: &Marks, cx: &Ctx, begin: u32) {
    l.heal_session(cx, "f", &HealReq { begin }).await.unwrap();
}

async fn info(l: &Marks, cx: &Ctx) -> HealInfo {
    Layer::heal_info(l, cx, "f", &()).await.unwrap()
}

fn ranges(info: &HealInfo) -> Vec<(u64, u64)> {
    info.skipped.0.iter().map(|r| (r.offset, r.len)).collect()
}

#[test]
fn heal_writes_skip_what_clients_changed_since_the_session_began() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let (c, h) = (cx(1), cx(2));
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
        assert_eq!(write(&l, &c, &fd, 0, b'a', 64 * K).await, Ok(64 * K));
        let hfd = l.heal_open(&h, "f", libc::O_WRONLY as u32).await.unwrap();
        // No session: a heal write has nothing to go by.
        assert_eq!(write(&l, &h, &hfd, 0, b'h', 10).await, Err(ETIMEDOUT));

        session(&l, &h, 1).await;
        let i = info(&l, &h).await;
        assert_eq!((i.live, i.busy), (1, 1), "a client has the file open");
        assert_eq!(write(&l, &c, &fd, 8 * K, b'c', 8 * K).await, Ok(8 * K));
        // The client's newer bytes stay; the reply counts what was written.
        assert_eq!(write(&l, &h, &hfd, 0, b'h', 64 * K).await, Ok(56 * K));
        let got = std::fs::read(root.path().join("f")).unwrap();
        let mut want = vec![b'h'; 64 * K as usize];
        want[8 * K as usize..16 * K as usize].fill(b'c');
        assert!(got == want, "the heal write overwrote the client's bytes");
        assert_eq!(ranges(&info(&l, &h).await), vec![(8 * K, 8 * K)]);
        assert_eq!(
            ranges(&info(&l, &h).await),
            vec![],
            "asking empties the list"
        );
        // The record lasts the whole session.
        assert_eq!(write(&l, &h, &hfd, 4 * K, b'h', 8 * K).await, Ok(4 * K));
        assert_eq!(ranges(&info(&l, &h).await), vec![(8 * K, 4 * K)]);

        // A heal size change that would cut what a client wrote is refused.
        assert_eq!(write(&l, &c, &fd, 100 * K, b'c', 4 * K).await, Ok(4 * K));
        let cut = SetAttrs {
            valid: SETATTR_SIZE,
            size: 64 * K,
            ..Default::default()
        };
        assert_eq!(l.fsetattr(&h, &hfd, &cut).await.err(), Some(EAGAIN));
        assert_eq!(l.fstat(&c, &fd).await.unwrap().size, 104 * K);

        session(&l, &h, 0).await;
        assert_eq!(info(&l, &h).await.live, 0);
        assert_eq!(write(&l, &h, &hfd, 0, b'h', 10).await, Err(ETIMEDOUT));
        // A new session starts with nothing recorded.
        session(&l, &h, 1).await;
        assert_eq!(write(&l, &h, &hfd, 0, b'h', 64 * K).await, Ok(64 * K));
        assert!(l.fsetattr(&h, &hfd, &cut).await.is_ok());
        assert_eq!(l.fstat(&c, &fd).await.unwrap().size, 64 * K);
        session(&l, &h, 0).await;

        l.release(&c, fd).await.unwrap();
        session(&l, &h, 1).await;
        let i = info(&l, &h).await;
        assert_eq!((i.live, i.busy), (1, 0), "no client has the file open");
        session(&l, &h, 0).await;
        l.release(&h, hfd).await.unwrap();
    });
}

#[test]
fn a_change_in_flight_when_the_session_begins_counts() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    run(async {
        let key = l.key("f");
        let id = Marks::enter(&key, 1, 4 * K, 8 * K).await.unwrap();
        session(&l, &cx(2), 1).await;
        Marks::leave(&key, id);
        let (id, keep) = Marks::enter_heal(&key, 2, 0, 16 * K, false).await.unwrap();
        Marks::leave(&key, id);
        assert_eq!(keep, vec![(0, 4 * K), (8 * K, 8 * K)]);
        let i = info(&l, &cx(2)).await;
        assert_eq!(i.busy, 1);
        assert_eq!(ranges(&i), vec![(4 * K, 4 * K)]);
    });
}

#[test]
fn a_lock_waiting_for_a_write_in_flight_is_woken_when_it_leaves() {
    let root = tempfile::tempdir().unwrap();
    let l = Arc::new(stack(root.path()));
    run(async {
        let key = l.key("f");
        let id = Marks::enter(&key, 1, 0, 4 * K).await.unwrap();
        let l2 = l.clone();
        let lock = tokio::spawn(async move { l2.lock(2, "f", 0, 8 * K).await });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!lock.is_finished(), "the lock waits for the write");
        let t = Instant::now();
        Marks::leave(&key, id);
        lock.await.unwrap().unwrap();
        // Not the lease (10 s): woken as the write left.
        assert!(t.elapsed() < std::time::Duration::from_secs(2));
    });
}

#[test]
fn a_conditional_clear_is_refused_after_a_new_mark() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let c = cx(1);
    run(async {
        let add = |v: Mark| {
            let (l, c) = (&l, &c);
            async move { l.mark_add(c, "f", &v).await }
        };
        let clear = |v: Mark| {
            let (l, c) = (&l, &c);
            async move { l.mark_clear(c, "f", &v).await }
        };
        let clear_if = |v: CondMark| {
            let (l, c) = (&l, &c);
            async move { l.mark_clear_if(c, "f", &v).await }
        };
        let gen = || {
            let p = l.pending_page("f");
            p.targets.0.iter().find(|t| t.target == 1).map(|t| t.gen)
        };
        let mark = |offset, len| Mark {
            target: 1,
            offset,
            len,
        };
        let cond = |offset, len, gen| CondMark {
            target: 1,
            offset,
            len,
            gen,
        };
        add(mark(0, 4 * K)).await.unwrap();
        let g1 = gen().unwrap();
        assert!(g1 > 0);
        add(mark(8 * K, 4 * K)).await.unwrap();
        let g2 = gen().unwrap();
        assert_ne!(g1, g2);
        assert_eq!(clear_if(cond(0, 4 * K, g1)).await, Err(EAGAIN));
        clear_if(cond(0, 4 * K, g2)).await.unwrap();
        let p = l.pending_page("f");
        let r: Vec<_> = p.targets.0[0].ranges.0.iter().map(|r| r.offset).collect();
        assert_eq!(r, vec![8 * K]);
        // Nothing held for a target: a clear against generation 0 is a no-op.
        let none = CondMark {
            target: 2,
            offset: 0,
            len: m::WHOLE,
            gen: 0,
        };
        clear_if(none).await.unwrap();
        // Cleared out, the generation is gone; a new mark gets a new one.
        clear(mark(0, m::WHOLE)).await.unwrap();
        assert_eq!(gen(), None);
        add(mark(0, 4 * K)).await.unwrap();
        assert!(gen().is_some_and(|g| g != g1 && g != g2));
    });
}

#[test]
fn flags_survive_a_restart_and_move_with_a_renamed_directory() {
    let root = tempfile::tempdir().unwrap();
    let flags = |l: &Marks, path: &str| {
        let p = l.pending_page(path);
        p.targets
            .0
            .iter()
            .map(|t| (t.target, t.flags))
            .collect::<Vec<_>>()
    };
    {
        let l = stack(root.path());
        l.apply(&[
            (b'F', "d", 1, u64::from(m::ENTRY), 0),
            (b'F', "d/f", 2, u64::from(m::META), 0),
            (b'A', "d/f", 2, 0, 4 * K),
            (b'F', "dx", 1, u64::from(m::META), 0),
        ])
        .unwrap();
        l.rename_marks("d", "e").unwrap();
        assert_eq!(
            flags(&l, "d"),
            vec![(1, m::ENTRY)],
            "the old name keeps ENTRY"
        );
        assert_eq!(flags(&l, "d/f"), vec![], "META moved");
        assert_eq!(flags(&l, "dx"), vec![(1, m::META)], "not beneath d");
        assert_eq!(flags(&l, "e/f"), vec![(2, m::META)]);
        let gen = l.pending_page("e").targets.0[0].gen;
        let no = CondFlag {
            target: 1,
            flags: m::ENTRY,
            gen: gen + 1,
            data: 0,
        };
        let set = |v: CondFlag| run(l.flag_clear_if(&cx(1), "e", &v));
        assert_eq!(set(no.clone()), Err(EAGAIN));
        set(CondFlag { gen, ..no }).unwrap();
        assert_eq!(flags(&l, "e"), vec![]);
    }
    let l = stack(root.path());
    assert_eq!(flags(&l, "d"), vec![(1, m::ENTRY)]);
    assert_eq!(flags(&l, "e/f"), vec![(2, m::META)]);
    let idx = l.index_page();
    let e = idx.entries.0.iter().find(|e| e.path == "e/f").unwrap();
    assert_eq!((e.flags, e.bytes), (m::META, 4 * K));
}

#[test]
fn a_pending_page_shares_its_room_and_says_where_it_cut() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let mut ops = Vec::new();
    for i in 0..5000u64 {
        ops.push((b'A', "f", 0u32, i * 32, 16u64));
    }
    for i in 0..3u64 {
        ops.push((b'A', "f", 1u32, i * 32, 16u64));
    }
    l.apply(&ops).unwrap();
    let p = l.pending_page("f");
    assert!(p.more);
    assert!(
        p.to_wire().len() <= m::PAGE_BYTES,
        "a page fits its room on the wire"
    );
    let (t0, t1) = (&p.targets.0[0], &p.targets.0[1]);
    let n = t0.ranges.0.len() as u64;
    assert!(n > 100 && n < 5000, "{n}");
    assert_eq!(t0.cut, n * 32, "the first range not listed");
    assert_eq!((t1.ranges.0.len(), t1.cut), (3, m::WHOLE));
}

#[test]
fn a_write_marked_records_the_misses_of_all_it_was_asked_to_write() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let c = cx(1);
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
        let data = IoBufs::owned(vec![vec![b'w'; 8 * K as usize]]);
        let w = l.write_marked(&c, &fd, 4 * K, data, 0b101).await.unwrap();
        assert_eq!(w.n as u64, 8 * K);
        assert_eq!(
            std::fs::read(root.path().join("f")).unwrap()[4 * K as usize..],
            vec![b'w'; 8 * K as usize][..],
            "the bytes are written"
        );
        let p = l.pending_page("f");
        let got: Vec<(u32, Vec<(u64, u64)>)> = p
            .targets
            .0
            .iter()
            .map(|t| {
                (
                    t.target,
                    t.ranges.0.iter().map(|r| (r.offset, r.len)).collect(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![(0, vec![(4 * K, 8 * K)]), (2, vec![(4 * K, 8 * K)])],
            "replicas 0 and 2 miss the range, replica 1 does not"
        );
        // Through a heal handle a write is heal's: it records no client's misses.
        let hfd = l.heal_open(&c, "f", libc::O_WRONLY as u32).await.unwrap();
        let data = IoBufs::owned(vec![vec![b'h'; 16]]);
        let r = l.write_marked(&c, &hfd, 0, data, 1).await;
        assert_eq!(r.map(|w| w.n), Err(crate::errno::EINVAL));
    });
}

/// The suspect marks (target [`m::ANY`]) on `path`: ranges and flags.
fn suspects(l: &Marks, path: &str) -> (Vec<(u64, u64)>, u32) {
    let p = l.pending_page(path);
    p.targets
        .0
        .iter()
        .find(|t| t.target == m::ANY)
        .map_or((vec![], 0), |t| {
            let r = t.ranges.0.iter().map(|r| (r.offset, r.len)).collect();
            (r, t.flags)
        })
}

#[test]
fn a_connection_that_ends_holding_a_handle_it_wrote_through_leaves_suspect_marks() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let (dies, leaves, other) = (cx(7), cx(8), cx(9));
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&dies, "f", flags, 0o644).await.unwrap();
        write(&l, &dies, &fd, 4 * K, b'a', 4 * K).await.unwrap();
        write(&l, &dies, &fd, 1024 * K, b'b', 100 * K)
            .await
            .unwrap();
        // Another connection writes through its own handle and releases it.
        let fd2 = l.open(&leaves, "f", libc::O_RDWR as u32).await.unwrap();
        write(&l, &leaves, &fd2, 4096 * K, b'c', 4 * K)
            .await
            .unwrap();
        l.release(&leaves, fd2).await.unwrap();
        l.hangup(8);
        assert_eq!(suspects(&l, "f"), (vec![], 0), "released: nothing suspect");
        // A third connection's end says nothing of the first's handle.
        l.hangup(9);
        assert_eq!(suspects(&l, "f").0, vec![]);
        let _ = other;

        l.hangup(7);
        let (r, f) = suspects(&l, "f");
        assert_eq!(
            r,
            vec![(0, 64 * K), (1024 * K, 128 * K)],
            "the ranges it wrote, to 64 KiB"
        );
        assert_eq!(f & m::ENTRY, m::ENTRY, "and the name it created");
        // Its handle, released after the connection ended, adds nothing; nor does a second
        // hangup.
        l.release(&dies, fd).await.unwrap();
        l.hangup(7);
        assert_eq!(suspects(&l, "f").0, r);
        // The suspect marks are in the log: a restarted brick has them.
        drop(l);
        let l = stack(root.path());
        assert_eq!(suspects(&l, "f").0, r);
        // Cleared like any mark, conditionally on their generation.
        let gen = l.pending_page("f").targets.0[0].gen;
        let all = CondFlag {
            target: m::ANY,
            flags: m::ENTRY | m::META,
            gen,
            data: 0,
        };
        l.flag_clear_if(&other, "f", &all).await.unwrap();
        let all = CondMark {
            target: m::ANY,
            offset: 0,
            len: m::WHOLE,
            gen,
        };
        l.mark_clear_if(&other, "f", &all).await.unwrap();
        assert!(l.pending_page("f").targets.0.is_empty());
    });
}

#[test]
fn a_connection_that_says_goodbye_leaves_no_suspect_marks() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let (leaves, dies) = (cx(7), cx(8));
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        for (c, path) in [(&leaves, "f"), (&dies, "g")] {
            let (fd, _) = l.create(c, path, flags, 0o644).await.unwrap();
            write(&l, c, &fd, 0, b'a', 4 * K).await.unwrap();
            l.release(c, fd).await.unwrap();
        }
        // Both created a name and wrote through a handle they closed; one said goodbye.
        l.goodbye(7);
        l.hangup(7);
        l.hangup(8);
        assert_eq!(suspects(&l, "f"), (vec![], 0), "goodbye: nothing suspect");
        assert_eq!(
            suspects(&l, "g").1 & m::ENTRY,
            m::ENTRY,
            "no goodbye: its name"
        );
        // A change after the goodbye is recorded again.
        let (fd, _) = l.create(&leaves, "h", flags, 0o644).await.unwrap();
        write(&l, &leaves, &fd, 0, b'b', 4 * K).await.unwrap();
        l.hangup(7);
        assert_eq!(suspects(&l, "h").0, vec![(0, 64 * K)]);
        l.release(&leaves, fd).await.unwrap();
    });
}

#[test]
fn a_handle_writing_everywhere_keeps_a_bounded_record() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let c = cx(3);
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
        // Every other 64 KiB of 1 GiB: far more ranges than a record keeps.
        for i in 0..(super::recent::MOST as u64 * 3) {
            write(&l, &c, &fd, i * 128 * K, b'x', 512).await.unwrap();
        }
        l.hangup(3);
        let (r, _) = suspects(&l, "f");
        assert!(r.len() <= super::recent::MOST, "{} ranges", r.len());
        // Still every byte written is covered.
        let covered = |o: u64| r.iter().any(|(s, l)| *s <= o && o < s + l);
        for i in 0..(super::recent::MOST as u64 * 3) {
            assert!(
                covered(i * 128 * K),
                "write {i} is not in the suspect ranges"
            );
        }
        l.release(&c, fd).await.unwrap();
    });
}

#[test]
fn heal_changes_of_a_name_skip_what_clients_changed_since_the_session_began() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let (c, h) = (cx(1), cx(2));
    let mode = |m: u32| SetAttrs {
        valid: kiln_proto::ops::SETATTR_MODE,
        mode: m,
        ..Default::default()
    };
    let stat = |p: &str| std::fs::metadata(root.path().join(p)).map(|m| m.mode() & 0o7777);
    use std::os::unix::fs::MetadataExt;
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
        l.release(&c, fd).await.unwrap();
        // Without a session heal's changes are anyone's.
        l.setattr(&h, "f", &mode(0o600)).await.unwrap();
        assert_eq!(stat("f").unwrap(), 0o600);

        session(&l, &h, 1).await;
        l.setattr(&c, "f", &mode(0o640)).await.unwrap();
        // Heal's copy of the mode (and times) read from a source before the client's change
        // reached it: the mode is left as the client set it, the times are set.
        let mut both = mode(0o600);
        both.valid |= kiln_proto::ops::SETATTR_MTIME;
        both.mtime = kiln_proto::ops::Time {
            sec: 1_000_000,
            nsec: 0,
        };
        l.setattr(&h, "f", &both).await.unwrap();
        assert_eq!(stat("f").unwrap(), 0o640, "heal undid the client's chmod");
        let mtime = std::fs::metadata(root.path().join("f")).unwrap().mtime();
        assert_eq!(
            mtime, 1_000_000,
            "the times were not touched: heal sets them"
        );
        // Xattrs untouched so far: heal's go through; after a client's, heal's are skipped.
        l.setxattr(&h, "f", "user.a", b"heal", 0).await.unwrap();
        l.setxattr(&c, "f", "user.a", b"client", 0).await.unwrap();
        let r = l.removexattr(&h, "f", "user.a").await;
        assert_eq!(r, Err(m::SKIPPED));
        // A client that makes the entry anew makes every part of it newer.
        l.unlink(&c, "f").await.unwrap();
        l.mkdir(&c, "f", 0o755).await.unwrap();
        assert_eq!(l.rmdir(&h, "f").await, Err(m::SKIPPED));
        l.setattr(&h, "f", &mode(0o700)).await.unwrap();
        assert_eq!(stat("f").unwrap(), 0o755);
        session(&l, &h, 0).await;
        // The session over, heal's changes apply again.
        l.setattr(&h, "f", &mode(0o700)).await.unwrap();
        assert_eq!(stat("f").unwrap(), 0o700);
    });
}

#[test]
fn a_migration_records_client_changes_then_freezes_and_moves_the_file_for_good() {
    use crate::ReadDst;
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let (c, mv) = (cx(1), cx(2));
    let moved = Err(crate::errno::EMOVED);
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
        assert_eq!(write(&l, &c, &fd, 0, b'a', 64 * K).await, Ok(64 * K));
        session(&l, &mv, m::SESSION_MIGRATE).await;
        assert_eq!(write(&l, &c, &fd, 8 * K, b'b', 4 * K).await, Ok(4 * K));
        // What clients changed is handed over on request, once.
        session(&l, &mv, m::SESSION_DIRTY).await;
        assert_eq!(ranges(&info(&l, &mv).await), vec![(8 * K, 4 * K)]);
        session(&l, &mv, m::SESSION_DIRTY).await;
        assert_eq!(ranges(&info(&l, &mv).await), vec![]);
        // Frozen: every client fop on the file says EMOVED; the mover's go through.
        session(&l, &mv, m::SESSION_FREEZE).await;
        assert_eq!(write(&l, &c, &fd, 0, b'c', 10).await, moved);
        let r = l.read(&c, &fd, 0, ReadDst::Any(10)).await.map(|o| o.len());
        assert_eq!(r, moved.map(|_: u64| 0));
        assert!(
            matches!(l.open(&c, "f", libc::O_RDONLY as u32).await, Err(e) if e == crate::errno::EMOVED)
        );
        assert_eq!(l.unlink(&c, "f").await, moved.map(|_: u64| ()));
        let mfd = l.open(&mv, "f", libc::O_RDONLY as u32).await.unwrap();
        let r = l
            .read(&mv, &mfd, 0, ReadDst::Any(10))
            .await
            .map(|o| o.len());
        assert_eq!(r, Ok(10));
        // A freeze lasts as long as its session.
        session(&l, &mv, m::SESSION_END).await;
        assert_eq!(write(&l, &c, &fd, 0, b'c', 10).await, Ok(10));
        // Marked moved only under a live freeze.
        session(&l, &mv, m::SESSION_MIGRATE).await;
        let timedout = Err(ETIMEDOUT);
        let req = HealReq {
            begin: m::SESSION_MOVED,
        };
        assert_eq!(
            l.heal_session(&mv, "f", &req).await,
            timedout.map(|_: u64| ())
        );
        assert_eq!(write(&l, &c, &fd, 0, b'c', 10).await, Ok(10));
        // Moved: the handles open on it fail for good, the name says EMOVED a while, and a
        // file made anew under the name is another file.
        session(&l, &mv, m::SESSION_FREEZE).await;
        session(&l, &mv, m::SESSION_MOVED).await;
        assert_eq!(write(&l, &c, &fd, 0, b'c', 10).await, moved);
        assert!(matches!(l.lookup(&c, "f").await, Err(e) if e == crate::errno::EMOVED));
        l.unlink(&mv, "f").await.unwrap();
        let (fd2, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
        assert_eq!(write(&l, &c, &fd2, 0, b'd', 10).await, Ok(10));
        assert!(l.lookup(&c, "f").await.is_ok());
        assert_eq!(write(&l, &c, &fd, 0, b'c', 10).await, moved);
    });
}

#[test]
fn a_name_changed_during_a_migration_fails_its_freeze() {
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let (c, mv) = (cx(1), cx(2));
    run(async {
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
        assert_eq!(write(&l, &c, &fd, 0, b'a', 4 * K).await, Ok(4 * K));
        session(&l, &mv, m::SESSION_MIGRATE).await;
        // A client renames another file over the name: the mover copied the old one.
        let (other, _) = l.create(&c, "g", flags, 0o644).await.unwrap();
        l.release(&c, other).await.unwrap();
        l.rename(&c, "g", "f", 0).await.unwrap();
        let req = HealReq {
            begin: m::SESSION_FREEZE,
        };
        assert_eq!(
            l.heal_session(&mv, "f", &req).await,
            Err(libc::ESTALE as u32)
        );
        // Nothing is frozen: the client goes on.
        assert_eq!(write(&l, &c, &fd, 0, b'b', 10).await, Ok(10));
    });
}

#[test]
fn dirty_records_are_kept_across_a_clean_stop_for_the_same_file_only() {
    use kiln_proto::ops::{DirtyReq, DIRTY_GET, DIRTY_START};
    let root = tempfile::tempdir().unwrap();
    let c = cx(1);
    let get = |l: &Marks, path: &str| {
        let key = l.key(path);
        let req = DirtyReq {
            fh: 0,
            cmd: DIRTY_GET,
            name: "n".into(),
            offset: 0,
            len: 1 << 20,
        };
        Marks::dirty_req(&key, &req).map(|l| {
            l.runs
                .0
                .iter()
                .scan(0, |at, e| {
                    let r = (*at, e.len, e.hole);
                    *at += e.len;
                    Some(r)
                })
                .filter(|r| !r.2)
                .map(|r| (r.0, r.1))
                .collect::<Vec<_>>()
        })
    };
    let start = DirtyReq {
        fh: 0,
        cmd: DIRTY_START,
        name: "n".into(),
        offset: 0,
        len: 0,
    };
    {
        let l = stack(root.path());
        run(async {
            let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
            for f in ["a", "b"] {
                let (fd, _) = l.create(&c, f, flags, 0o644).await.unwrap();
                Marks::dirty_req(&l.key(f), &start).unwrap();
                write(&l, &c, &fd, 8 * K, b'x', 4 * K).await.unwrap();
                l.release(&c, fd).await.unwrap();
            }
        });
        assert_eq!(l.keep_dirty().unwrap(), 2);
    }
    // "b" is replaced while the brick is away: its record is not for the new file.
    std::fs::remove_file(root.path().join("b")).unwrap();
    std::fs::write(root.path().join("b"), b"new").unwrap();
    let l = stack(root.path());
    assert_eq!(get(&l, "a"), Ok(vec![(8 * K, 4 * K)]));
    assert_eq!(get(&l, "b"), Err(crate::errno::ENOENT));
    // Loaded once: a brick that dies now comes back knowing none.
    assert!(!root.path().join(".kiln/dirty.json").exists());
    drop(l);
    let l = stack(root.path());
    assert_eq!(get(&l, "a"), Err(crate::errno::ENOENT));
}

#[test]
fn a_directory_renamed_takes_its_files_dirty_records_along_to_nowhere() {
    use kiln_proto::ops::{DirtyReq, DIRTY_GET, DIRTY_START};
    let root = tempfile::tempdir().unwrap();
    let l = stack(root.path());
    let c = cx(1);
    let req = |cmd| DirtyReq {
        fh: 0,
        cmd,
        name: "n".into(),
        offset: 0,
        len: 1 << 20,
    };
    run(async {
        l.mkdir(&c, "d", 0o755).await.unwrap();
        let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
        let (fd, _) = l.create(&c, "d/f", flags, 0o644).await.unwrap();
        Marks::dirty_req(&l.key("d/f"), &req(DIRTY_START)).unwrap();
        write(&l, &c, &fd, 0, b'x', 4 * K).await.unwrap();
        l.release(&c, fd).await.unwrap();
        assert!(Marks::dirty_req(&l.key("d/f"), &req(DIRTY_GET)).is_ok());
        // The directory moves away and a new file takes the old path: no record is its.
        l.rename(&c, "d", "e", 0).await.unwrap();
        l.mkdir(&c, "d", 0o755).await.unwrap();
        let (fd, _) = l.create(&c, "d/f", flags, 0o644).await.unwrap();
        l.release(&c, fd).await.unwrap();
    });
    assert_eq!(
        Marks::dirty_req(&l.key("d/f"), &req(DIRTY_GET)).map(|_| ()),
        Err(crate::errno::ENOENT)
    );
}
