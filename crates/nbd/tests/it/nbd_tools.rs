//! The export driven by real, unpatched NBD clients from Debian: qemu-img (convert and compare
//! a 1 GiB image), nbdinfo (size and block sizes) and fio's nbd engine (random and sequential
//! reads, and random writes with checksum verification).

use crate::common;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Command;

use common::{create_image, require_tool, run, start_brick, start_export, try_start_export};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// xorshift64*: reproducible pseudo-random bytes.
fn fill_random(buf: &mut [u8], mut seed: u64) {
    seed |= 1;
    for chunk in buf.chunks_mut(8) {
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        let v = seed.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Compares two files of equal length chunk by chunk; panics at the first difference.
fn assert_same_files(a: &Path, b: &Path) {
    let (mut fa, mut fb) = (
        File::open(a).expect("open a"),
        File::open(b).expect("open b"),
    );
    let (la, lb) = (fa.metadata().unwrap().len(), fb.metadata().unwrap().len());
    assert_eq!(la, lb, "sizes of {} and {}", a.display(), b.display());
    let mut ba = vec![0u8; 16 << 20];
    let mut bb = vec![0u8; 16 << 20];
    let mut off = 0u64;
    while off < la {
        let n = ((la - off) as usize).min(ba.len());
        fa.read_exact(&mut ba[..n]).unwrap();
        fb.read_exact(&mut bb[..n]).unwrap();
        if ba[..n] != bb[..n] {
            let i = (0..n).find(|&i| ba[i] != bb[i]).unwrap();
            panic!(
                "{} and {} differ at byte {}",
                a.display(),
                b.display(),
                off + i as u64
            );
        }
        off += n as u64;
    }
}

#[test]
fn qemu_img_converts_and_compares_a_1gib_image() {
    require_tool("qemu-img", "qemu-utils");
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, bsock) = start_brick(dir.path());
    std::fs::create_dir(brick.join("images")).unwrap();
    create_image(&bsock, "images/vm.img", GIB);

    // Garbage where the source has a hole: the copy must zero it (WRITE_ZEROES or writes).
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(brick.join("images/vm.img"))
            .unwrap();
        f.seek(SeekFrom::Start(500 * MIB)).unwrap();
        f.write_all(&vec![0xa5u8; 4 << 20]).unwrap();
    }

    // A 1 GiB sparse source: data regions (aligned, unaligned, larger than the 32 MiB maximum
    // request, at both ends) with holes between them.
    let src = dir.path().join("src.img");
    {
        let mut f = File::create(&src).unwrap();
        f.set_len(GIB).unwrap();
        let regions: &[(u64, usize)] = &[
            (0, MIB as usize),
            (100 * MIB + 12345, 7 * MIB as usize + 333),
            (300 * MIB, 40 * MIB as usize),
            (700 * MIB + 4096, 16 * MIB as usize),
            (GIB - 3 * MIB, 3 * MIB as usize),
        ];
        for (i, &(off, len)) in regions.iter().enumerate() {
            let mut b = vec![0u8; len];
            fill_random(&mut b, 0x1234_5678 + i as u64);
            f.seek(SeekFrom::Start(off)).unwrap();
            f.write_all(&b).unwrap();
        }
        for k in 0..20u64 {
            let mut b = vec![0u8; 700];
            fill_random(&mut b, 99 + k);
            f.seek(SeekFrom::Start(k * 50 * MIB + 7 + k * 511)).unwrap();
            f.write_all(&b).unwrap();
        }
    }

    let exp = start_export(
        &format!("unix:{}:/vol/images/vm.img", bsock.display()),
        &dir.path().join("nbd.sock"),
        false,
    );
    assert!(
        exp.uri.starts_with("nbd+unix:///images/vm.img?socket="),
        "{}",
        exp.uri
    );

    let t = std::time::Instant::now();
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&exp.uri));
    eprintln!("qemu-img convert of 1 GiB: {:?}", t.elapsed());
    let t = std::time::Instant::now();
    let out = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&exp.uri));
    eprintln!(
        "qemu-img compare of 1 GiB: {:?}: {}",
        t.elapsed(),
        out.trim()
    );
    assert!(out.contains("identical"), "qemu-img compare said {out:?}");

    let info = run(Command::new("qemu-img")
        .args(["info", "--output=json", "-f", "raw"])
        .arg(&exp.uri));
    let v: serde_json::Value = serde_json::from_str(&info).expect("qemu-img info JSON");
    assert_eq!(v["virtual-size"].as_u64(), Some(GIB), "{info}");

    exp.stop();
    assert_same_files(&src, &brick.join("images/vm.img"));
}

#[test]
fn nbdinfo_reports_size_and_block_sizes() {
    require_tool("nbdinfo", "libnbd-bin");
    let dir = tempfile::tempdir().expect("tempdir");
    let (_brick, bsock) = start_brick(dir.path());
    create_image(&bsock, "disk.raw", 64 * MIB + 512);
    let exp = start_export(
        &format!("unix:{}:/myvol/disk.raw", bsock.display()),
        &dir.path().join("nbd.sock"),
        false,
    );

    let out = run(Command::new("nbdinfo").arg("--json").arg(&exp.uri));
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{out}"));
    let e = &v["exports"][0];
    assert_eq!(e["export-name"].as_str(), Some("disk.raw"), "{out}");
    assert_eq!(e["export-size"].as_u64(), Some(64 * MIB + 512), "{out}");
    assert_eq!(e["block_size_minimum"].as_u64(), Some(1), "{out}");
    assert_eq!(e["block_size_preferred"].as_u64(), Some(4096), "{out}");
    assert_eq!(e["block_size_maximum"].as_u64(), Some(32 * MIB), "{out}");
    assert_eq!(e["is_read_only"].as_bool(), Some(false), "{out}");
    assert_eq!(e["can_multi_conn"].as_bool(), Some(true), "{out}");
    assert_eq!(e["can_flush"].as_bool(), Some(true), "{out}");
    assert_eq!(e["can_trim"].as_bool(), Some(true), "{out}");
    assert_eq!(e["can_zero"].as_bool(), Some(true), "{out}");
    let desc = e["description"].as_str().unwrap_or_default();
    assert!(desc.contains("myvol") && desc.contains("disk.raw"), "{out}");

    // The plain form and the export list work too.
    let out = run(Command::new("nbdinfo").arg(&exp.uri));
    assert!(out.contains("67109376"), "{out}");
    let sock = exp.sock.display().to_string();
    let out = run(Command::new("nbdinfo")
        .arg("--list")
        .arg(format!("nbd+unix:///?socket={sock}")));
    assert!(out.contains("disk.raw"), "{out}");

    // And over TCP.
    let tcp = try_start_export(
        &format!("unix:{}:/myvol/disk.raw", bsock.display()),
        "tcp:127.0.0.1:0",
        true,
    )
    .unwrap();
    let out = run(Command::new("nbdinfo").arg("--json").arg(&tcp.uri));
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{out}"));
    assert_eq!(
        v["exports"][0]["export-size"].as_u64(),
        Some(64 * MIB + 512),
        "{out}"
    );
    assert_eq!(
        v["exports"][0]["is_read_only"].as_bool(),
        Some(true),
        "{out}"
    );
}

/// Runs fio's nbd engine with `args` in `dir` (where fio may leave state files); returns the
/// job's JSON after checking it had no errors.
fn fio(dir: &Path, uri: &str, args: &[&str]) -> serde_json::Value {
    let out = run(Command::new("fio")
        .current_dir(dir)
        .args([
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--name=x",
            "--output-format=json",
        ])
        .args(args));
    // fio may print warnings before the JSON.
    let json = &out[out.find('{').unwrap_or(0)..];
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("fio JSON: {e}\n{out}"));
    let job = v["jobs"][0].clone();
    assert_eq!(
        job["error"].as_u64(),
        Some(0),
        "fio {args:?} reported an error:\n{out}"
    );
    job
}

#[test]
fn fio_nbd_engine_reads_and_verifies_writes() {
    require_tool("fio", "fio");
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, bsock) = start_brick(dir.path());
    create_image(&bsock, "fio.img", 256 * MIB);
    // Real data to read, not a hole.
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(brick.join("fio.img"))
            .unwrap();
        let mut b = vec![0u8; 256 * MIB as usize];
        fill_random(&mut b, 7);
        f.write_all(&b).unwrap();
    }
    let exp = start_export(
        &format!("unix:{}:/vol/fio.img", bsock.display()),
        &dir.path().join("nbd.sock"),
        false,
    );

    let rr = fio(
        dir.path(),
        &exp.uri,
        &[
            "--rw=randread",
            "--bs=4k",
            "--iodepth=32",
            "--runtime=3",
            "--time_based",
        ],
    );
    let (io, iops) = (
        rr["read"]["io_bytes"].as_u64().unwrap_or(0),
        rr["read"]["iops"].as_f64().unwrap_or(0.0),
    );
    eprintln!("fio nbd randread 4k QD32: {iops:.0} IOPS");
    assert!(io > 0, "randread moved no data: {rr}");

    let sr = fio(
        dir.path(),
        &exp.uri,
        &[
            "--rw=read",
            "--bs=128k",
            "--iodepth=32",
            "--runtime=3",
            "--time_based",
        ],
    );
    let (io, bw) = (
        sr["read"]["io_bytes"].as_u64().unwrap_or(0),
        sr["read"]["bw_bytes"].as_f64().unwrap_or(0.0),
    );
    eprintln!("fio nbd read 128k QD32: {:.0} MB/s", bw / 1e6);
    assert!(io > 0, "sequential read moved no data: {sr}");

    // Writes, then fio reads every block back and checks its crc32c.
    let vw = fio(
        dir.path(),
        &exp.uri,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=32m",
            "--verify=crc32c",
            "--verify_fatal=1",
        ],
    );
    assert!(
        vw["write"]["io_bytes"].as_u64().unwrap_or(0) >= 32 * MIB,
        "randwrite: {vw}"
    );
    assert!(
        vw["read"]["io_bytes"].as_u64().unwrap_or(0) >= 32 * MIB,
        "verify pass read nothing: {vw}"
    );
}

/// `nbdinfo --map` (`base:allocation` through `NBD_CMD_BLOCK_STATUS`) shows the image's real
/// extents: data where it was written on the brick, holes elsewhere, ending at the image's end.
#[test]
fn nbdinfo_maps_data_and_holes() {
    require_tool("nbdinfo", "libnbd-bin");
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, bsock) = start_brick(dir.path());
    let size = 64 * MIB;
    create_image(&bsock, "disk.raw", size);
    let data = [(4 * MIB, MIB), (40 * MIB, 64 << 10), (size - 8192, 8192)];
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(brick.join("disk.raw"))
        .expect("image on the brick");
    for (at, len) in data {
        std::os::unix::fs::FileExt::write_all_at(&f, &vec![0xa5; len as usize], at).unwrap();
    }
    f.sync_all().unwrap();
    let exp = start_export(
        &format!("unix:{}:/v/disk.raw", bsock.display()),
        &dir.path().join("nbd.sock"),
        true,
    );

    let out = run(Command::new("nbdinfo")
        .args(["--map", "--json"])
        .arg(&exp.uri));
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{out}"));
    let mut at = 0;
    let mut found = Vec::new();
    for e in v.as_array().unwrap_or_else(|| panic!("not a list: {out}")) {
        let (off, len, kind) = (
            e["offset"].as_u64().unwrap(),
            e["length"].as_u64().unwrap(),
            e["type"].as_u64().unwrap(),
        );
        assert_eq!(off, at, "extents are consecutive: {out}");
        match kind {
            0 => found.push((off, len)),
            3 => {}
            k => panic!("type {k} (neither data nor hole+zero): {out}"),
        }
        at += len;
    }
    assert_eq!(at, size, "the map covers the image: {out}");
    assert_eq!(found, data, "data exactly where written: {out}");

    // The context is listed with the export.
    let out = run(Command::new("nbdinfo")
        .arg("--list")
        .arg("--json")
        .arg(&exp.uri));
    assert!(out.contains("base:allocation"), "{out}");
}
