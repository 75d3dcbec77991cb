//! Damaged copies on a managed, sharded replica-3 volume, read as an operator's clients read
//! them: bytes flipped in one brick's copies of an image (its first piece and a later one)
//! behind the brick's back; every read through a FUSE mount and through `kiln nbd` returns
//! the right bytes; `kiln volume heal` repairs the copies until all three are identical; and a
//! block damaged on every replica reads as an I/O error (`EIO`) through both, the rest of the
//! image reading right. Needs root and qemu-img; skips (saying why) without qemu-img.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;
use common::managed::Vol;
use common::{brick_files, BrickReaper};

const MIB: usize = 1 << 20;
const IMG: &str = "disk.img";
const SIZE: usize = 6 * MIB;

fn pattern(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The brick file holding bytes `at..` of the image (piece `at / 1 MiB`) in `dir`.
fn holder(dir: &Path, at: usize) -> PathBuf {
    let k = at / MIB;
    if k == 0 {
        return dir.join(IMG);
    }
    let name = brick_files(dir)
        .into_iter()
        .find(|f| f.starts_with(".shards/") && f.ends_with(&format!(".{k}")))
        .unwrap_or_else(|| panic!("piece {k} is not on {}", dir.display()));
    dir.join(name)
}

/// Flips 16 bytes at image offset `at` in the copy on `dir`.
fn damage(dir: &Path, at: usize) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(holder(dir, at))
        .unwrap();
    let off = (at % MIB) as u64;
    let mut b = [0u8; 16];
    f.read_exact_at(&mut b, off).unwrap();
    for x in &mut b {
        *x ^= 0xa5;
    }
    f.write_all_at(&b, off).unwrap();
}

/// Reads the image through a mount made for the purpose, three opens one after another (each
/// new handle reads from the next replica first); each open's bytes or error.
fn read_through_mount(v: &Vol, tmp: &Path) -> Vec<std::io::Result<Vec<u8>>> {
    let mnt = tmp.join("rmnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let _m = v.mount(&mnt);
    (0..3).map(|_| std::fs::read(mnt.join(IMG))).collect()
}

/// Reads the image through a `kiln nbd` export with qemu-img.
fn read_through_nbd(v: &Vol, tmp: &Path) -> Result<Vec<u8>, String> {
    let sock = tmp.join("nbd.sock");
    let _ = std::fs::remove_file(&sock);
    let (_nbd, uri) = v.nbd(&format!("/{IMG}"), &sock);
    let out = tmp.join("copy.raw");
    let _ = std::fs::remove_file(&out);
    let r = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &uri])
        .arg(&out)
        .output()
        .unwrap();
    if !r.status.success() {
        return Err(String::from_utf8_lossy(&r.stderr).into_owned());
    }
    Ok(std::fs::read(&out).unwrap())
}

/// Each brick's copy of the image, its pieces put together (the base file holds piece 0 and
/// has the whole size).
fn copies(dirs: &[PathBuf]) -> Vec<Vec<u8>> {
    dirs.iter()
        .map(|d| {
            (0..SIZE / MIB)
                .flat_map(|k| {
                    let mut b = std::fs::read(holder(d, k * MIB)).unwrap();
                    b.truncate(MIB);
                    b
                })
                .collect()
        })
        .collect()
}

#[test]
fn damaged_copies_read_right_through_mount_and_nbd_and_heal() {
    if Command::new("qemu-img").arg("--version").output().is_err() {
        println!("skipping: qemu-img is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::created_with(
        tmp.path(),
        "ck",
        3,
        3,
        &["--brick-port-base", "25750"],
        &["--shard", "1M"],
    );
    let dirs: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let want = pattern(SIZE);
    {
        let mnt = tmp.path().join("wmnt");
        std::fs::create_dir_all(&mnt).unwrap();
        let _m = v.mount(&mnt);
        std::fs::write(mnt.join(IMG), &want).unwrap();
        std::fs::File::open(mnt.join(IMG))
            .unwrap()
            .sync_all()
            .unwrap();
    }
    v.mgmt(&["volume", "heal", "ck"]);
    for (i, c) in copies(&dirs).iter().enumerate() {
        let at = c.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            c.len() == want.len() && at.is_none(),
            "brick {i}'s copy before the damage: {} bytes, first difference at {at:?}; files {:?}",
            c.len(),
            brick_files(&dirs[i])
        );
    }

    // Brick 0 (the replica a fresh client's first handle reads first) goes bad in two pieces.
    let places = [4096 * 3 + 7, 4 * MIB + 4096 * 100 + 1000];
    for at in places {
        damage(&dirs[0], at);
    }
    for round in 0.. {
        for (k, r) in read_through_mount(&v, tmp.path()).into_iter().enumerate() {
            let got = r.unwrap_or_else(|e| panic!("round {round}: mount read {k}: {e}"));
            assert!(
                got == want,
                "round {round}: mount read {k} returned wrong bytes"
            );
        }
        let got = read_through_nbd(&v, tmp.path()).unwrap_or_else(|e| panic!("nbd read: {e}"));
        assert!(
            got == want,
            "round {round}: the NBD export returned wrong bytes"
        );
        let info = v.mgmt(&["volume", "heal", "ck", "info"]);
        v.mgmt(&["volume", "heal", "ck"]);
        if copies(&dirs).iter().all(|c| *c == want) {
            break;
        }
        assert!(
            round < places.len(),
            "still damaged after {round} rounds; heal info: {info}"
        );
    }

    // One block damaged on all three: an I/O error where it is, the rest reads.
    let bad = 2 * MIB + 4096 * 9;
    for d in &dirs {
        damage(d, bad + 50);
    }
    let mnt = tmp.path().join("emnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let _m = v.mount(&mnt);
    let f = std::fs::File::open(mnt.join(IMG)).unwrap();
    let mut buf = vec![0u8; 4096];
    let e = f
        .read_exact_at(&mut buf, bad as u64)
        .expect_err("a block damaged everywhere reads");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    for at in [0, bad - 4096, bad + 4096, SIZE - 4096] {
        f.read_exact_at(&mut buf, at as u64)
            .unwrap_or_else(|e| panic!("read at {at}: {e}"));
        assert!(buf == want[at..at + 4096], "read at {at}");
    }
    let nbd_err = read_through_nbd(&v, tmp.path()).expect_err("an NBD copy over the damaged block");
    assert!(
        nbd_err.to_lowercase().contains("input/output error") || nbd_err.contains("error"),
        "{nbd_err}"
    );
}
