//! Exports of an image on a volume graph, not just one brick: `distribute` over two in-process
//! bricks, named by a volfile (`--volfile`) or handed out by a management server for
//! `HOST:PORT:/VOL/PATH`. qemu-img writes and compares through the export; the data lands on
//! the brick that holds the image, and the stack's io-stats point shows in `/metrics`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use std::os::unix::fs::MetadataExt;

use common::{require_tool, run, try_start_config, try_start_export};
use kiln_client::volume::Volfile;
use kiln_client::{block_on, SetAttrs, Volume};
use kiln_nbd::{ExportConfig, ImageSpec};
use kiln_server::Listen;

const MIB: u64 = 1 << 20;

fn dist_volfile(top: &str, socks: &[PathBuf]) -> String {
    let remotes: Vec<String> = socks
        .iter()
        .map(|s| format!("unix:{}", s.display()))
        .collect();
    kiln_testkit::volfile::distribute(top, &remotes)
}

/// Two bricks under `dir`; returns their directories and sockets.
fn two_bricks(dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    bricks(dir, 2)
}

/// `n` bricks under `dir`; returns their directories and sockets.
fn bricks(dir: &Path, n: usize) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let (mut dirs, mut socks) = (Vec::new(), Vec::new());
    for i in 0..n {
        let d = dir.join(format!("brick{i}"));
        std::fs::create_dir(&d).unwrap();
        let s = dir.join(format!("b{i}.sock"));
        kiln_server::spawn_background(&d, &[Listen::Unix(s.clone())]).expect("brick");
        dirs.push(d);
        socks.push(s);
    }
    (dirs, socks)
}

/// Creates `path` through the volume and sizes it (sparse).
fn create_image(volfile: &str, path: &str, size: u64) {
    let v = Volume::from_volfile(&Volfile::parse(volfile).unwrap()).expect("stack");
    let (fd, _) = block_on(v.create(path, libc::O_RDWR, 0o644)).expect("create image");
    block_on(v.setattr(
        path,
        SetAttrs {
            valid: kiln_proto::ops::SETATTR_SIZE,
            size,
            ..Default::default()
        },
    ))
    .expect("size image");
    block_on(v.close(fd)).expect("close");
}

/// A management server in this process that hands out `volfile` for volume `vol`.
fn fake_mgmt(dir: &Path, volfile: String) -> u16 {
    let (tx, rx) = std::sync::mpsc::channel();
    let brick = dir.join("mgmt-brick");
    std::fs::create_dir(&brick).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let handler: kiln_server::control::Handler = Arc::new(move |req: &[u8]| {
                let req: serde_json::Value = serde_json::from_slice(req).unwrap_or_default();
                let reply = if req["cmd"] == "volfile" && req["name"] == "vol" {
                    serde_json::json!({ "ok": true, "volfile": volfile })
                } else {
                    serde_json::json!({ "ok": false, "error": "no such volume", "kind": "not-found" })
                };
                reply.to_string().into_bytes()
            });
            let server =
                kiln_server::Server::bind(&brick, &[Listen::Tcp("127.0.0.1:0".parse().unwrap())])
                    .unwrap()
                    .with_mgmt(handler);
            let port = server
                .local_addrs()
                .iter()
                .find_map(|a| match a {
                    Listen::Tcp(a) => Some(a.port()),
                    _ => None,
                })
                .unwrap();
            tx.send(port).unwrap();
            server.run().await;
        });
    });
    rx.recv().unwrap()
}

fn random_file(path: &Path, len: usize, mut seed: u64) -> Vec<u8> {
    let mut b = vec![0u8; len];
    for c in b.chunks_mut(8) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        c.copy_from_slice(&seed.to_le_bytes()[..c.len()]);
    }
    std::fs::write(path, &b).unwrap();
    b
}

fn brick_copy(dirs: &[PathBuf], path: &str) -> Vec<u8> {
    let on: Vec<&PathBuf> = dirs.iter().filter(|d| d.join(path).exists()).collect();
    assert_eq!(on.len(), 1, "{path} is on exactly one brick");
    std::fs::read(on[0].join(path)).unwrap()
}

#[test]
fn volfile_and_managed_volume_exports() {
    require_tool("qemu-img", "qemu-utils");
    let dir = tempfile::tempdir().unwrap();
    let (dirs, socks) = two_bricks(dir.path());
    let text = dist_volfile("nbdvol", &socks);
    let vf_path = dir.path().join("dist.toml");
    std::fs::write(&vf_path, &text).unwrap();
    create_image(&text, "disk.img", 8 * MIB);
    create_image(&text, "other.img", MIB);

    // kiln nbd --volfile dist.toml disk.img
    let exp = try_start_config(ExportConfig {
        image: ImageSpec::in_volfile("/disk.img", &vf_path).unwrap(),
        volfile: Some(vf_path.clone()),
        listen: format!("unix:{}", dir.path().join("a.nbd").display())
            .parse()
            .unwrap(),
        export_name: None,
        read_only: false,
        lock: Some(Default::default()),
        bitmap: None,
    })
    .expect("export over the volfile");
    assert_eq!(exp.name, "disk.img");
    let src = dir.path().join("src.raw");
    let data = random_file(&src, 8 * MIB as usize, 77);
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&exp.uri));
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&exp.uri));
    assert!(
        brick_copy(&dirs, "disk.img") == data,
        "the brick holds what qemu-img wrote"
    );
    let text_m = kiln_client::volume::layer::metrics::render("kiln-nbd");
    assert!(
        text_m
            .lines()
            .any(|l| l.starts_with("kiln_fop_calls_total{")
                && l.contains("layer=\"nbdvol\"")
                && l.contains("fop=\"write\"")
                && !l.ends_with(" 0")),
        "no write counter of point nbdvol in:\n{text_m}"
    );
    exp.stop();

    // kiln nbd 127.0.0.1:PORT:/vol/disk.img, the volfile from the management server.
    let port = fake_mgmt(dir.path(), text.clone());
    let nbd = format!("unix:{}", dir.path().join("b.nbd").display());
    let exp = try_start_export(&format!("127.0.0.1:{port}:/vol/disk.img"), &nbd, true)
        .expect("export of a managed volume");
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&exp.uri));
    exp.stop();
    let e = try_start_export(&format!("127.0.0.1:{port}:/nosuch/disk.img"), &nbd, true)
        .err()
        .expect("an unknown volume fails");
    assert!(e.to_string().contains("no such volume"), "{e}");
    assert_eq!(e.kind(), kiln_proto::Kind::NotFound, "{e}");
    let e = try_start_export(&format!("127.0.0.1:{port}:/vol/none.img"), &nbd, true)
        .err()
        .expect("a missing image fails");
    assert!(e.to_string().contains("image none.img not found"), "{e}");
    assert_eq!(e.kind(), kiln_proto::Kind::NotFound, "{e}");
}

/// A replica-3 volume over the bricks at `socks`.
fn rep_volfile(socks: &[PathBuf]) -> String {
    let names: Vec<String> = (0..socks.len()).map(|i| format!("\"rep-b{i}\"")).collect();
    let mut v = format!(
        "[[layer]]\nname = \"rep\"\ntype = \"replicate\"\nsubvolumes = [{}]\n",
        names.join(", ")
    );
    for (i, s) in socks.iter().enumerate() {
        v.push_str(&format!(
            "\n[[layer]]\nname = \"rep-b{i}\"\ntype = \"protocol-client\"\nremote = \"unix:{}\"\n",
            s.display()
        ));
    }
    v
}

/// TRIM, and WRITE_ZEROES that may unmap, sent by a real client (qemu-io) to an image on a
/// replica-3 volume, come back as space on every replica's brick; the range reads as zeros
/// and `nbdinfo --map` (block status through replicate) shows it as a hole.
#[test]
fn trim_and_zeroes_free_space_on_every_replica() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdinfo", "libnbd-bin");
    let dir = tempfile::tempdir().unwrap();
    let (dirs, socks) = bricks(dir.path(), 3);
    let text = rep_volfile(&socks);
    let vf_path = dir.path().join("rep.toml");
    std::fs::write(&vf_path, &text).unwrap();
    let size = 64 * MIB;
    create_image(&text, "disk.img", size);
    let exp = try_start_config(ExportConfig {
        image: ImageSpec::in_volfile("/disk.img", &vf_path).unwrap(),
        volfile: Some(vf_path.clone()),
        listen: format!("unix:{}", dir.path().join("r.nbd").display())
            .parse()
            .unwrap(),
        export_name: None,
        read_only: false,
        lock: Some(Default::default()),
        bitmap: None,
    })
    .expect("export over the replica-3 volfile");
    let io = |cmd: &str| {
        run(Command::new("qemu-io")
            .args(["-f", "raw", "--discard=unmap", "-c", cmd])
            .arg(&exp.uri))
    };
    let used = |d: &PathBuf| std::fs::metadata(d.join("disk.img")).unwrap().blocks() * 512;

    io("write -P 0xa5 0 64M");
    for d in &dirs {
        assert!(used(d) >= size, "{} holds {} B", d.display(), used(d));
    }
    io("discard 0 32M");
    io("write -z -u 32M 32M");
    for d in &dirs {
        assert!(used(d) < MIB, "{} still holds {} B", d.display(), used(d));
    }
    io("read -P 0 0 64M");
    let out = run(Command::new("nbdinfo")
        .args(["--map", "--json"])
        .arg(&exp.uri));
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("nbdinfo JSON: {e}\n{out}"));
    let map: Vec<(u64, u64, u64)> = v
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {out}"))
        .iter()
        .map(|e| {
            let f = |k: &str| e[k].as_u64().unwrap();
            (f("offset"), f("length"), f("type"))
        })
        .collect();
    assert_eq!(map, [(0, size, 3)], "one hole, read as zeros: {out}");
    exp.stop();
}
