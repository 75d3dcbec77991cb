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

use crate::common;
use kiln_testkit::xfs;

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

fn compare(a: &Path, b: &str) -> std::io::Result<()> {
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

/// An XFS file system of `size` bytes on a loop device in `tmp`, and a replica-3 volume
/// `name` with its bricks on it (ports from `port`); `None` (saying why) where the machine
/// lacks XFS, loop devices or one of `tools`.
fn on_xfs(tmp: &Path, size: u64, name: &str, port: &str, tools: &[&str]) -> Option<(Xfs, Vol)> {
    if !["mkfs.xfs", "losetup"].iter().chain(tools).all(|t| need(t)) {
        return None;
    }
    let xfs = Xfs::make(tmp, size)
        .map_err(|e| println!("skipping: cannot make an XFS file system on a loop device: {e}"))
        .ok()?;
    let args = ["--brick-port-base", port, "--heal-interval", "0.2"];
    let v = Vol::with_kilnd_args(&xfs.mnt, name, 3, &args);
    Some((xfs, v))
}

#[test]
fn snapshots_and_clones_on_xfs_bricks() {
    if !kiln_testkit::is_root() {
        println!("skipping: loop devices need root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let tools = ["qemu-img", "qemu-io", "fio"];
    let Some((xfs, v)) = on_xfs(tmp.path(), 3 << 30, "snap", "25900", &tools) else {
        return;
    };
    let bricks = xfs.mnt.clone();
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
    wait_for("fio to write", 10, || {
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
    wait_for("the snapshot's copies to agree", 60, || {
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
    if !kiln_testkit::is_root() {
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

/// The counter a file of the tree test holds at its start.
fn counter(p: &Path) -> u64 {
    let b = std::fs::read(p).unwrap();
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

/// A directory tree's snapshot is one instant for all its files: a writer bumps a counter in
/// file a, then in file b (each write acknowledged before the next), over and over; in the
/// snapshot, a holds b's count or one more — a cut that took a's copy and b's at different
/// moments would see a far ahead of b, or b ahead of a. The snapshot keeps the tree's
/// directories, symlinks, modes and owners; a clone of it is writable at once and separate;
/// `rm` removes the tree.
#[test]
fn a_tree_snapshot_is_one_instant_for_all_its_files() {
    if !kiln_testkit::is_root() {
        println!("skipping: loop devices need root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let Some((xfs, v)) = on_xfs(tmp.path(), 1 << 30, "tree", "25970", &[]) else {
        return;
    };
    let bricks = xfs.mnt.clone();
    let _reaper = BrickReaper(v.state.clone());
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = v.mount(&mnt);
    let vm = mnt.join("vm");
    std::fs::create_dir_all(vm.join("disks/old")).unwrap();
    std::fs::write(vm.join("a"), 0u64.to_le_bytes()).unwrap();
    std::fs::write(vm.join("disks/b"), 0u64.to_le_bytes()).unwrap();
    std::fs::write(vm.join("disks/old/big"), vec![7u8; 8 << 20]).unwrap();
    std::fs::write(vm.join("vm.conf"), b"memory = 2G\n").unwrap();
    std::fs::write(vm.join("helper"), b"#!/bin/sh\n").unwrap();
    // Looks like a snapshot's name, but of nothing here: a file like any other.
    std::fs::write(vm.join(".user@example.com"), b"mail\n").unwrap();
    std::os::unix::fs::symlink("disks/b", vm.join("current")).unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    std::fs::set_permissions(vm.join("vm.conf"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(vm.join("vm.conf"), Some(1234), Some(5678)).unwrap();
    std::fs::set_permissions(vm.join("disks"), std::fs::Permissions::from_mode(0o750)).unwrap();
    // Set-user-ID survives being given its owner (a chown after the chmod would clear it).
    std::os::unix::fs::chown(vm.join("helper"), Some(1234), Some(5678)).unwrap();
    std::fs::set_permissions(vm.join("helper"), std::fs::Permissions::from_mode(0o4755)).unwrap();

    // The writer: a, then b, each acknowledged by the replicas before the next.
    kiln_client::mgmt::use_secret_file(&v.secret);
    let src = kiln_client::volume::Source::Server {
        server: v.kd.addr.clone(),
        volume: v.name.clone(),
    };
    let vol = kiln_client::Volume::from_source(&src).expect("volume");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = {
        let (stop, count) = (stop.clone(), count.clone());
        std::thread::spawn(move || {
            use std::sync::atomic::Ordering::Relaxed;
            let fa = kiln_client::block_on(vol.open("/vm/a", libc::O_RDWR)).unwrap();
            let fb = kiln_client::block_on(vol.open("/vm/disks/b", libc::O_RDWR)).unwrap();
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                n += 1;
                for fd in [&fa, &fb] {
                    let b = n.to_le_bytes();
                    vol.pwritev_blocking(fd, &[std::io::IoSlice::new(&b)], 0)
                        .unwrap();
                }
                count.store(n, Relaxed);
            }
        })
    };
    wait_for("the writer to write", 10, || {
        count.load(std::sync::atomic::Ordering::Relaxed) > 100
    });
    let out = image(&v, &["snapshot", &v.source("/vm"), "t1"]).unwrap();
    let during = count.load(std::sync::atomic::Ordering::Relaxed);
    wait_for("the writer to go on after the snapshot", 10, || {
        count.load(std::sync::atomic::Ordering::Relaxed) > during + 100
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    println!("{}", out.trim());
    assert!(
        out.contains("of 6 files, 2 directories and 1 symlinks"),
        "{out}"
    );

    // Every replica's copy of the snapshot agrees once heal ran; the cut is one instant.
    let snap = |i: usize| bricks.join(format!("b{i}/.vm@t1"));
    wait_for("the snapshot's copies to agree", 60, || {
        ["a", "disks/b"].iter().all(|f| {
            let a = std::fs::read(snap(0).join(f)).unwrap();
            (1..3).all(|i| std::fs::read(snap(i).join(f)).unwrap() == a)
        })
    });
    let (a, b) = (
        counter(&snap(0).join("a")),
        counter(&snap(0).join("disks/b")),
    );
    println!("snapshot holds a = {a}, b = {b}; the writer was at {during} when it returned");
    assert!(
        a > 0 && (a == b || a == b + 1),
        "a = {a}, b = {b}: not one instant"
    );
    let snap_mnt = mnt.join(".vm@t1");
    assert_eq!(
        std::fs::read_link(snap_mnt.join("current")).unwrap(),
        Path::new("disks/b")
    );
    let conf = std::fs::metadata(snap_mnt.join("vm.conf")).unwrap();
    assert_eq!(
        (conf.mode() & 0o7777, conf.uid(), conf.gid()),
        (0o640, 1234, 5678)
    );
    assert_eq!(
        std::fs::read(snap_mnt.join(".user@example.com")).unwrap(),
        b"mail\n"
    );
    let helper = std::fs::metadata(snap_mnt.join("helper")).unwrap();
    assert_eq!((helper.mode() & 0o7777, helper.uid()), (0o4755, 1234));
    let disks = std::fs::metadata(snap_mnt.join("disks")).unwrap();
    assert_eq!(disks.mode() & 0o7777, 0o750);
    assert_eq!(
        std::fs::read(snap_mnt.join("disks/old/big")).unwrap(),
        vec![7u8; 8 << 20]
    );
    // No copy of a file was left beside it in the tree.
    for d in ["", "disks", "disks/old"] {
        for e in std::fs::read_dir(vm.join(d)).unwrap() {
            let n = e.unwrap().file_name();
            assert!(
                !n.to_string_lossy().contains("@t1"),
                "left in vm/{d}: {n:?}"
            );
        }
    }

    // A clone: at once, almost free, writable, and separate from the snapshot.
    let before = xfs.free();
    let out = image(&v, &["clone", &format!("{}@t1", v.source("/vm")), "vm2"]).unwrap();
    assert!(out.contains("(6 files)"), "{out}");
    let used = before.saturating_sub(xfs.free());
    assert!(used < (1 << 20), "three copies of the clone took {used} B");
    let vm2 = mnt.join("vm2");
    assert_eq!(counter(&vm2.join("a")), a);
    assert_eq!(
        std::fs::read_link(vm2.join("current")).unwrap(),
        Path::new("disks/b")
    );
    let conf = std::fs::metadata(vm2.join("vm.conf")).unwrap();
    assert_eq!(
        (conf.mode() & 0o7777, conf.uid(), conf.gid()),
        (0o640, 1234, 5678)
    );
    let helper = std::fs::metadata(vm2.join("helper")).unwrap();
    assert_eq!(helper.mode() & 0o7777, 0o4755);
    std::fs::write(vm2.join("disks/old/big"), b"changed").unwrap();
    assert_eq!(
        std::fs::read(snap_mnt.join("disks/old/big")).unwrap(),
        vec![7u8; 8 << 20]
    );

    let listed = image(&v, &["list", &v.source("/vm")]).unwrap();
    assert!(listed.starts_with("t1 "), "{listed}");
    let e = image(&v, &["snapshot", &v.source("/vm"), "t1"]).unwrap_err();
    assert!(e.contains("exists already"), "{e}");
    // The directory gone, its snapshot still clones and goes.
    std::fs::remove_dir_all(&vm).unwrap();
    image(&v, &["clone", &format!("{}@t1", v.source("/vm")), "vm3"]).unwrap();
    assert_eq!(counter(&mnt.join("vm3/a")), a);
    image(&v, &["rm", &format!("{}@t1", v.source("/vm"))]).unwrap();
    assert!((0..3).all(|i| !snap(i).exists()), "rm left the tree");
    // What an interrupted snapshot left refuses the next one by that name, and rm removes it.
    std::fs::create_dir(mnt.join(".vm3@t2~")).unwrap();
    let e = image(&v, &["snapshot", &v.source("/vm3"), "t2"]).unwrap_err();
    assert!(e.contains("interrupted"), "{e}");
    assert!(
        (0..3).all(|i| bricks.join(format!("b{i}/.vm3@t2~")).exists()),
        "a refused snapshot removed another's part"
    );
    image(&v, &["rm", &format!("{}@t2", v.source("/vm3"))]).unwrap();
    assert!(
        (0..3).all(|i| !bricks.join(format!("b{i}/.vm3@t2~")).exists()),
        "rm left an interrupted snapshot's part"
    );
    image(&v, &["snapshot", &v.source("/vm3"), "t2"]).unwrap();
    drop(m);
}

/// Connections that raise a snapshot barrier on an image again and again cannot hold another
/// client's write behind it for longer than a brick's longest hold (2 s): renewals are refused
/// with `ETIMEDOUT` past that (another connection's barrier with `EBUSY`), and the write goes
/// through. (Before, each renewal moved the barrier's end, and the write waited as long as the
/// loop ran.)
#[test]
fn a_barrier_renewed_in_a_loop_holds_another_clients_write_for_two_seconds_at_most() {
    use kiln_client::block_on;
    use kiln_proto::ops::SNAP_FREEZE;
    let tmp = tempfile::tempdir().unwrap();
    let v = Vol::new(tmp.path(), "bar", 1, "26800");
    let _reaper = BrickReaper(v.state.clone());
    kiln_client::mgmt::use_secret_file(&v.secret);
    let src = kiln_client::volume::Source::Server {
        server: v.kd.addr.clone(),
        volume: "bar".into(),
    };
    let writer = kiln_client::Volume::from_source(&src).expect("the writer's client");
    let (fd, _) = block_on(writer.create("disk.img", libc::O_RDWR, 0o644)).unwrap();
    let block = [7u8; 4096];
    writer
        .pwritev_blocking(&fd, &[std::io::IoSlice::new(&block)], 0)
        .unwrap();

    // Two more connections (one client taking turns with two would do the same) freeze the
    // image every 100 ms each with a 1 s time to live, for 6 s, ignoring refusals.
    let (frozen_tx, frozen_rx) = std::sync::mpsc::channel();
    let renewers: Vec<_> = (0..2)
        .map(|_| {
            let (src, frozen_tx) = (src.clone(), frozen_tx.clone());
            std::thread::spawn(move || {
                let vol = kiln_client::Volume::from_source(&src).expect("a renewer's client");
                let fd = block_on(vol.open("disk.img", libc::O_RDWR)).unwrap();
                let end = Instant::now() + Duration::from_secs(6);
                let mut refusals = Vec::new();
                while Instant::now() < end {
                    match block_on(vol.snap(&fd, SNAP_FREEZE, "", "", 1000)) {
                        Ok(_) => {
                            let _ = frozen_tx.send(());
                        }
                        Err(e) => refusals.push(e.raw_os_error()),
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                refusals
            })
        })
        .collect();
    frozen_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the first barrier");
    let t = Instant::now();
    writer
        .pwritev_blocking(&fd, &[std::io::IoSlice::new(&block)], 0)
        .unwrap();
    let held = t.elapsed();
    let refusals: Vec<Option<i32>> = renewers
        .into_iter()
        .flat_map(|r| r.join().unwrap())
        .collect();
    assert!(
        held < Duration::from_millis(3000),
        "the write waited {held:?} behind renewed barriers"
    );
    assert!(
        refusals.contains(&Some(libc::ETIMEDOUT)),
        "renewals past the longest hold are refused: {refusals:?}"
    );
    println!("the write waited {held:?}; refusals: {}", refusals.len());
    block_on(writer.close(fd)).unwrap();
}

/// A POSIX ACL as `system.posix_acl_access` holds it: version 2, then (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut b = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        b.extend(tag.to_le_bytes());
        b.extend(perm.to_le_bytes());
        b.extend(id.to_le_bytes());
    }
    b
}

/// The ACL of brick file `p`, if it has one.
fn acl_of(p: &Path) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    rustix::fs::getxattr(p, "system.posix_acl_access", &mut buf[..])
        .ok()
        .map(|n| buf[..n].to_vec())
}

/// A snapshot is as private as its image: a 0600 image of uid 1234 gets a snapshot of uid
/// 1234 with no group or other permission (and no write permission), on every replica, and
/// a clone of it likewise; an image's POSIX ACL goes with it (write permission taken out in
/// the snapshot). Before, snapshots were root's, mode 0444: anyone read a private image
/// through its snapshot.
#[test]
fn snapshots_and_clones_carry_the_images_owner_mode_and_acl() {
    use kiln_client::block_on;
    if !kiln_testkit::is_root() {
        println!("skipping: loop devices need root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let Some((xfs, v)) = on_xfs(tmp.path(), 512 * MIB, "perm", "26850", &[]) else {
        return;
    };
    let _reaper = BrickReaper(v.state.clone());
    kiln_client::mgmt::use_secret_file(&v.secret);
    let vol = kiln_client::Volume::from_source(&kiln_client::volume::Source::Server {
        server: v.kd.addr.clone(),
        volume: "perm".into(),
    })
    .expect("a client");
    // user 4321 may read acl.img (mask r--); others nothing.
    let (user_obj, user, group_obj, mask, other) = (0x01, 0x02, 0x04, 0x10, 0x20);
    let granted = acl(&[
        (user_obj, 6, u32::MAX),
        (user, 6, 4321),
        (group_obj, 0, u32::MAX),
        (mask, 6, u32::MAX),
        (other, 0, u32::MAX),
    ]);
    for name in ["priv.img", "acl.img"] {
        let (fd, _) = block_on(vol.create(name, libc::O_RDWR, 0o600)).unwrap();
        vol.pwritev_blocking(&fd, &[std::io::IoSlice::new(&[9u8; 4096])], 0)
            .unwrap();
        let owner = kiln_client::SetAttrs {
            valid: kiln_proto::ops::SETATTR_UID
                | kiln_proto::ops::SETATTR_GID
                | kiln_proto::ops::SETATTR_MODE,
            uid: 1234,
            gid: 1234,
            mode: 0o600,
            ..Default::default()
        };
        block_on(vol.fsetattr(&fd, owner)).unwrap();
        block_on(vol.close(fd)).unwrap();
    }
    block_on(vol.setxattr("acl.img", "system.posix_acl_access", &granted, 0)).unwrap();
    // A directory tree: its directory's ACLs (access and default) and its file's go with it.
    block_on(vol.mkdir("d", 0o700)).unwrap();
    let (fd, _) = block_on(vol.create("d/f", libc::O_RDWR, 0o600)).unwrap();
    block_on(vol.close(fd)).unwrap();
    for (path, name) in [
        ("d", "system.posix_acl_access"),
        ("d", "system.posix_acl_default"),
        ("d/f", "system.posix_acl_access"),
    ] {
        block_on(vol.setxattr(path, name, &granted, 0)).unwrap();
    }
    image(&v, &["snapshot", &v.source("/d"), "s1"]).unwrap();
    for name in ["priv", "acl"] {
        image(&v, &["snapshot", &v.source(&format!("/{name}.img")), "s1"]).unwrap();
        let snap = format!("{}@s1", v.source(&format!("/{name}.img")));
        image(&v, &["clone", &snap, &format!("/{name}-clone.img")]).unwrap();
    }
    use std::os::unix::fs::MetadataExt;
    for i in 0..3 {
        let b = xfs.mnt.join(format!("b{i}"));
        for (file, mode) in [
            (".priv.img@s1", 0o400),
            ("priv-clone.img", 0o600),
            (".acl.img@s1", 0o440),
            ("acl-clone.img", 0o660),
        ] {
            let m = std::fs::metadata(b.join(file)).unwrap();
            assert_eq!(
                (m.uid(), m.gid(), m.mode() & 0o7777),
                (1234, 1234, mode),
                "brick {i}: {file}"
            );
        }
        assert_eq!(acl_of(&b.join(".priv.img@s1")), None, "brick {i}");
        assert_eq!(acl_of(&b.join("acl-clone.img")).as_ref(), Some(&granted));
        let read_only = acl(&[
            (user_obj, 4, u32::MAX),
            (user, 4, 4321),
            (group_obj, 0, u32::MAX),
            (mask, 4, u32::MAX),
            (other, 0, u32::MAX),
        ]);
        assert_eq!(acl_of(&b.join(".acl.img@s1")), Some(read_only), "brick {i}");
        let tree = b.join(".d@s1");
        assert_eq!(acl_of(&tree).as_ref(), Some(&granted), "brick {i}");
        assert_eq!(
            acl_of(&tree.join("f")).as_ref(),
            Some(&granted),
            "brick {i}"
        );
        let mut buf = vec![0u8; 4096];
        let n = rustix::fs::getxattr(&tree, "system.posix_acl_default", &mut buf[..]).unwrap();
        assert_eq!(&buf[..n], &granted[..], "brick {i}");
    }
}
