//! `add-brick VOL replica 3` on a one-brick volume, online: the two new bricks start new, the
//! heal service rebuilds them from the old one while a mount writes and verifies with fio, and
//! then the volume is a real replica-3 volume — every file identical on all three bricks, and
//! readable with the original brick killed.

use serde_json::Value;

use crate::common;
use common::fio::{need_fio, FioLoop};
use common::managed::Vol;
use common::{brick_files, kill_brick_pid, wait_for, BrickReaper};

fn content(i: usize) -> Vec<u8> {
    format!("replicated {i}\n").repeat(i % 30 + 1).into_bytes()
}

fn info(v: &Vol) -> Value {
    let s = v.mgmt(&["volume", "info", &v.name, "--json"]);
    serde_json::from_str::<Value>(&s).unwrap()["volumes"][0].clone()
}

#[test]
fn a_one_brick_volume_becomes_replica_3_online() {
    need_fio();
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let args = ["--brick-port-base", "25500", "--heal-interval", "0.2"];
    let v = Vol::with_bricks(tmp.path(), "wd", 1, 1, &args);
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let _mount = v.mount_env(&mnt, &[("KILN_LOG", "warn"), ("KILN_GRAPH_POLL_MS", "100")]);
    let files: Vec<String> = (0..120).map(|i| format!("d{}/f{i}", i % 4)).collect();
    for d in 0..4 {
        std::fs::create_dir_all(mnt.join(format!("d{d}"))).unwrap();
    }
    for (i, f) in files.iter().enumerate() {
        std::fs::write(mnt.join(f), content(i)).unwrap();
    }
    let fio = FioLoop::on_mount(&mnt, &tmp.path().join("fio"));
    fio.one_more(120);

    // Given set by set: a one-brick volume takes two.
    let brick = |i: usize| format!("127.0.0.1:{}", tmp.path().join(format!("b{i}")).display());
    let refused = common::fails(&[
        "volume",
        "add-brick",
        "wd",
        "replica",
        "3",
        &brick(1),
        "--server",
        &v.kd.addr,
        "--state-dir",
        v.state.to_str().unwrap(),
    ]);
    assert!(refused.contains("2 new brick(s) for each"), "{refused}");
    v.mgmt(&[
        "volume",
        "add-brick",
        "wd",
        "replica",
        "3",
        &brick(1),
        &brick(2),
    ]);
    let i = info(&v);
    assert_eq!(i["replica"], 3, "{i}");
    assert_eq!(i["sets"], serde_json::json!([[0, 1, 2]]), "{i}");
    // Rebuilt by the heal service while fio runs; then a majority is needed again.
    wait_for("the new replicas to be rebuilt", 180, || {
        info(&v).get("widening").is_none()
    });
    fio.one_more(120);
    let (runs, failures) = fio.finish();
    assert!(failures.is_empty(), "I/O errors: {}", failures.join("\n"));
    assert!(runs >= 2);
    std::fs::write(mnt.join("after"), b"written on three").unwrap();
    let dirs: Vec<_> = (0..3).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let names = brick_files(&dirs[0]);
    assert!(names.len() >= files.len() + 2, "{names:?}");
    for d in &dirs[1..] {
        assert_eq!(brick_files(d), names, "{d:?}");
    }
    for f in &names {
        let a = std::fs::read(dirs[0].join(f)).unwrap();
        for d in &dirs[1..] {
            assert_eq!(a, std::fs::read(d.join(f)).unwrap(), "{f} on {d:?}");
        }
    }
    // The old brick goes: the volume still serves every file, from the new replicas.
    kill_brick_pid(v.pid(0));
    for (i, f) in files.iter().enumerate() {
        assert_eq!(std::fs::read(mnt.join(f)).unwrap(), content(i), "{f}");
    }
    assert_eq!(
        std::fs::read(mnt.join("after")).unwrap(),
        b"written on three"
    );
}
