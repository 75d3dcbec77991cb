//! Replica-3 under a brick failure: real kilnd processes (one per brick, so one can be killed
//! with SIGKILL mid-stream), a real client stack over TCP, heal, and a byte-for-byte check of
//! every replica's file on disk against a model of the acknowledged writes.
//!
//! Heal runs both after the writes stop and while they go on (into the very ranges it copies,
//! from bricks that take writes later than the one being healed). The second is where a write
//! that reaches the returning brick before heal's lock and the source after heal's read would
//! be overwritten by the source's older bytes; heal sessions ([`kiln_layer::marks`]) keep it.
//!
//! Runs are seeded: `KILN_SEED=N` repeats one, `KILN_RUNS=N` sets how many each test makes; a
//! failure prints its seed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use kiln_layer::Ctx;

use crate::replica;
use replica::{index_empty, seeds, volfile, wait_for, Brick, Rng, CI_RUNS};

const FILE: &str = "image.raw";
const SIZE: u64 = 8 << 20;
const BLOCK: usize = 64 << 10;

/// One seeded run: stream verified writes, kill -9 a brick mid-stream, keep writing, restart
/// it, keep writing, heal; then every replica equals the model of acknowledged writes.
fn kill_run(seed: u64) {
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let vol = Arc::new(Volume::from_volfile(&volfile(&bricks)).expect("connect"));
    let mut rng = Rng(seed | 1);
    let victim = (rng.next() % 3) as usize;

    let fd = block_on(vol.create(FILE, libc::O_RDWR | libc::O_CREAT, 0o644))
        .expect("create")
        .0;
    let size = kiln_layer::SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: SIZE,
        ..Default::default()
    };
    block_on(vol.top().fsetattr(&Ctx::NONE, &fd, &size)).expect("size the file");
    let model = Arc::new(std::sync::Mutex::new(vec![0u8; SIZE as usize]));
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (vol, fd, model, acked, stop) = (
            vol.clone(),
            fd.clone(),
            model.clone(),
            acked.clone(),
            stop.clone(),
        );
        let mut rng = Rng(rng.next() | 1);
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let blocks = SIZE / BLOCK as u64;
                let off = (rng.next() % blocks) * BLOCK as u64 + (rng.next() % 8) * 512;
                let len = BLOCK.min((SIZE - off) as usize);
                let fill = rng.next();
                let buf: Vec<u8> = (0..len)
                    .map(|i| (fill.wrapping_add(i as u64 * 7) >> 3) as u8)
                    .collect();
                let (r, back) = block_on(vol.pwritev(&fd, vec![buf], off));
                let w = r.unwrap_or_else(|e| {
                    panic!(
                        "seed {seed}: write {n} at {off} failed with one brick down at most: {e}"
                    )
                });
                assert_eq!(w, len, "seed {seed}: short write");
                model.lock().unwrap()[off as usize..off as usize + len].copy_from_slice(&back[0]);
                n += 1;
                acked.store(n, Ordering::Release);
            }
        })
    };
    let at = |k: u64| {
        let a = acked.clone();
        wait_for(
            &format!("{k} acknowledged writes (seed {seed})"),
            60,
            move || a.load(Ordering::Acquire) >= k,
        )
    };
    let base = 20 + rng.next() % 30;
    at(base);
    bricks[victim].kill9();
    at(base + 40 + rng.next() % 40);
    bricks[victim].start();
    let rep = heal::replicate_layers(vol.top()).remove(0);
    wait_for(
        &format!("the client to reconnect (seed {seed})"),
        30,
        || rep.children()[victim].up(),
    );
    let now = acked.load(Ordering::Acquire);
    at(now + 20);
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    block_on(vol.fsync(&fd, false)).expect("fsync");

    // Heal on connections of its own, as the heal service does. (Heal while the writes go on:
    // `heal_while_verified_writes_go_on_seeded_runs`.)
    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer connects");
    let need = block_on(heal::info(healer.top()));
    assert!(
        need.iter().any(|n| n.path == FILE && n.target == victim),
        "seed {seed}: heal info does not name {FILE} on brick {victim}: {need:?}"
    );
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    eprintln!(
        "seed {seed}: victim {victim}, {} writes, heal moved {} B in {} file(s)",
        acked.load(Ordering::Acquire),
        report.bytes,
        report.files
    );
    assert!(
        report.errors.is_empty(),
        "seed {seed}: heal errors {:?}",
        report.errors
    );
    assert_eq!(report.left, 0, "seed {seed}: heal left files behind");
    assert!(report.bytes > 0, "seed {seed}: heal moved nothing");
    assert!(index_empty(&healer), "seed {seed}: marks remain after heal");
    replica::sums_clean(&bricks, seed);

    let want = model.lock().unwrap().clone();
    for (i, b) in bricks.iter().enumerate() {
        let got = b.file(FILE);
        assert_eq!(got.len(), want.len(), "seed {seed}: brick {i} size differs");
        if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
            panic!("seed {seed}: brick {i} (victim {victim}) differs from the acknowledged writes at byte {at}");
        }
    }
    // And through the volume, from whichever replica it picks.
    let (r, back) = block_on(vol.preadv(&fd, vec![vec![0u8; SIZE as usize]], 0));
    assert_eq!(r.expect("read"), SIZE as usize);
    assert!(back[0] == want, "seed {seed}: volume read differs");
    let _ = block_on(vol.close(fd));
}

#[test]
fn kill9_one_of_three_during_verified_writes_seeded_runs() {
    for (run, seed) in seeds(CI_RUNS).iter().enumerate() {
        eprintln!("run {run}: seed {seed}");
        kill_run(*seed);
    }
}

const LIVE_FILE: &str = "live.raw";
const LIVE_SIZE: u64 = 4 << 20;
const LIVE_BLOCK: u64 = 32 << 10;
/// Writer threads: each owns the blocks `b` with `b % WRITERS == its index`, so writes in flight
/// never overlap one another and the model of acknowledged writes does not depend on their
/// order, while together they cover every chunk heal copies.
const WRITERS: u64 = 4;
/// Writes acknowledged while the victim is down: at least this many, at most twice.
const DOWN_WRITES: u64 = 30;
/// How long writes wait on the bricks heal copies from (µs).
const SLOW_US: u64 = 2000;
/// While heal runs, one write in `FOCUS` goes to a block the victim missed.
const FOCUS: u64 = 2;

/// One seeded run: kill -9 a brick while `WRITERS` threads stream verified writes, restart it,
/// and heal it *while the writes go on* (into the ranges being healed); then every replica
/// equals the model of acknowledged writes.
fn heal_during_writes_run(seed: u64) {
    let root = tempfile::tempdir().unwrap();
    let mut rng = Rng(seed | 1);
    let victim = (rng.next() % 3) as usize;
    // The replicas heal copies from take writes a little later than the victim: a write's copy
    // can then reach the victim before heal's lock and a source after heal's read.
    let mut bricks: Vec<Brick> = (0..3)
        .map(|i| Brick::slow(root.path(), i, (i != victim).then_some((SLOW_US, 1.0))))
        .collect();
    let vol = Arc::new(Volume::from_volfile(&volfile(&bricks)).expect("connect"));

    let fd = block_on(vol.create(LIVE_FILE, libc::O_RDWR | libc::O_CREAT, 0o644))
        .expect("create")
        .0;
    let size = kiln_layer::SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: LIVE_SIZE,
        ..Default::default()
    };
    block_on(vol.top().fsetattr(&Ctx::NONE, &fd, &size)).expect("size the file");
    let model = Arc::new(std::sync::Mutex::new(vec![0u8; LIVE_SIZE as usize]));
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // While `down`, writers note the blocks they write (the victim misses them); while
    // `healing`, every other write goes to one of those, the ranges heal is copying.
    let down = Arc::new(AtomicBool::new(false));
    let healing = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|k| {
            let (vol, fd, model, acked, stop, down, healing) = (
                vol.clone(),
                fd.clone(),
                model.clone(),
                acked.clone(),
                stop.clone(),
                down.clone(),
                healing.clone(),
            );
            let mut rng = Rng(rng.next() | 1);
            std::thread::spawn(move || {
                let mine = LIVE_SIZE / LIVE_BLOCK / WRITERS;
                let mut missed = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let pick = rng.next();
                    let block = if healing.load(Ordering::Relaxed)
                        && !missed.is_empty()
                        && pick.is_multiple_of(FOCUS)
                    {
                        missed[(pick >> 8) as usize % missed.len()]
                    } else {
                        (rng.next() % mine) * WRITERS + k
                    };
                    if down.load(Ordering::Relaxed) {
                        missed.push(block);
                    }
                    // Within the block: a random start and end on 512-byte boundaries.
                    let head = (rng.next() % 16) * 512;
                    let tail = (rng.next() % 16) * 512;
                    let off = block * LIVE_BLOCK + head;
                    let len = (LIVE_BLOCK - head - tail) as usize;
                    let fill = rng.next();
                    let buf: Vec<u8> = (0..len)
                        .map(|i| (fill.wrapping_add(i as u64 * 7) >> 3) as u8)
                        .collect();
                    let (r, back) = block_on(vol.pwritev(&fd, vec![buf], off));
                    let w = r.unwrap_or_else(|e| {
                        panic!(
                            "seed {seed}: write at {off} failed with one brick down at most: {e}"
                        )
                    });
                    assert_eq!(w, len, "seed {seed}: short write");
                    model.lock().unwrap()[off as usize..off as usize + len]
                        .copy_from_slice(&back[0]);
                    acked.fetch_add(1, Ordering::AcqRel);
                }
            })
        })
        .collect();
    let at = |k: u64| {
        let a = acked.clone();
        wait_for(
            &format!("{k} acknowledged writes (seed {seed})"),
            60,
            move || a.load(Ordering::Acquire) >= k,
        )
    };
    at(10 + rng.next() % 20);
    bricks[victim].kill9();
    down.store(true, Ordering::Relaxed);
    let now = acked.load(Ordering::Acquire);
    at(now + DOWN_WRITES + rng.next() % DOWN_WRITES);
    down.store(false, Ordering::Relaxed);
    bricks[victim].start();
    let rep = heal::replicate_layers(vol.top()).remove(0);
    wait_for(
        &format!("the client to reconnect (seed {seed})"),
        30,
        || rep.children()[victim].up(),
    );
    let now = acked.load(Ordering::Acquire);
    at(now + 4);

    // Heal while the writers go on.
    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer connects");
    let during = acked.load(Ordering::Acquire);
    healing.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    let took = t0.elapsed();
    healing.store(false, Ordering::Relaxed);
    let during = acked.load(Ordering::Acquire) - during;
    let now = acked.load(Ordering::Acquire);
    at(now + 8);
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().expect("writer");
    }
    block_on(vol.fsync(&fd, false)).expect("fsync");
    eprintln!(
        "seed {seed}: victim {victim}, {} writes ({during} during heal), heal moved {} B in {took:?}",
        acked.load(Ordering::Acquire),
        report.bytes,
    );
    assert!(
        report.errors.is_empty(),
        "seed {seed}: heal errors {:?}",
        report.errors
    );
    assert_eq!(report.left, 0, "seed {seed}: heal left files behind");
    assert!(report.bytes > 0, "seed {seed}: heal moved nothing");
    assert!(
        during > 0,
        "seed {seed}: no write was acknowledged while heal ran"
    );
    assert!(index_empty(&healer), "seed {seed}: marks remain after heal");
    replica::sums_clean(&bricks, seed);

    let want = model.lock().unwrap().clone();
    for (i, b) in bricks.iter().enumerate() {
        let got = b.file(LIVE_FILE);
        assert_eq!(got.len(), want.len(), "seed {seed}: brick {i} size differs");
        if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
            panic!(
                "seed {seed}: brick {i} (victim {victim}) differs from the acknowledged writes \
                 at byte {at}"
            );
        }
    }
    let (r, back) = block_on(vol.preadv(&fd, vec![vec![0u8; LIVE_SIZE as usize]], 0));
    assert_eq!(r.expect("read"), LIVE_SIZE as usize);
    assert!(back[0] == want, "seed {seed}: volume read differs");
    let _ = block_on(vol.close(fd));
}

/// Seeds: `KILN_SEED=N` repeats one run; else `runs` seeds from the clock.
#[test]
fn heal_while_verified_writes_go_on_seeded_runs() {
    for (run, seed) in seeds(CI_RUNS).iter().enumerate() {
        eprintln!("run {run}: seed {seed}");
        heal_during_writes_run(*seed);
    }
}

/// A replica that a write reached while another one missed it is newer there, even inside a
/// range marked as missed on it: heal must not copy to it from the replica that missed the
/// write. Here replica 0 missed [0, 256K) (marked on 1 and 2), then took a write to
/// [64K, 128K) that replica 1 missed (marked on 0 and 2); replica 2 has everything. With
/// replica 2 down no replica is current for all of [0, 256K): heal leaves both marked and
/// says so. With it back, heal copies 2 → 0, then 0 → 1, and all three agree.
#[test]
fn heal_copies_only_from_a_replica_that_is_current() {
    const N: usize = 256 << 10;
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let vol = Volume::from_volfile(&volfile(&bricks)).expect("connect");
    let (fd, _) = block_on(vol.create("two.raw", libc::O_RDWR | libc::O_CREAT, 0o644)).unwrap();
    let _ = block_on(vol.close(fd));
    let pattern = |tag: u8| -> Vec<u8> { (0..N).map(|i| tag ^ (i / 512) as u8).collect() };
    let newer = pattern(0x11);
    let mut on0 = pattern(0x22);
    on0[64 << 10..128 << 10].copy_from_slice(&newer[64 << 10..128 << 10]);
    let mut on1 = newer.clone();
    on1[64 << 10..128 << 10].copy_from_slice(&pattern(0x33)[64 << 10..128 << 10]);
    for (b, data) in bricks.iter().zip([&on0, &on1, &newer]) {
        std::fs::write(b.dir.join("two.raw"), data).unwrap();
    }
    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer connects");
    let rep = heal::replicate_layers(healer.top()).remove(0);
    let mark = |on: usize, target: u32, offset: u64, len: u64| {
        let v = kiln_layer::marks::Mark {
            target,
            offset,
            len,
        };
        block_on(rep.children()[on].mark_add(&Ctx::NONE, "two.raw", &v)).unwrap();
    };
    for on in [1, 2] {
        mark(on, 0, 0, N as u64);
    }
    for on in [0, 2] {
        mark(on, 1, 64 << 10, 64 << 10);
    }

    bricks[2].kill9();
    wait_for("the healer to see brick 2 down", 30, || {
        !rep.children()[2].up()
    });
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    eprintln!("with replica 2 down: {report:?}");
    assert_eq!(report.files, 0, "{report:?}");
    assert_eq!(report.left, 2, "{report:?}");
    assert_eq!(report.errors.len(), 2, "{report:?}");
    // Replica 0 may take the chunks replica 1 is current for, never the range no replica
    // that is up is current for; replica 1 takes nothing (replica 0 is behind everywhere).
    let r0 = bricks[0].file("two.raw");
    let contested = 64 << 10..128 << 10;
    assert!(
        r0[contested.clone()] == on0[contested],
        "replica 0 took bytes no current replica had"
    );
    assert!(
        r0.iter()
            .zip(&on0)
            .zip(&newer)
            .all(|((g, a), b)| g == a || g == b),
        "replica 0 holds bytes that are neither its own nor the current ones"
    );
    assert!(bricks[1].file("two.raw") == on1, "replica 1 was copied to");

    bricks[2].start();
    wait_for("the healer to reconnect", 30, || rep.children()[2].up());
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    eprintln!("with replica 2 back: {report:?}");
    assert_eq!((report.files, report.left), (2, 0), "{report:?}");
    assert!(index_empty(&healer), "marks remain after heal");
    for (i, b) in bricks.iter().enumerate() {
        assert!(b.file("two.raw") == newer, "replica {i} differs after heal");
    }
}

/// Heal's source dies part way through a copy: heal goes on from the other current replica and
/// finishes, and the target ends up with every byte. The target brick's writes are slowed
/// (20 ms per chunk) so that the copy is still running when the source is killed.
#[test]
fn heal_switches_source_when_its_source_dies() {
    const N: usize = 24 << 20;
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = vec![
        Brick::new(root.path(), 0),
        Brick::new(root.path(), 1),
        Brick::slow(root.path(), 2, Some((20_000, 1.0))),
    ];
    let data: Vec<u8> = (0..N).map(|i| (i / 4096) as u8 ^ (i as u8)).collect();
    {
        let vol = Volume::from_volfile(&volfile(&bricks)).expect("connect");
        let (fd, _) = block_on(vol.create("img", libc::O_RDWR | libc::O_CREAT, 0o644)).unwrap();
        let _ = block_on(vol.close(fd));
    }
    // Replicas 0 and 1 have the data; replica 2 missed all of it (as if it had been away).
    for b in &bricks[..2] {
        std::fs::write(b.dir.join("img"), &data).unwrap();
    }
    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer connects");
    let rep = heal::replicate_layers(healer.top()).remove(0);
    for on in [0, 1] {
        let v = kiln_layer::marks::Mark {
            target: 2,
            offset: 0,
            len: kiln_layer::marks::WHOLE,
        };
        block_on(rep.children()[on].mark_add(&Ctx::NONE, "img", &v)).unwrap();
    }
    let top = healer.top().clone();
    let run = std::thread::spawn(move || block_on(heal::run(&top, &|_, _| {})));
    // The copy has begun (bytes reached replica 2, from replica 0, the first holder): kill
    // the source.
    let target = bricks[2].dir.join("img");
    wait_for("heal to start copying", 60, || {
        std::fs::metadata(&target)
            .map(|m| m.len() > 0)
            .unwrap_or(false)
    });
    bricks[0].kill9();
    let report = run.join().expect("heal thread");
    eprintln!("{report:?}");
    assert!(
        report.errors.is_empty(),
        "heal gave up: {:?}",
        report.errors
    );
    assert_eq!(report.files, 1, "{report:?}");
    assert!(
        std::fs::read(&target).unwrap() == data,
        "replica 2 has every byte after heal switched source"
    );
    assert!(
        std::fs::metadata(&target).unwrap().len() as usize == N,
        "and the right size"
    );
}

/// 4k random writes to a 1 GiB image keep going with a brick down; heal then moves no more than
/// twice the bytes written meanwhile.
#[test]
fn heal_moves_what_was_missed() {
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let vol = Volume::from_volfile(&volfile(&bricks)).expect("connect");
    let (fd, _) = block_on(vol.create("vm.img", libc::O_RDWR | libc::O_CREAT, 0o644)).unwrap();
    let gib = 1u64 << 30;
    let top = vol.top().clone();
    let size = kiln_layer::SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: gib,
        ..Default::default()
    };
    block_on(top.fsetattr(&Ctx::NONE, &fd, &size)).expect("size the image");

    bricks[1].kill9();
    let mut rng = Rng(0x5eed);
    let writes = 2000u64;
    for _ in 0..writes {
        let off = (rng.next() % (gib / 4096)) * 4096;
        let (r, _) = block_on(vol.pwritev(&fd, vec![vec![0xa5u8; 4096]], off));
        assert_eq!(r.expect("write with a brick down"), 4096);
    }
    let written_down = writes * 4096;
    bricks[1].start();
    let rep = heal::replicate_layers(vol.top()).remove(0);
    wait_for("the client to reconnect", 30, || rep.children()[1].up());

    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer");
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    eprintln!(
        "written while down: {written_down} B; heal moved {} B ({:.2}x)",
        report.bytes,
        report.bytes as f64 / written_down as f64
    );
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(report.bytes > 0, "heal moved nothing");
    assert!(
        report.bytes <= 2 * written_down,
        "heal moved {} B for {written_down} B written while the brick was down",
        report.bytes
    );
    let a = std::fs::metadata(bricks[0].dir.join("vm.img"))
        .unwrap()
        .len();
    let b = std::fs::metadata(bricks[1].dir.join("vm.img"))
        .unwrap()
        .len();
    assert_eq!(a, b, "healed replica has another size");
    let _ = block_on(vol.close(fd));
}

/// A sparse image created while a brick was down heals as what it holds, not as its size:
/// heal skips the holes the source and the target share, and the healed replica stays sparse
/// and equal to the others.
#[test]
fn heal_keeps_holes_as_holes() {
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let vol = Volume::from_volfile(&volfile(&bricks)).expect("connect");
    bricks[2].kill9();
    let (fd, _) = block_on(vol.create("sparse.img", libc::O_RDWR | libc::O_CREAT, 0o644)).unwrap();
    let gib = 1u64 << 30;
    let size = kiln_layer::SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: gib,
        ..Default::default()
    };
    block_on(vol.top().fsetattr(&Ctx::NONE, &fd, &size)).expect("size the image");
    // 4 MiB of data in 16 pieces, and the last bytes of the image.
    let mut data: Vec<(u64, usize)> = (0..16)
        .map(|i| (i * (gib / 16) + 12345, 256 << 10))
        .collect();
    data.push((gib - 100, 100));
    for (i, (off, len)) in data.iter().enumerate() {
        let (r, _) = block_on(vol.pwritev(&fd, vec![vec![i as u8 + 1; *len]], *off));
        assert_eq!(r.expect("write with a brick down"), *len);
    }
    let written: u64 = data.iter().map(|(_, l)| *l as u64).sum();
    let _ = block_on(vol.close(fd));
    bricks[2].start();
    let rep = heal::replicate_layers(vol.top()).remove(0);
    wait_for("the client to reconnect", 30, || rep.children()[2].up());

    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer");
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    eprintln!(
        "sparse image of {gib} B holding {written} B: heal moved {} B",
        report.bytes
    );
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(report.bytes >= written, "heal moved {} B", report.bytes);
    // Each piece may bring the rest of its chunks along, never the holes between.
    let bound = written + 2 * 17 * kiln_layer::heal::CHUNK;
    assert!(
        report.bytes <= bound,
        "heal moved {} B (bound {bound})",
        report.bytes
    );
    use std::os::unix::fs::MetadataExt;
    let healed = std::fs::metadata(bricks[2].dir.join("sparse.img")).unwrap();
    assert_eq!(healed.len(), gib, "healed replica has another size");
    assert!(
        healed.blocks() * 512 <= bound + (1 << 20),
        "healed replica allocates {} B",
        healed.blocks() * 512
    );
    let read = |b: &Brick, off: u64, len: usize| {
        let f = std::fs::File::open(b.dir.join("sparse.img")).unwrap();
        let mut v = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut v, off).unwrap();
        v
    };
    // Around every piece and in the middle of the holes, byte for byte.
    for (off, len) in &data {
        let from = off.saturating_sub(4096);
        let n = (*len + 8192).min((gib - from) as usize);
        assert!(
            read(&bricks[2], from, n) == read(&bricks[0], from, n),
            "at {from}"
        );
        let mid = off + gib / 32;
        if mid + 4096 <= gib {
            assert_eq!(
                read(&bricks[2], mid, 4096),
                vec![0u8; 4096],
                "hole at {mid}"
            );
        }
    }
}

/// Two heals at once (the heal service and `kiln volume heal`, each on connections of its
/// own) over the same files: neither fails — the one that finds a file being healed by the
/// other waits for it rather than time out — and the copies agree after.
#[test]
fn two_heals_at_once_both_finish() {
    const N: usize = 8 << 20;
    const FILES: usize = 3;
    let root = tempfile::tempdir().unwrap();
    let bricks: Vec<Brick> = vec![
        Brick::new(root.path(), 0),
        Brick::new(root.path(), 1),
        Brick::slow(root.path(), 2, Some((20_000, 1.0))),
    ];
    let data: Vec<u8> = (0..N).map(|i| (i / 4096) as u8 ^ (i as u8)).collect();
    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer connects");
    let rep = heal::replicate_layers(healer.top()).remove(0);
    for f in 0..FILES {
        let name = format!("img{f}");
        {
            let vol = Volume::from_volfile(&volfile(&bricks)).expect("connect");
            let (fd, _) = block_on(vol.create(&name, libc::O_RDWR | libc::O_CREAT, 0o644)).unwrap();
            let _ = block_on(vol.close(fd));
        }
        for b in &bricks[..2] {
            std::fs::write(b.dir.join(&name), &data).unwrap();
        }
        for on in [0, 1] {
            let v = kiln_layer::marks::Mark {
                target: 2,
                offset: 0,
                len: kiln_layer::marks::WHOLE,
            };
            block_on(rep.children()[on].mark_add(&Ctx::NONE, &name, &v)).unwrap();
        }
    }
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let v = Volume::from_volfile(&volfile(&bricks)).expect("second healer connects");
            std::thread::spawn(move || {
                let t = Instant::now();
                let r = block_on(heal::run(v.top(), &|_, _| {}));
                (r, t.elapsed())
            })
        })
        .collect();
    for (k, h) in runs.into_iter().enumerate() {
        let (report, took) = h.join().expect("heal thread");
        eprintln!("heal {k}: {report:?} in {took:?}");
        assert!(
            report.errors.is_empty(),
            "heal {k} failed beside the other: {:?}",
            report.errors
        );
    }
    assert!(index_empty(&healer), "marks remain after both heals");
    for f in 0..FILES {
        assert!(
            bricks[2].file(&format!("img{f}")) == data,
            "replica 2's img{f} differs after heal"
        );
    }
}
