//! `kiln volume add-brick` online: a 1x3 volume grows to 2x3 under a mount with fio writing
//! and verifying. Running clients switch to the grown graph by themselves; files made before
//! stay readable where they are; new files land on the new replica set too (directories made
//! there as needed, with their modes and owners), on all three of its bricks alike; fio sees
//! no error.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;

use crate::common;
use common::fio::{need_fio, FioLoop};
use common::managed::Vol;
use common::{wait_for, BrickReaper};

fn content(i: usize) -> Vec<u8> {
    format!("file {i}\n").repeat(i % 50 + 1).into_bytes()
}

/// Where `rel` is, among the bricks `dirs` (by index).
fn holders(dirs: &[PathBuf], rel: &str) -> Vec<usize> {
    (0..dirs.len())
        .filter(|&i| dirs[i].join(rel).is_file())
        .collect()
}

#[test]
fn a_replica_set_added_online_takes_new_files_and_old_ones_stay_readable() {
    need_fio();
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::with_bricks(tmp.path(), "el", 3, 3, &["--brick-port-base", "25300"]);
    let log = tmp.path().join("mount.log");
    let log_s = log.display().to_string();
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let _mount = v.mount_env(
        &mnt,
        &[
            ("KILN_LOG", "warn,kiln_client::graph=info"),
            ("KILN_GRAPH_POLL_MS", "100"),
            ("KILN_TEST_STDERR", &log_s),
        ],
    );
    // A tree before: files at the top and two levels down, one directory with its own mode.
    std::fs::create_dir_all(mnt.join("d/e")).unwrap();
    std::fs::set_permissions(mnt.join("d"), std::fs::Permissions::from_mode(0o751)).unwrap();
    std::os::unix::fs::chown(mnt.join("d"), Some(1234), Some(4321)).unwrap();
    let before: Vec<String> = (0..60)
        .map(|i| match i % 3 {
            0 => format!("old{i}"),
            1 => format!("d/old{i}"),
            _ => format!("d/e/old{i}"),
        })
        .collect();
    for (i, f) in before.iter().enumerate() {
        std::fs::write(mnt.join(f), content(i)).unwrap();
    }
    let work = tmp.path().join("fio");
    let fio = FioLoop::on_mount(&mnt, &work);
    fio.one_more(120);

    let new: Vec<String> = (3..6)
        .map(|i| format!("127.0.0.1:{}", tmp.path().join(format!("b{i}")).display()))
        .collect();
    let mut args = vec!["volume", "add-brick", "el", "replica", "3"];
    args.extend(new.iter().map(String::as_str));
    v.mgmt(&args);
    let st = v.status();
    assert_eq!(st["bricks"].as_array().unwrap().len(), 6);
    assert!(v.all_online(), "the new bricks run: {st}");
    wait_for("the mount to switch to the grown graph", 30, || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("graph version")
    });

    // Old files: all there, through the mount, from where they were.
    for (i, f) in before.iter().enumerate() {
        assert_eq!(std::fs::read(mnt.join(f)).unwrap(), content(i), "{f}");
    }
    // New files: a share lands on the new set, each on all three of its bricks.
    let dirs: Vec<PathBuf> = (0..6).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let after: Vec<String> = (0..90)
        .map(|i| match i % 3 {
            0 => format!("new{i}"),
            1 => format!("d/new{i}"),
            _ => format!("d/e/new{i}"),
        })
        .collect();
    for (i, f) in after.iter().enumerate() {
        std::fs::write(mnt.join(f), content(i)).unwrap();
    }
    let mut on_new = 0;
    for (i, f) in after.iter().enumerate() {
        let h = holders(&dirs, f);
        assert!(h == [0, 1, 2] || h == [3, 4, 5], "{f} is on bricks {h:?}");
        if h == [3, 4, 5] {
            on_new += 1;
            for d in &dirs[3..] {
                assert_eq!(
                    std::fs::read(d.join(f)).unwrap(),
                    content(i),
                    "{f} on {d:?}"
                );
            }
        }
        assert_eq!(std::fs::read(mnt.join(f)).unwrap(), content(i), "{f}");
    }
    assert!(
        (20..=70).contains(&on_new),
        "{on_new} of 90 new files on the new set: the layout does not share"
    );
    // Directories made on the new bricks as needed, like their copies elsewhere.
    for d in &dirs[3..] {
        let m = std::fs::metadata(d.join("d")).unwrap();
        assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o751, 1234, 4321));
        assert!(d.join("d/e").is_dir());
    }
    // Every name is listed once.
    let mut listed: Vec<String> = std::fs::read_dir(mnt.join("d/e"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    listed.sort();
    let mut want: Vec<String> = before
        .iter()
        .chain(&after)
        .filter_map(|f| f.strip_prefix("d/e/").map(str::to_owned))
        .collect();
    want.sort();
    assert_eq!(listed, want);
    fio.one_more(120);
    let (runs, failures) = fio.finish();
    assert!(failures.is_empty(), "I/O errors: {}", failures.join("\n"));
    assert!(runs >= 2);
}
