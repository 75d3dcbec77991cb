//! A sharded 2x3 volume (real kilnd and bricks, a FUSE mount, an NBD export): an image's
//! pieces are striped over both sets; a replica that missed writes heals only the pieces it
//! missed; a third set takes its share of pieces by rebalance; removing the image removes
//! every piece.

use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::common;
use common::managed::Vol;
use common::{brick_files, kill_brick_pid, wait_for, BrickReaper};
use serde_json::Value;

const MIB: usize = 1 << 20;
const IMG: &str = "disk.img";
const PIECES: usize = 12;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i / 4096) as u8 ^ (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// The pieces (names in `.shards`) brick directory `dir` holds.
fn pieces(dir: &Path) -> BTreeSet<String> {
    brick_files(dir)
        .into_iter()
        .filter_map(|f| f.strip_prefix(".shards/").map(str::to_owned))
        .collect()
}

fn piece_no(name: &str) -> usize {
    name.rsplit('.').next().unwrap().parse().unwrap()
}

/// Every file's copies on the bricks of each set are identical.
fn copies_agree(dirs: &[PathBuf], sets: usize) {
    for s in 0..sets {
        let names = brick_files(&dirs[3 * s]);
        for r in 1..3 {
            assert_eq!(names, brick_files(&dirs[3 * s + r]), "set {s}, replica {r}");
        }
        for f in &names {
            let a = std::fs::read(dirs[3 * s].join(f)).unwrap();
            for r in 1..3 {
                let b = std::fs::read(dirs[3 * s + r].join(f)).unwrap();
                assert!(a == b, "set {s}: {f} differs on replica {r}");
            }
        }
    }
}

fn heal_paths(v: &Vol) -> Vec<String> {
    let out = v.mgmt(&["volume", "heal", &v.name, "info", "--json"]);
    let j: Value = serde_json::from_str(out.trim()).unwrap();
    j["needs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn an_image_in_pieces_over_the_sets_heals_and_rebalances_by_piece() {
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::created_with(
        tmp.path(),
        "sh",
        3,
        6,
        &["--brick-port-base", "25600"],
        &["--shard", "1M"],
    );
    let dirs: Vec<PathBuf> = (0..9).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let info = v.mgmt(&["volume", "info", "sh"]);
    assert!(info.contains("Shards: pieces of 1M"), "{info}");
    let got = v.mgmt(&["volume", "get", "sh", "shard-block-size"]);
    assert!(got.contains("1M"), "{got}");
    let mut set = vec!["volume", "set", "sh", "shard-block-size", "4M"];
    set.extend(["--server", v.kd.addr.as_str(), "--state-dir"]);
    set.push(v.state.to_str().unwrap());
    assert!(common::fails(&set).contains("chosen when the volume is created"));

    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let env = [("KILN_LOG", "warn"), ("KILN_GRAPH_POLL_MS", "100")];
    let _mount = v.mount_env(&mnt, &env);
    let mut want = pattern(1, PIECES * MIB);
    std::fs::write(mnt.join(IMG), &want).unwrap();
    assert!(std::fs::read(mnt.join(IMG)).unwrap() == want);
    assert_eq!(
        std::fs::metadata(mnt.join(IMG)).unwrap().len(),
        want.len() as u64
    );
    // Striped: pieces 1.. alternate between the sets; the base holds piece 0 only.
    let (on0, on1) = (pieces(&dirs[0]), pieces(&dirs[3]));
    assert_eq!(on0.len() + on1.len(), PIECES - 1, "{on0:?} {on1:?}");
    let set_of = |k: usize| usize::from(on1.iter().any(|p| piece_no(p) == k));
    for k in 2..PIECES {
        assert_ne!(
            set_of(k),
            set_of(k - 1),
            "pieces {} and {k} on one set",
            k - 1
        );
    }
    let base = dirs
        .iter()
        .map(|d| d.join(IMG))
        .find(|p| p.exists())
        .unwrap();
    let used = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&base).unwrap()) * 512;
    assert!(used <= 2 * MIB as u64, "the base holds {used} bytes");
    assert!(!std::fs::read_dir(&mnt)
        .unwrap()
        .any(|e| e.unwrap().file_name() == ".shards"));
    copies_agree(&dirs, 2);

    // A replica of set 0 misses writes to pieces 1-4: heal copies those of its pieces only.
    kill_brick_pid(v.pid(1));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(mnt.join(IMG))
        .unwrap();
    let new = pattern(9, 4 * MIB);
    f.write_all_at(&new, MIB as u64).unwrap();
    f.sync_all().unwrap();
    drop(f);
    want[MIB..5 * MIB].copy_from_slice(&new);
    let mut missed: Vec<String> = heal_paths(&v);
    missed.sort();
    let expect: Vec<String> = on0
        .iter()
        .filter(|p| (1..=4).contains(&piece_no(p)))
        .map(|p| format!(".shards/{p}"))
        .collect();
    assert_eq!(
        missed, expect,
        "heal would copy more or less than the pieces missed"
    );
    v.mgmt(&["volume", "start", "sh", "force"]);
    wait_for("heal to copy the missed pieces", 60, || {
        if heal_paths(&v).is_empty() {
            return true;
        }
        v.mgmt(&["volume", "heal", "sh"]);
        false
    });
    copies_agree(&dirs, 2);
    assert!(std::fs::read(mnt.join(IMG)).unwrap() == want);

    // NBD sees the same image.
    let (_nbd, uri) = v.nbd(&format!("/{IMG}"), &tmp.path().join("nbd.sock"));
    let local = tmp.path().join("want.img");
    std::fs::write(&local, &want).unwrap();
    let cmp = std::process::Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&local)
        .arg(&uri)
        .output()
        .expect("qemu-img");
    assert!(
        cmp.status.success(),
        "{}",
        String::from_utf8_lossy(&cmp.stdout)
    );

    // A third set: the rebalance moves pieces to it, not the image whole.
    let added: Vec<String> = (6..9)
        .map(|i| format!("127.0.0.1:{}", dirs[i].display()))
        .collect();
    let mut args = vec!["volume", "add-brick", "sh", "replica", "3"];
    args.extend(added.iter().map(String::as_str));
    v.mgmt(&args);
    v.mgmt(&["volume", "rebalance", "sh", "start"]);
    let st = v.wait_rebalance(120);
    assert_eq!(st["state"], "completed", "{st}");
    assert_eq!(st["failed"], 0, "{st}");
    let per_set: Vec<usize> = [0, 3, 6].iter().map(|&b| pieces(&dirs[b]).len()).collect();
    assert_eq!(per_set.iter().sum::<usize>(), PIECES - 1, "{per_set:?}");
    assert!(
        per_set.iter().all(|&n| n >= 2),
        "pieces per set: {per_set:?}"
    );
    assert!(st["files_moved"].as_u64().unwrap() >= 2, "{st}");
    copies_agree(&dirs, 3);
    assert!(std::fs::read(mnt.join(IMG)).unwrap() == want);

    // Removing the image removes every piece.
    std::fs::remove_file(mnt.join(IMG)).unwrap();
    for d in &dirs {
        assert!(pieces(d).is_empty(), "{} still holds pieces", d.display());
    }
}
