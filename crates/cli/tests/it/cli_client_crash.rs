//! Replicas agree after the writing client is killed: `kiln mount` and `kiln nbd` over a
//! replica-3 volume, fio writing 1 MiB blocks at random through them, SIGKILL to the client
//! mid-stream (its writes in flight reached some bricks and not others, and it marks nothing).
//! The bricks record the dead connection's recent writes as suspect; a read through another
//! mount before heal must equal the read after it, and after `kiln volume heal` the three
//! bricks' copies must be byte-identical. (Many seeded runs with a libkiln writer:
//! `crates/kilnd/tests/replicate_client_crash.rs`.)

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::common;
use common::managed::{Proc, Vol};
use common::{wait_for, BrickReaper};

const IMG: &str = "img.raw";
const SIZE: u64 = 32 << 20;

fn fio(target: &[String]) -> Child {
    Command::new("fio")
        .args([
            "--name=crash",
            "--rw=randwrite",
            "--bs=1m",
            "--iodepth=32",
            &format!("--size={SIZE}"),
            "--time_based",
            "--runtime=60",
        ])
        .args(target)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("fio (apt-get install fio; scripts/test.sh installs it)")
}

/// When `IMG` last changed on brick 0: later once fio's writes land.
fn changed(tmp: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(tmp.join("b0").join(IMG))
        .and_then(|m| m.modified())
        .ok()
}

fn suspect(v: &Vol) -> bool {
    suspects(v).iter().any(|p| p == IMG)
}

fn backlog(v: &Vol) -> usize {
    let out = v.mgmt(&["volume", "heal", &v.name, "info", "--json"]);
    let j: Value = serde_json::from_str(out.trim()).unwrap();
    j["needs"].as_array().unwrap().len()
}

/// One crash: `start` starts a client writing to the image and returns it and fio; it is
/// killed once writes land, and heal must leave the copies identical.
fn crash(tmp: &Path, v: &Vol, mnt: &Path, run: u64, start: impl FnOnce() -> (Proc, Child)) {
    let then = changed(tmp);
    let (mut client, mut fio) = start();
    wait_for("fio's writes to land on the bricks", 60, || {
        changed(tmp) > then
    });
    // The crash moment varies from run to run (not a wait for anything).
    std::thread::sleep(Duration::from_millis(150 + run * 170));
    client.0.kill().unwrap(); // SIGKILL
    client.0.wait().unwrap();
    let _ = fio.kill();
    let _ = fio.wait();
    wait_for(
        "the bricks to record the dead client's writes as suspect",
        20,
        || suspect(v),
    );
    let before = std::fs::read(mnt.join(IMG)).unwrap();
    let copies = |tmp: &Path| -> Vec<Vec<u8>> {
        (0..3)
            .map(|i| std::fs::read(tmp.join(format!("b{i}")).join(IMG)).unwrap())
            .collect()
    };
    let was = copies(tmp);
    eprintln!(
        "run {run}: before heal, bricks 1 and 2 {} brick 0",
        match (was[1] == was[0], was[2] == was[0]) {
            (true, true) => "agree with",
            (false, false) => "both differ from",
            _ => "partly differ from",
        }
    );
    for _ in 0..3 {
        if backlog(v) == 0 {
            break;
        }
        v.mgmt(&["volume", "heal", &v.name]);
    }
    assert_eq!(backlog(v), 0, "run {run}: heal left files behind");
    let copies = copies(tmp);
    for (i, c) in copies.iter().enumerate().skip(1) {
        assert!(
            *c == copies[0],
            "run {run}: brick {i}'s copy differs from brick 0's ({} and {} bytes)",
            c.len(),
            copies[0].len()
        );
    }
    let after = std::fs::read(mnt.join(IMG)).unwrap();
    assert!(
        before == after,
        "run {run}: a read before heal differs from one after"
    );
    assert!(
        after == copies[0],
        "run {run}: the mount reads other bytes than the bricks hold"
    );
}

/// A replica-3 volume of a kilnd on `port_base`, mounted (the reader) at `mnt`, holding the
/// image. Fields drop in order: the mount, the kilnd, then the bricks it started.
struct Setup {
    _mount: Proc,
    v: Vol,
    mnt: std::path::PathBuf,
    _reaper: BrickReaper,
}

fn setup(tmp: &Path, port_base: &str) -> Setup {
    if Command::new("fio").arg("--version").output().is_err() {
        panic!("fio is needed (apt-get install fio; scripts/test.sh installs it)");
    }
    let reaper = BrickReaper(tmp.join("state"));
    // No heal service: the test reads before heal, then heals.
    let args = ["--brick-port-base", port_base, "--heal-interval", "0"];
    let v = Vol::with_kilnd_args(tmp, "crash", 3, &args);
    let mnt = tmp.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mount = v.mount(&mnt);
    std::fs::File::create(mnt.join(IMG))
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    Setup {
        _mount: mount,
        v,
        mnt,
        _reaper: reaper,
    }
}

#[test]
fn replicas_agree_after_kiln_nbd_is_killed_mid_write() {
    let tmp = tempfile::tempdir().unwrap();
    let Setup { v, mnt, .. } = &setup(tmp.path(), "25300");
    for run in 0..3 {
        let sock = tmp.path().join(format!("nbd{run}.sock"));
        crash(tmp.path(), v, mnt, run, || {
            let (nbd, uri) = v.nbd(&format!("/{IMG}"), &sock);
            let fio = fio(&["--ioengine=nbd".into(), format!("--uri={uri}")]);
            (nbd, fio)
        });
    }
}

#[test]
fn replicas_agree_after_kiln_mount_is_killed_mid_write() {
    let tmp = tempfile::tempdir().unwrap();
    let Setup { v, mnt, .. } = &setup(tmp.path(), "25400");
    for run in 0..3 {
        let m2 = tmp.path().join(format!("writer{run}"));
        std::fs::create_dir_all(&m2).unwrap();
        crash(tmp.path(), v, mnt, run, || {
            let m = v.mount(&m2);
            let fio = fio(&[
                format!("--filename={}", m2.join(IMG).display()),
                "--direct=1".into(),
                "--ioengine=libaio".into(),
            ]);
            (m, fio)
        });
        // The dead mount's directory: detached (its FUSE connection is gone).
        let _ = Command::new("umount").arg("-l").arg(&m2).status();
    }
}

/// The paths `heal info` lists as suspect.
fn suspects(v: &Vol) -> Vec<String> {
    let out = v.mgmt(&["volume", "heal", &v.name, "info", "--json"]);
    let j: Value = serde_json::from_str(out.trim()).unwrap();
    j["needs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["suspect"] == true)
        .filter_map(|n| n["path"].as_str().map(str::to_owned))
        .collect()
}

/// A mount whose fio run ends normally and which is then unmounted says goodbye to the
/// bricks: nothing it created or wrote is suspect. A mount killed afterwards still leaves its
/// writes suspect (and, having ended later, shows the bricks have dealt with both).
#[test]
fn a_mount_that_ends_cleanly_leaves_nothing_suspect() {
    let tmp = tempfile::tempdir().unwrap();
    let Setup { v, .. } = &setup(tmp.path(), "25500");
    let run = |m: &Path, name: &str, secs: &str| {
        Command::new("fio")
            .args([
                "--name=clean",
                "--rw=randwrite",
                "--bs=64k",
                "--size=8m",
                "--direct=1",
            ])
            .args([
                "--ioengine=libaio",
                "--iodepth=8",
                "--time_based",
                "--runtime",
                secs,
            ])
            .arg(format!("--filename={}", m.join(name).display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fio")
    };
    let clean = tmp.path().join("clean");
    std::fs::create_dir_all(&clean).unwrap();
    let m = v.mount(&clean);
    let st = run(&clean, "clean.raw", "2").wait().unwrap();
    assert!(st.success(), "fio through the mount");
    drop(m); // SIGTERM: unmounts, says goodbye, exits (waited for)

    let killed = tmp.path().join("killed");
    std::fs::create_dir_all(&killed).unwrap();
    let mut k = v.mount(&killed);
    let mut fio = run(&killed, "killed.raw", "30");
    wait_for("the killed mount's writes to land", 60, || {
        std::fs::metadata(tmp.path().join("b0/killed.raw")).is_ok_and(|m| m.len() > 0)
    });
    k.0.kill().unwrap();
    k.0.wait().unwrap();
    let _ = fio.kill();
    let _ = fio.wait();
    let _ = Command::new("umount").arg("-l").arg(&killed).status();
    wait_for("the killed mount's writes to become suspect", 20, || {
        suspects(v).contains(&"killed.raw".to_owned())
    });
    let all = suspects(v);
    assert!(
        !all.contains(&"clean.raw".to_owned()),
        "a clean unmount left suspects: {all:?}"
    );
}
