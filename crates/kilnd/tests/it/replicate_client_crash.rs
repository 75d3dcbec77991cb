//! A client killed mid-write (SIGKILL, so it marks nothing) over a replica-3 volume of real
//! kilnd processes: its writes in flight reached some replicas and not others. Each brick
//! records what the dead connection wrote lately as suspect; readers then read the one
//! replica heal will copy from, and heal makes the others like it. Every run checks that a
//! read between the crash and the heal equals the read after it, and that afterwards the three
//! bricks hold the same names with the same bytes.
//!
//! The writer is this test binary run again ([`crash_writer`], ignored unless asked for):
//! four threads writing 4 KiB to 1 MiB at random offsets of one file (some past its end, so
//! sizes can differ too) and now and then creating a small file, until it is killed.
//! Runs are seeded: `KILN_SEED=N` repeats one, `KILN_RUNS=N` sets how many.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use kiln_layer::marks as m;
use kiln_layer::Ctx;

use crate::replica;
use replica::{index_empty, seeds, volfile, volfile_at, wait_for, Brick, Rng, CI_RUNS};

const FILE: &str = "image.raw";
const SIZE: u64 = 8 << 20;
/// Writes reach this far past the file's first size.
const GROW: u64 = 2 << 20;
const WRITERS: u64 = 4;
const ENV: &str = "KILN_CRASH_WRITER";

#[test]
#[ignore = "the writer that replicas_agree_after_the_writing_client_is_killed kills; it runs it"]
fn crash_writer() {
    let Ok(spec) = std::env::var(ENV) else {
        return;
    };
    let (seed, addrs) = spec.split_once(';').expect("seed;addresses");
    let seed: u64 = seed.parse().expect("seed");
    let addrs: Vec<String> = addrs.split(',').map(str::to_owned).collect();
    let vol = Arc::new(Volume::from_volfile(&volfile_at(&addrs)).expect("connect"));
    let fd = block_on(vol.open(FILE, libc::O_RDWR)).expect("open");
    let threads: Vec<_> = (0..WRITERS)
        .map(|t| {
            let (vol, fd) = (vol.clone(), fd.clone());
            let mut rng = Rng((seed ^ (t + 1).wrapping_mul(0x9e37_79b9)) | 1);
            std::thread::spawn(move || {
                for n in 0u64.. {
                    let r = rng.next();
                    let fill = rng.next();
                    let data = |len: usize| -> Vec<u8> {
                        (0..len)
                            .map(|i| (fill.wrapping_add(i as u64 * 131) >> 5) as u8)
                            .collect()
                    };
                    if r.is_multiple_of(16) {
                        let name = format!("small-{t}-{n}");
                        let flags = libc::O_CREAT | libc::O_RDWR;
                        let (f, _) = block_on(vol.create(&name, flags, 0o644)).expect("create");
                        let len = 4096 * (1 + (r >> 8) % 16) as usize;
                        let (w, _) = block_on(vol.pwritev(&f, vec![data(len)], 0));
                        w.expect("small write");
                        let _ = block_on(vol.close(f));
                    } else {
                        let off = (r >> 4) % (SIZE + GROW) / 512 * 512;
                        let len = 4096 << ((r >> 40) % 9); // 4 KiB to 1 MiB
                        let (w, _) = block_on(vol.pwritev(&fd, vec![data(len)], off));
                        w.expect("write");
                    }
                    if t == 0 && n == 8 {
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "writing");
                        let _ = out.flush();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}

/// Every regular file beneath `dir` but the brick's own `.kiln`, by path, with its bytes.
fn tree(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
            if rel == ".kiln" {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                todo.push(p);
            } else {
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// The whole file, through a fresh client (it opens the file anew, so it sees the marks).
fn read_all(bricks: &[Brick]) -> Vec<u8> {
    let vol = Volume::from_volfile(&volfile(bricks)).expect("reader connects");
    let size = block_on(vol.lookup(FILE)).expect("lookup").size;
    let fd = block_on(vol.open(FILE, libc::O_RDONLY)).expect("open");
    let mut all = Vec::with_capacity(size as usize);
    while (all.len() as u64) < size {
        let want = (size - all.len() as u64).min(1 << 20) as usize;
        let (r, mut back) = block_on(vol.preadv(&fd, vec![vec![0u8; want]], all.len() as u64));
        let n = r.expect("read");
        assert!(n > 0, "read stopped at {} of {size}", all.len());
        back[0].truncate(n);
        all.extend_from_slice(&back[0]);
    }
    let _ = block_on(vol.close(fd));
    all
}

/// Whether every brick lists suspect marks for `path`.
fn all_suspect(vol: &Volume, path: &str) -> bool {
    let rep = heal::replicate_layers(vol.top()).remove(0);
    rep.children().iter().all(|k| {
        block_on(k.pending_index(&Ctx::NONE, "", &())).is_ok_and(|p| {
            p.entries
                .0
                .iter()
                .any(|e| e.path == path && e.target == m::ANY)
        })
    })
}

fn crash_run(seed: u64) {
    let root = tempfile::tempdir().unwrap();
    let bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let vol = Volume::from_volfile(&volfile(&bricks)).expect("connect");
    let (fd, _) = block_on(vol.create(FILE, libc::O_RDWR | libc::O_CREAT, 0o644)).expect("create");
    let size = kiln_layer::SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: SIZE,
        ..Default::default()
    };
    block_on(vol.fsetattr(&fd, size)).expect("size the file");
    block_on(vol.close(fd)).expect("close");

    let addrs: Vec<String> = bricks.iter().map(|b| b.addr.clone()).collect();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "replicate_client_crash::crash_writer",
            "--nocapture",
        ])
        .env(ENV, format!("{seed};{}", addrs.join(",")))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the writer");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "writing" {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "seed {seed}: the writer ended before it wrote"
        );
    }
    // The crash comes at a seeded moment of the stream (not a wait for anything).
    let mut rng = Rng(seed | 1);
    std::thread::sleep(Duration::from_millis(5 + rng.next() % 150));
    child.kill().unwrap(); // SIGKILL: nothing marked, nothing released
    child.wait().unwrap();

    wait_for(
        &format!("every brick to record the dead writer's writes as suspect (seed {seed})"),
        20,
        || all_suspect(&vol, FILE),
    );
    let info = block_on(heal::info(vol.top()));
    assert!(
        info.iter()
            .any(|n| n.path == FILE && n.suspect && n.target_up),
        "seed {seed}: heal info does not list {FILE} as suspect: {info:?}"
    );
    let before = read_all(&bricks);

    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer connects");
    let mut report = heal::Report::default();
    for _ in 0..4 {
        if index_empty(&healer) {
            break;
        }
        let r = block_on(heal::run(healer.top(), &|_, _| {}));
        assert!(
            r.errors.is_empty(),
            "seed {seed}: heal errors {:?}",
            r.errors
        );
        report.suspects += r.suspects;
        report.files += r.files;
        report.bytes += r.bytes;
    }
    assert!(index_empty(&healer), "seed {seed}: marks remain after heal");
    replica::sums_clean(&bricks, seed);
    assert!(report.suspects > 0, "seed {seed}: no suspect file resolved");

    let trees: Vec<_> = bricks.iter().map(|b| tree(&b.dir)).collect();
    for (i, t) in trees.iter().enumerate().skip(1) {
        let names = |t: &std::collections::BTreeMap<String, Vec<u8>>| -> Vec<String> {
            t.keys().cloned().collect()
        };
        assert_eq!(
            names(t),
            names(&trees[0]),
            "seed {seed}: brick {i}'s names differ"
        );
        for (p, bytes) in t {
            if let Some(at) = bytes.iter().zip(&trees[0][p]).position(|(a, b)| a != b) {
                panic!("seed {seed}: {p} differs on brick {i} from brick 0 at byte {at}");
            }
            assert_eq!(
                bytes.len(),
                trees[0][p].len(),
                "seed {seed}: {p}'s size differs on brick {i}"
            );
        }
    }
    let after = read_all(&bricks);
    assert!(
        before == after,
        "seed {seed}: a read before heal ({} B) differs from the read after it ({} B)",
        before.len(),
        after.len()
    );
    assert!(
        after == trees[0][FILE],
        "seed {seed}: the volume's read differs from the bricks'"
    );
    eprintln!(
        "seed {seed}: {} suspect file(s) resolved, heal copied {} B to {} file(s); {} names",
        report.suspects,
        report.bytes,
        report.files,
        trees[0].len()
    );
}

#[test]
fn replicas_agree_after_the_writing_client_is_killed_seeded_runs() {
    for (run, seed) in seeds(CI_RUNS).iter().enumerate() {
        eprintln!("run {run}: seed {seed}");
        crash_run(*seed);
    }
}
