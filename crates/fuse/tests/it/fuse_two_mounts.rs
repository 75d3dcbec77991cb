//! The general mount's consistency rule, with two mounts of one brick (two clients), as the
//! README states it: close-to-open — what mount A wrote and closed is read whole and fresh by
//! the next open on mount B, whatever B cached before (`crates/fuse/src/fresh.rs`); a rename
//! or unlink on A is seen by B within B's attribute timeout, and long before it when the brick
//! pushes the change (`crates/fuse/src/changes.rs`).

use crate::common;

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::{content, same_bytes, Mounted};
use kiln_fuse::Mode;

/// Asserts B read `want`.
fn same(got: &[u8], want: &[u8], name: &str, what: &str) {
    same_bytes(got, want, &format!("{name}, {what}: B"));
}

fn write_and_close(p: &std::path::Path, data: &[u8]) {
    let mut f = std::fs::File::create(p).unwrap();
    f.write_all(data).unwrap();
}

#[test]
fn what_a_wrote_and_closed_b_opens_whole_and_fresh() {
    // Timeouts far beyond the test: without close-to-open, B would keep its old sizes.
    let a = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    let b = a.second(Duration::from_secs(60));
    // A small file (whole with its open) and one past --small-file-max.
    for (name, small, large) in [("small", 100, 3_000), ("large", 400_000, 900_000)] {
        let (pa, pb) = (a.path(name), b.path(name));
        write_and_close(&pa, &content(small, 1));
        same(
            &std::fs::read(&pb).unwrap(),
            &content(small, 1),
            name,
            "first read",
        );
        assert_eq!(std::fs::metadata(&pb).unwrap().len(), small as u64);

        // Grown on A: B's next open reads all of it.
        write_and_close(&pa, &content(large, 2));
        same(
            &std::fs::read(&pb).unwrap(),
            &content(large, 2),
            name,
            "grown on A",
        );
        // Rewritten in place, same size: fresh bytes.
        a_rewrites(&pa, &content(large, 3));
        same(
            &std::fs::read(&pb).unwrap(),
            &content(large, 3),
            name,
            "rewritten on A",
        );

        // Truncated on A: no stale tail on B.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&pa)
            .unwrap()
            .set_len(small as u64 / 2)
            .unwrap();
        same(
            &std::fs::read(&pb).unwrap(),
            &content(large, 3)[..small / 2],
            name,
            "truncated on A",
        );
    }
}

fn a_rewrites(p: &std::path::Path, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(data, 0).unwrap();
}

/// Polls (not sleeps) until `done`, failing after `bound`.
fn within(bound: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(
            t.elapsed() < bound,
            "{what}: not seen after {:?}",
            t.elapsed()
        );
        std::thread::yield_now();
    }
}

/// A file's permission bits.
fn mode(p: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// A chmods `on_a` to 0600 and B sees it at `on_b` within 5 s (far below the mounts' 60 s
/// timeouts). Pushes from one brick are applied in order: once B sees this, every change A
/// made before it has reached B too.
fn chmod_seen(on_a: &std::path::Path, on_b: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(on_a, std::fs::Permissions::from_mode(0o600)).unwrap();
    within(Duration::from_secs(5), "chmod", || mode(on_b) == 0o600);
}

#[test]
fn changes_on_a_are_pushed_to_b_long_before_its_timeout() {
    // B trusts names and attributes for a minute: only the brick's pushes can tell it sooner.
    let ttl = Duration::from_secs(60);
    let bound = Duration::from_secs(5);
    let a = Mounted::with_options(Mode::General, true, ttl);
    let b = a.second(ttl);
    write_and_close(&a.path("old"), b"x");
    write_and_close(&a.path("gone"), b"y");
    write_and_close(&a.path("mode"), b"z");
    std::fs::create_dir(a.path("d")).unwrap();
    write_and_close(&a.path("d/grow"), b"1");
    // B looks them up, and caches the entries and attributes.
    assert!(b.path("old").exists() && b.path("gone").exists());
    assert!(!b.path("new").exists());
    assert_ne!(mode(&a.path("mode")), 0o600);
    assert_eq!(mode(&b.path("mode")), mode(&a.path("mode")));
    assert_eq!(std::fs::metadata(b.path("d/grow")).unwrap().len(), 1);

    std::fs::rename(a.path("old"), a.path("new")).unwrap();
    within(bound, "rename", || {
        !b.path("old").exists() && b.path("new").exists()
    });
    assert_eq!(std::fs::read(b.path("new")).unwrap(), b"x");
    std::fs::remove_file(a.path("gone")).unwrap();
    within(bound, "unlink", || !b.path("gone").exists());
    chmod_seen(&a.path("mode"), &b.path("mode"));
    // A write through an open handle (no name involved), seen by B's stat.
    a_rewrites(&a.path("d/grow"), b"12345");
    within(bound, "write", || {
        std::fs::metadata(b.path("d/grow")).unwrap().len() == 5
    });
}

#[test]
fn a_rename_or_unlink_on_a_is_seen_by_b_within_its_timeout() {
    let bound = Duration::from_secs(1);
    let a = Mounted::with_options(Mode::General, true, bound);
    let b = a.second(bound);
    write_and_close(&a.path("old"), b"x");
    write_and_close(&a.path("gone"), b"y");
    // B looks them up (and caches the entries).
    assert!(b.path("old").exists() && b.path("gone").exists());
    assert!(!b.path("new").exists());

    let t = Instant::now();
    std::fs::rename(a.path("old"), a.path("new")).unwrap();
    std::fs::remove_file(a.path("gone")).unwrap();
    // Polled, not slept on: it must happen, and within the bound (plus scheduling slack).
    while b.path("old").exists() || b.path("gone").exists() || !b.path("new").exists() {
        assert!(
            t.elapsed() < bound + Duration::from_secs(2),
            "B still sees the old names after {:?}",
            t.elapsed()
        );
        std::thread::yield_now();
    }
    assert_eq!(std::fs::read(b.path("new")).unwrap(), b"x");
}

/// Names in `dir`, sorted.
fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn listings_fetched_ahead_never_hide_a_change() {
    // Listings of subdirectories are fetched ahead of a walk (crates/fuse/src/ahead.rs) and
    // trusted for the attribute timeout: a minute here, so only spoiling keeps them honest.
    let ttl = Duration::from_secs(60);
    let a = Mounted::with_options(Mode::General, true, ttl);
    let b = a.second(ttl);
    for d in ["top", "top/s1", "top/s2", "top/s3"] {
        std::fs::create_dir(a.path(d)).unwrap();
    }
    write_and_close(&a.path("top/s1/f"), b"1");
    write_and_close(&a.path("marker"), b"m");
    assert_ne!(mode(&b.path("marker")), 0o600);

    // B lists top: s1..s3 are fetched ahead. A then changes s1 and s2, and chmods the marker
    // after: once B sees the chmod, the earlier pushes have been applied too (one brick, one
    // connection, applied in order).
    assert_eq!(names(&b.path("top")), ["s1", "s2", "s3"]);
    write_and_close(&a.path("top/s1/new"), b"n");
    std::fs::remove_file(a.path("top/s1/f")).unwrap();
    std::fs::rename(a.path("top/s2"), a.path("top/s2b")).unwrap();
    chmod_seen(&a.path("marker"), &b.path("marker"));
    assert_eq!(names(&b.path("top/s1")), ["new"], "A's create and unlink");
    assert_eq!(names(&b.path("top")), ["s1", "s2b", "s3"], "A's rename");

    // Changes through B itself: s3 was fetched ahead again by the listing just above.
    write_and_close(&b.path("top/s3/mine"), b"b");
    assert_eq!(names(&b.path("top/s3")), ["mine"], "B's own create");
    assert_eq!(std::fs::metadata(b.path("top/s3/mine")).unwrap().len(), 1);
    assert_eq!(names(&b.path("top")), ["s1", "s2b", "s3"]);
    write_and_close(&b.path("top/s3/mine"), b"longer");
    let listed = std::fs::read_dir(b.path("top/s3"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .collect::<Vec<_>>();
    assert_eq!(listed, [6], "B's own write, as the listing gives it");
}

#[test]
fn names_absent_from_a_directory_made_here_need_no_brick_until_another_client_adds_one() {
    let ttl = Duration::from_secs(60);
    let a = Mounted::with_options(Mode::General, true, ttl);
    let b = a.second(ttl);
    std::fs::create_dir(a.path("k")).unwrap();
    write_and_close(&a.path("k/mine"), b"a");
    // The create made the kernel forget k's attributes: fetched once here (a lookup too).
    assert!(a.path("k").is_dir());
    let lookups = a.stats.calls(kiln_proto::Op::Lookup);
    for i in 0..20 {
        assert!(!a.path(&format!("k/x{i}")).exists());
    }
    assert_eq!(
        a.stats.calls(kiln_proto::Op::Lookup),
        lookups,
        "20 absent names in a directory A made: no lookup on the brick"
    );
    assert_eq!(std::fs::read(a.path("k/mine")).unwrap(), b"a");
    // Another client's file in it: pushed, so A asks the brick again and finds it.
    write_and_close(&b.path("k/theirs"), b"b");
    within(Duration::from_secs(5), "B's create", || {
        a.path("k/theirs").exists()
    });
    assert_eq!(std::fs::read(a.path("k/theirs")).unwrap(), b"b");
}

#[test]
fn small_files_fetched_ahead_never_hide_a_change() {
    // Opening a small file fetches the next ones of its directory ahead
    // (crates/fuse/src/smalls.rs), trusted for a minute here: only spoiling keeps them fresh.
    let ttl = Duration::from_secs(60);
    let a = Mounted::with_options(Mode::General, true, ttl);
    let b = a.second(ttl);
    std::fs::create_dir(a.path("d")).unwrap();
    for i in 0..6 {
        write_and_close(&a.path(&format!("d/f{i}")), format!("old{i}").as_bytes());
    }
    write_and_close(&a.path("marker"), b"m");
    assert_ne!(mode(&b.path("marker")), 0o600);
    // B lists d and reads f0: f1.. are fetched ahead.
    assert_eq!(names(&b.path("d")).len(), 6);
    assert_eq!(std::fs::read(b.path("d/f0")).unwrap(), b"old0");
    assert_eq!(std::fs::read(b.path("d/f1")).unwrap(), b"old1");
    // A rewrites f2 (same length), grows f3, removes f4; then the marker, which B waits for.
    write_and_close(&a.path("d/f2"), b"new2");
    write_and_close(&a.path("d/f3"), b"newer3");
    std::fs::remove_file(a.path("d/f4")).unwrap();
    chmod_seen(&a.path("marker"), &b.path("marker"));
    assert_eq!(
        std::fs::read(b.path("d/f2")).unwrap(),
        b"new2",
        "rewritten by A"
    );
    assert_eq!(
        std::fs::read(b.path("d/f3")).unwrap(),
        b"newer3",
        "grown by A"
    );
    assert!(std::fs::read(b.path("d/f4")).is_err(), "removed by A");
    // B's own write to a file fetched ahead (f5, by the reads above).
    write_and_close(&b.path("d/f5"), b"mine5");
    assert_eq!(std::fs::read(b.path("d/f5")).unwrap(), b"mine5");
}

#[test]
fn a_fifo_renamed_over_a_listed_small_file_is_not_fetched_ahead() {
    let ttl = Duration::from_secs(60);
    let a = Mounted::with_options(Mode::General, true, ttl);
    let b = a.second(ttl);
    std::fs::create_dir(a.path("d")).unwrap();
    for i in 0..6 {
        write_and_close(&a.path(&format!("d/f{i}")), format!("old{i}").as_bytes());
    }
    write_and_close(&a.path("marker"), b"m");
    assert_ne!(mode(&b.path("marker")), 0o600);
    // B lists d: its small files are what a walk from the first would fetch ahead.
    let listed: Vec<String> = std::fs::read_dir(b.path("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let (first, last) = (&listed[0], &listed[listed.len() - 1]);
    // A renames a FIFO over each file between the first and last B listed.
    for (i, name) in listed[1..listed.len() - 1].iter().enumerate() {
        let fifo = a.path(&format!("fifo{i}"));
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
        std::fs::rename(&fifo, a.path(&format!("d/{name}"))).unwrap();
    }
    chmod_seen(&a.path("marker"), &b.path("marker"));
    // B reads the first and the last file: the brick opens those two and no FIFO (the pushes
    // made B forget the listing, so nothing is fetched ahead as the files they were).
    let opens = a.stats.calls(kiln_proto::Op::Open);
    let fetched = b
        .counters
        .fetched_ahead
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(std::fs::read(b.path(&format!("d/{first}")))
        .unwrap()
        .starts_with(b"old"));
    assert!(std::fs::read(b.path(&format!("d/{last}")))
        .unwrap()
        .starts_with(b"old"));
    assert_eq!(
        a.stats.calls(kiln_proto::Op::Open) - opens,
        2,
        "opens on the brick"
    );
    assert_eq!(
        b.counters
            .fetched_ahead
            .load(std::sync::atomic::Ordering::Relaxed),
        fetched,
        "nothing fetched ahead from the listing the FIFOs changed"
    );
}
