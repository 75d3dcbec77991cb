//! Image snapshots and clones on real XFS bricks (reflink), with real clients: a managed
//! replica-3 volume whose bricks live on an XFS file system the test makes on a loop device
//! (and removes), an image written through `kiln nbd`, and `kiln image` as an operator runs it.
//!
//! - a snapshot of a quiet image is taken in under a second and equals the image, on every
//!   replica (`qemu-img compare`), and stays so while the image is written;
//! - a snapshot taken while fio writes through the export: under a second, and once heal has
//!   run the three replicas' copies are identical;
//! - a clone is writable at once through its own export, its writes touch neither the
//!   snapshot nor the image, and it takes under 1% of the image's size on the bricks;
//! - `list` and `rm`; and a volume on a file system without reflink refuses with a clear error.
//!
//! Needs root, mkfs.xfs, losetup, qemu-img, qemu-io and fio; skips (saying why) without.

mod common;
#[path = "../../kilnd/tests/xfs/mod.rs"]
mod xfs;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::managed::Vol;
use common::{kiln, wait_for, BrickReaper};
use xfs::{sh, Xfs};

const MIB: u64 = 1 << 20;
/// The image: big enough that a copy would show, small enough for CI.
const SIZE: u64 = 256 * MIB;

fn need(tool: &str) -> bool {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("skipping: {tool} is not installed");
    }
    ok
}

fn image(v: &Vol, args: &[&str]) -> Result<String, String> {
    let out = kiln()
        .arg("image")
        .args(args)
        .env("KILN_SECRET_FILE", &v.secret)
        .output()
        .unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `kiln image snapshot`; returns how long it says it took.
fn snapshot(v: &Vol, name: &str) -> Duration {
    let out = image(v, &["snapshot", &v.source("/disk.img"), name]).unwrap();
    println!("{}", out.trim());
    let ms: f64 = out
        .split(" taken in ")
        .nth(1)
        .and_then(|t| t.split(" ms").next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no time in {out:?}"));
    Duration::from_secs_f64(ms / 1e3)
}

fn compare(a: &Path, b: &str) -> Result<(), String> {
    sh(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(a)
        .arg(b))
    .map(|_| ())
}

/// Every replica's copy of `name` in the volume's bricks.
fn copies(bricks: &Path, name: &str) -> Vec<PathBuf> {
    (0..3)
        .map(|i| bricks.join(format!("b{i}")).join(name))
        .collect()
}

fn qemu_io(uri: &str, cmd: &str) {
    sh(Command::new("qemu-io").args(["-f", "raw", "-c", cmd, uri])).unwrap();
}

#[test]
fn snapshots_and_clones_on_xfs_bricks() {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipping: loop devices need root");
        return;
    }
    if !["mkfs.xfs", "losetup", "qemu-img", "qemu-io", "fio"]
        .iter()
        .all(|t| need(t))
    {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let xfs = match Xfs::make(tmp.path(), 3 << 30) {
        Ok(x) => x,
        Err(e) => {
            println!("skipping: cannot make an XFS file system on a loop device: {e}");
            return;
        }
    };
    let bricks = xfs.mnt.clone();
    let v = Vol::with_kilnd_args(
        &bricks,
        "snap",
        3,
        &["--brick-port-base", "25900", "--heal-interval", "0.2"],
    );
    let _reaper = BrickReaper(v.state.clone());

    // The image: random data written through an export.
    let src = tmp.path().join("src.raw");
    let data: Vec<u8> = (0..SIZE).map(|i| ((i * 2654435761) >> 13) as u8).collect();
    std::fs::write(&src, &data).unwrap();
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = v.mount(&mnt);
    std::fs::File::create(mnt.join("disk.img"))
        .and_then(|f| f.set_len(SIZE))
        .unwrap();
    drop(m);
    let (exp, uri) = v.nbd("/disk.img", &tmp.path().join("e.sock"));
    sh(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&uri))
    .unwrap();

    // A quiet image: the snapshot equals it on every replica, and stays as it was.
    let took = snapshot(&v, "s1");
    assert!(took < Duration::from_secs(1), "snapshot took {took:?}");
    for c in copies(&bricks, ".disk.img@s1") {
        compare(&src, c.to_str().unwrap()).unwrap();
    }
    qemu_io(&uri, "write -P 0x77 64M 4M");
    for c in copies(&bricks, ".disk.img@s1") {
        compare(&src, c.to_str().unwrap()).expect("the snapshot changed with the image");
    }

    // Under fio (random 4 KiB writes, 16 in flight, for 4 s): quick, and the copies agree
    // once heal has made alike what writes held at a barrier left different.
    let fio = Command::new("fio")
        .args([
            "--name=busy",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=64m",
            "--time_based",
            "--runtime=4",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(10, "fio to write", || {
        // Writes land on every replica: the image's blocks change under it.
        std::fs::metadata(bricks.join("b0/disk.img"))
            .map(|m| m.modified().unwrap())
            .is_ok_and(|t| t.elapsed().map_or(true, |e| e < Duration::from_millis(200)))
    });
    let busy = snapshot(&v, "s2");
    let out = fio.wait_with_output().unwrap();
    assert!(out.status.success(), "fio failed");
    assert!(
        busy < Duration::from_secs(1),
        "snapshot under fio took {busy:?}"
    );
    let s2 = copies(&bricks, ".disk.img@s2");
    wait_for(60, "the snapshot's copies to agree", || {
        let a = std::fs::read(&s2[0]).unwrap();
        s2[1..].iter().all(|c| std::fs::read(c).unwrap() == a)
    });
    println!("snapshots took {took:?} (quiet) and {busy:?} (under fio)");

    // A clone: at once, writable, separate, and almost free.
    let before = xfs.free();
    image(
        &v,
        &[
            "clone",
            &format!("{}@s1", v.source("/disk.img")),
            "clone.img",
        ],
    )
    .unwrap();
    let used = before.saturating_sub(xfs.free());
    assert!(
        used < SIZE / 100,
        "three clone copies took {used} B of the bricks"
    );
    let (cexp, curi) = v.nbd("/clone.img", &tmp.path().join("c.sock"));
    compare(&src, &curi).expect("the clone starts as the snapshot");
    qemu_io(&curi, "write -P 0x99 64M 1M");
    qemu_io(&curi, "read -P 0x99 64M 1M");
    qemu_io(&uri, "read -P 0x77 64M 4M");
    for c in copies(&bricks, ".disk.img@s1") {
        compare(&src, c.to_str().unwrap()).expect("a clone's write reached its snapshot");
    }
    drop(cexp);

    let listed = image(&v, &["list", &v.source("/disk.img")]).unwrap();
    let names: Vec<&str> = listed.lines().filter_map(|l| l.split(' ').next()).collect();
    assert_eq!(names, ["s1", "s2"], "{listed}");
    image(&v, &["rm", &format!("{}@s2", v.source("/disk.img"))]).unwrap();
    assert!(s2.iter().all(|c| !c.exists()), "rm left a copy");
    let e = image(&v, &["snapshot", &v.source("/disk.img"), "s1"]).unwrap_err();
    assert!(e.contains("exists already"), "{e}");
    let e = image(&v, &["snapshot", &v.source("/disk.img"), "../x"]).unwrap_err();
    assert!(e.contains("snapshot name"), "{e}");
    drop(exp);
    println!("three clone copies of a {SIZE} B image took {used} B of the bricks");
}

/// Bricks on a file system without reflink: a snapshot is refused, and says why.
#[test]
fn no_reflink_no_snapshot() {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipping: needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let probe = tmp.path().join("probe");
    std::fs::write(&probe, b"x").unwrap();
    let clone = std::fs::File::create(tmp.path().join("probe2")).unwrap();
    if rustix::fs::ioctl_ficlone(&clone, std::fs::File::open(&probe).unwrap()).is_ok() {
        println!("skipping: the temporary directory's file system can reflink");
        return;
    }
    let v = Vol::with_kilnd_args(
        tmp.path(),
        "flat",
        3,
        &["--brick-port-base", "25950", "--heal-interval", "0.2"],
    );
    let _reaper = BrickReaper(v.state.clone());
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = v.mount(&mnt);
    std::fs::write(mnt.join("disk.img"), vec![1u8; 1 << 20]).unwrap();
    drop(m);
    let start = Instant::now();
    let e = image(&v, &["snapshot", &v.source("/disk.img"), "s"]).unwrap_err();
    assert!(e.contains("cannot reflink"), "{e}");
    for i in 0..3 {
        let left = tmp.path().join(format!("b{i}/.disk.img@s"));
        assert!(!left.exists(), "a refused snapshot left {}", left.display());
    }
    println!("refused in {:?}: {e}", start.elapsed());
}
