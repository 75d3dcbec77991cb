//! Small files opened read-only in general mode come whole with the open
//! (`crates/fuse/src/files.rs`): one OPEN on the brick and no READ or RELEASE; bigger files are
//! opened and read as before; a write through the mount makes a whole-file handle read the
//! brick again; and closing a file sends the brick nothing. A small file opened when no other
//! handle of it is open is in the kernel's page cache when the open returns, so its reads do
//! not reach the mount either — and what is put there is the file as the open found it.

use crate::common;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{content, same_bytes, Mounted};
use kiln_fuse::Mode;
use kiln_proto::sync::RwLockExt as _;
use kiln_proto::Op;

/// The kernel's caches are shared by every mount: a test that drops them
/// (`/proc/sys/vm/drop_caches`) would drop the pages and names the others' mounts were
/// given. The others share this lock; the one that drops takes it alone.
static CACHES: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn caches_kept() -> std::sync::RwLockReadGuard<'static, ()> {
    CACHES.read_locked()
}

fn counts(m: &Mounted) -> [u64; 3] {
    [Op::Open, Op::Read, Op::Release].map(|op| m.stats.calls(op))
}

/// Waits (bounded) until the brick has seen `n` releases: the kernel sends RELEASE after
/// `close` returns.
fn releases_reach(m: &Mounted, n: u64) {
    let end = Instant::now() + Duration::from_secs(10);
    while m.stats.calls(Op::Release) < n {
        assert!(Instant::now() < end, "no release reached the brick");
        std::thread::yield_now();
    }
}

#[test]
fn a_small_file_is_read_with_its_open() {
    let _caches = caches_kept();
    let m = Mounted::new(Mode::General);
    let small: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 13) as u8).collect();
    std::fs::write(m.path("small"), &small).unwrap();
    std::fs::write(m.path("big"), &big).unwrap();
    std::fs::write(m.path("empty"), b"").unwrap();
    releases_reach(&m, 3);

    let [open0, read0, rel0] = counts(&m);
    // Opening drops the kernel's cached pages (no keep-cache), so the data comes from the mount.
    assert_eq!(std::fs::read(m.path("small")).unwrap(), small);
    assert_eq!(std::fs::read(m.path("empty")).unwrap(), b"");
    let [open1, read1, _] = counts(&m);
    assert_eq!(open1, open0 + 2, "one OPEN each");
    assert_eq!(read1, read0, "no READ: the content came with the open");

    assert_eq!(std::fs::read(m.path("big")).unwrap(), big);
    let [open2, read2, _] = counts(&m);
    assert_eq!(open2, open1 + 1);
    assert!(
        read2 > read1,
        "a file over the limit is read from the brick"
    );
    // Only the big file had anything open on the brick.
    releases_reach(&m, rel0 + 1);
    let [_, _, rel2] = counts(&m);
    assert_eq!(rel2, rel0 + 1, "small files leave nothing to release");
}

#[test]
fn a_write_through_the_mount_reaches_a_whole_file_handle() {
    let _caches = caches_kept();
    let m = Mounted::new(Mode::General);
    std::fs::write(m.path("f"), b"old content").unwrap();
    // O_DIRECT so that every read reaches the mount, not the kernel's page cache.
    let reader = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("f"))
        .unwrap();
    let mut buf = [0u8; 64];
    let reads = m.stats.calls(Op::Read);
    let n = reader.read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf[..n], b"old content");
    assert_eq!(
        m.stats.calls(Op::Read),
        reads,
        "served from the open's content"
    );

    let writer = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("f"))
        .unwrap();
    writer.write_all_at(b"NEW", 0).unwrap();
    let n = reader.read_at(&mut buf, 0).unwrap();
    assert_eq!(
        &buf[..n],
        b"NEW content",
        "the reader sees this mount's write"
    );
    assert!(
        m.stats.calls(Op::Read) > reads,
        "read from the brick once stale"
    );
}

#[test]
fn the_limit_can_be_turned_off() {
    let _caches = caches_kept();
    let m = Mounted::with_small_file_max(0);
    std::fs::write(m.path("f"), b"tiny").unwrap();
    let reads = m.stats.calls(Op::Read);
    assert_eq!(std::fs::read(m.path("f")).unwrap(), b"tiny");
    assert!(m.stats.calls(Op::Read) > reads, "read from the brick");
}

#[test]
fn an_open_small_file_outlives_its_name() {
    let _caches = caches_kept();
    // No attribute caching: every fstat reaches the mount.
    let m = Mounted::with_options(Mode::General, true, Duration::ZERO);
    std::fs::write(m.path("f"), b"still here").unwrap();
    std::fs::write(m.path("g"), b"replaced").unwrap();
    let f = std::fs::File::open(m.path("f")).unwrap();
    let g = std::fs::File::open(m.path("g")).unwrap();
    std::fs::remove_file(m.path("f")).unwrap();
    std::fs::write(m.path("h"), b"a newer one").unwrap();
    std::fs::rename(m.path("h"), m.path("g")).unwrap();
    assert_eq!(f.metadata().expect("fstat after unlink").len(), 10);
    assert_eq!(g.metadata().expect("fstat after rename over it").len(), 8);
    let mut buf = [0u8; 32];
    let n = f.read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf[..n], b"still here");
    let n = g.read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf[..n], b"replaced");
}

/// Another writer straight on the brick: `name` rewritten in place, its block checksums
/// sealed anew as the brick's own writes would leave them (without that, the brick would take
/// the new bytes for a damaged copy).
fn overwrite_on_brick(m: &Mounted, name: &str, data: &[u8]) {
    std::fs::write(m.brick().join(name), data).unwrap();
    kiln_server::posix::sums::rebuild_at(&m.brick(), name).unwrap();
}

/// The file at `p` reads back as `want`.
fn same(p: std::path::PathBuf, want: &[u8], what: &str) {
    same_bytes(&std::fs::read(&p).unwrap(), want, what);
}

/// READs the kernel sent the mount, and small files it stored in the page cache.
fn mount_counts(m: &Mounted) -> (u64, u64) {
    let c = &m.counters;
    (
        c.reads.load(Ordering::Relaxed),
        c.stored.load(Ordering::Relaxed),
    )
}

#[test]
fn a_small_file_opened_alone_is_read_from_the_page_cache_as_the_open_found_it() {
    let _caches = caches_kept();
    // Attributes cached longer than the test: the kernel asks for a size only when the mount
    // tells it to forget the one it has.
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    let first = content(20_000, 1);
    std::fs::write(m.path("f"), &first).unwrap();
    // The kernel's size came from its own writes, not from the mount: this open has the kernel
    // ask for it again, and is not stored.
    let (_, stored) = mount_counts(&m);
    same(m.path("f"), &first, "the content");
    assert_eq!(
        mount_counts(&m).1,
        stored,
        "not stored before the size is known"
    );

    let (reads, stored) = mount_counts(&m);
    same(m.path("f"), &first, "the content");
    assert_eq!(
        mount_counts(&m),
        (reads, stored + 1),
        "stored with the open; no READ"
    );

    // Another writer, straight on the brick (no push): same size, other bytes. The next open
    // brings them, and the store overwrites the pages an earlier open left cached.
    let second = content(20_000, 2);
    overwrite_on_brick(&m, "f", &second);
    same(m.path("f"), &second, "what the open found");
    assert_eq!(mount_counts(&m), (reads, stored + 2));

    // Shrunk on the brick: the kernel's size is larger than the file now, so nothing is stored
    // (a store cannot shrink it) and the read asks the mount: no old bytes past the new end.
    let third = content(5_000, 3);
    overwrite_on_brick(&m, "f", &third);
    same(m.path("f"), &third, "the content");
    let (reads_now, stored_now) = mount_counts(&m);
    assert_eq!(stored_now, stored + 2, "not stored over a larger size");
    assert!(reads_now > reads, "read through the mount");
}

#[test]
fn a_small_file_open_elsewhere_in_the_mount_is_not_stored() {
    let _caches = caches_kept();
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    let old = content(8_000, 4);
    std::fs::write(m.path("f"), &old).unwrap();
    same(m.path("f"), &old, "the size is known after this");

    // A writer holds the file open: a store could overwrite what it writes.
    let writer = OpenOptions::new().write(true).open(m.path("f")).unwrap();
    let (_, stored) = mount_counts(&m);
    same(m.path("f"), &old, "the content");
    assert_eq!(
        mount_counts(&m).1,
        stored,
        "not stored while another handle is open"
    );

    let new = content(8_000, 5);
    writer.write_all_at(&new, 0).unwrap();
    same(m.path("f"), &new, "the writer's bytes");
    drop(writer);
    same(m.path("f"), &new, "and after its close");
}

/// Waits (bounded) until `n` files fetched ahead are ready for their opens: the fetches run
/// in the background.
fn ahead_ready(m: &Mounted, n: u64) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let ready = m.counters.ahead_ready.load(Ordering::Relaxed);
        if ready >= n {
            return;
        }
        assert!(
            Instant::now() < end,
            "{ready} of {n} fetched ahead are ready"
        );
        std::thread::yield_now();
    }
}

/// The files of `dir` in a depth-first walk in listing order, as `find` makes it: each
/// directory listed whole when the walk reaches it, a subdirectory's files at its place.
fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .collect();
    for e in entries {
        if e.file_type().unwrap().is_dir() {
            walk(&e.path(), out);
        } else {
            out.push(e.path());
        }
    }
}

#[test]
fn the_files_a_walk_reaches_next_are_fetched_ahead_across_directories() {
    let _caches = caches_kept();
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    // Made on the brick itself: nothing of them is known to the mount before the walk.
    let top = m.brick().join("top");
    std::fs::create_dir_all(top.join("sub").join("deeper")).unwrap();
    for (i, d) in ["", "sub", "sub/deeper"].iter().enumerate() {
        for f in 0..3 {
            std::fs::write(top.join(d).join(format!("f{f}")), content(100 + f, i as u8)).unwrap();
        }
    }
    // The walk lists every directory before reading any file (as `find | xargs cat` does).
    let mut files = Vec::new();
    walk(&m.path("top"), &mut files);
    assert_eq!(files.len(), 9);
    // Pages are stored ahead only into an inode whose size the kernel holds. A listing tells
    // the kernel the entries' attributes only when it chose READDIRPLUS for it (it adapts to
    // what the reader does next); once in CI, 7 of the 8 were stored. A stat of each, as
    // `find -size` or `du` makes, leaves that out of the test.
    for f in &files {
        std::fs::metadata(f).unwrap();
    }

    let opens = m.stats.calls(Op::Open);
    std::fs::read(&files[0]).unwrap();
    // That open fetched every other file of the walk ahead, in and below its directory
    // (bounded wait: the fetches run in the background).
    let end = Instant::now() + Duration::from_secs(10);
    while m.stats.calls(Op::Open) < opens + 9 {
        assert!(
            Instant::now() < end,
            "{} of the 8 next files fetched ahead",
            m.stats.calls(Op::Open) - opens - 1
        );
        std::thread::yield_now();
    }
    // Each is ready for its open (bounded wait: after the brick's reply), and was put into the
    // page cache as it came.
    ahead_ready(&m, 8);
    assert_eq!(m.counters.stored_ahead.load(Ordering::Relaxed), 8);
    let hits = m.counters.fetched_ahead.load(Ordering::Relaxed);
    let (reads, kept) = (
        m.counters.reads.load(Ordering::Relaxed),
        m.counters.kept_ahead.load(Ordering::Relaxed),
    );
    for f in &files[1..] {
        // As made above: `f{n}` holds 100 + n bytes, of the pattern of its directory's depth.
        let n: usize = f.file_name().unwrap().to_str().unwrap()[1..]
            .parse()
            .unwrap();
        let depth = f.strip_prefix(m.path("top")).unwrap().components().count() - 1;
        let want = content(100 + n, depth as u8);
        same_bytes(&std::fs::read(f).unwrap(), &want, "a file fetched ahead");
    }
    assert_eq!(
        m.counters.fetched_ahead.load(Ordering::Relaxed),
        hits + 8,
        "every later open found its file fetched"
    );
    assert_eq!(
        m.counters.kept_ahead.load(Ordering::Relaxed),
        kept + 8,
        "and kept the pages stored ahead"
    );
    assert_eq!(
        m.counters.reads.load(Ordering::Relaxed),
        reads,
        "which the reads found: none reached the mount"
    );
    assert_eq!(
        m.stats.calls(Op::Open),
        opens + 9,
        "and asked the brick nothing"
    );
}

/// A name the kernel forgot (its entry timed out, or memory was reclaimed) is looked up again
/// when a reader opens it. When the file was fetched ahead, its attributes came with it, and
/// the lookup asks the brick nothing — unless the file has other names, through which a
/// change would not have spoiled what was fetched.
#[test]
fn a_name_looked_up_again_is_answered_from_what_was_fetched_ahead() {
    let _alone = CACHES.write_locked();
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    let dir = m.brick().join("d");
    std::fs::create_dir(&dir).unwrap();
    for f in 0..5 {
        std::fs::write(dir.join(format!("f{f}")), content(200 + f, 3)).unwrap();
    }
    std::fs::hard_link(dir.join("f4"), m.brick().join("f4-too")).unwrap();
    // Held open: the directory's own entry stays while the kernel drops its files'.
    let _held = std::fs::File::open(m.path("d")).unwrap();
    let mut files = Vec::new();
    walk(&m.path("d"), &mut files);
    std::fs::read(&files[0]).unwrap();
    ahead_ready(&m, 4);
    // The kernel forgets the names the listing told it of.
    std::fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
    let lookups = m.stats.calls(Op::Lookup);
    let ahead = m.counters.looked_up_ahead.load(Ordering::Relaxed);
    let size = |f: &std::path::Path| {
        let n: usize = f.file_name().unwrap().to_str().unwrap()[1..]
            .parse()
            .unwrap();
        200 + n
    };
    let plain = files[1..].iter().find(|f| !f.ends_with("f4")).unwrap();
    assert_eq!(std::fs::metadata(plain).unwrap().len(), size(plain) as u64);
    // The kernel may ask for the attributes once more right after the lookup (when some
    // inode was evicted while the lookup was on its way): answered from the fetch too.
    let answered = m.counters.looked_up_ahead.load(Ordering::Relaxed) - ahead;
    assert!(
        (1..=2).contains(&answered),
        "the kernel looked the name up, and was answered from the fetch ({answered} answers)"
    );
    assert_eq!(
        m.stats.calls(Op::Lookup),
        lookups,
        "the brick was asked nothing"
    );
    same_bytes(
        &std::fs::read(plain).unwrap(),
        &content(size(plain), 3),
        "the file fetched ahead",
    );

    let linked = files.iter().find(|f| f.ends_with("f4")).unwrap();
    if linked != &files[0] {
        let ahead = m.counters.looked_up_ahead.load(Ordering::Relaxed);
        assert_eq!(std::fs::metadata(linked).unwrap().nlink(), 2);
        assert_eq!(
            m.counters.looked_up_ahead.load(Ordering::Relaxed),
            ahead,
            "a file with two names is looked up on the brick"
        );
        // Its lookup, and perhaps a getattr right after it (as above).
        let asked = m.stats.calls(Op::Lookup) - lookups;
        assert!((1..=2).contains(&asked), "{asked} brick lookups");
    }
}

/// A walk through many small directories (`/usr/share/doc`: a few files each) goes on from
/// the last file of one directory into the next directory of its parent: the first file of
/// each is fetched ahead too, not only the files after it in its own directory.
#[test]
fn a_walk_goes_on_into_the_next_directory_of_the_parent() {
    let _caches = caches_kept();
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    let top = m.brick().join("top");
    for d in ["a", "b", "c"] {
        std::fs::create_dir_all(top.join(d)).unwrap();
        for f in 0..2 {
            std::fs::write(top.join(d).join(format!("f{f}")), content(300 + f, 5)).unwrap();
        }
    }
    let mut files = Vec::new();
    walk(&m.path("top"), &mut files);
    assert_eq!(files.len(), 6);

    let opens = m.stats.calls(Op::Open);
    std::fs::read(&files[0]).unwrap();
    // The five files after it, in its directory and in the two after it, were fetched ahead
    // (bounded wait: the fetches run in the background).
    ahead_ready(&m, 5);
    for f in &files[1..] {
        let n: usize = f.file_name().unwrap().to_str().unwrap()[1..]
            .parse()
            .unwrap();
        same_bytes(
            &std::fs::read(f).unwrap(),
            &content(300 + n, 5),
            "fetched ahead",
        );
    }
    assert_eq!(
        m.stats.calls(Op::Open),
        opens + 6,
        "every open after the first found its file fetched ahead"
    );
}
