//! A listing gives the kernel every entry with its attributes (READDIRPLUS on every page, not
//! the kernel's choice), so the names of a big directory need no brick LOOKUP when they are
//! used after it; and a listing costs no brick lookup of the directory itself (the kernel
//! takes nothing from the "." and ".." entries but their type).

use crate::common;

use std::time::Duration;

use common::Mounted;
use kiln_fuse::Mode;
use kiln_proto::Op;

#[test]
fn the_names_of_a_big_listing_need_no_lookups_after_it() {
    // Attributes and names cached far longer than the test.
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    // Made on the brick itself, so the kernel has none of the names before the listing.
    let dir = m.brick().join("big");
    std::fs::create_dir(&dir).unwrap();
    for i in 0..3000 {
        std::fs::write(dir.join(format!("file-with-a-longish-name-{i:05}")), b"x").unwrap();
    }

    // The kernel knows the directory itself from here on.
    assert!(std::fs::metadata(m.path("big")).unwrap().is_dir());

    let before = m.stats.calls(Op::Lookup);
    let names: Vec<_> = std::fs::read_dir(m.path("big"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 3000);
    let listed = m.stats.calls(Op::Lookup);
    assert_eq!(listed, before, "listing looked nothing up on the brick");

    for name in &names {
        let md = std::fs::metadata(m.path("big").join(name)).unwrap();
        assert_eq!(md.len(), 1);
    }
    assert_eq!(
        m.stats.calls(Op::Lookup),
        listed,
        "every name and its attributes came with the listing, the last pages' too"
    );
}

/// A walk by name (`ls -R`, `rsync`) through subdirectories the brick lists in another order
/// finds each one fetched ahead or on its way: every directory is listed on the brick once.
/// Fetching all of a directory's subdirectories in listing order as soon as it was opened
/// listed many twice: a walk that got to one still queued or running fetched it itself.
#[test]
fn a_walk_by_name_lists_each_directory_once() {
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    let top = m.brick().join("top");
    for d in 0..40 {
        let dir = top.join(format!("d{d:02}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..200 {
            std::fs::write(dir.join(format!("f{f:03}")), b"").unwrap();
        }
    }
    let before = m.stats.calls(Op::Readdir);
    let mut subdirs: Vec<_> = std::fs::read_dir(m.path("top"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    subdirs.sort();
    for d in &subdirs {
        let n = std::fs::read_dir(m.path("top").join(d)).unwrap().count();
        assert_eq!(n, 200);
    }
    assert_eq!(
        m.stats.calls(Op::Readdir) - before,
        41,
        "the top directory and each of its 40 subdirectories listed once"
    );
}
