//! VM images on a managed replica-3 volume, with real processes and real clients: dirty
//! records read as `qemu:dirty-bitmap` by nbdinfo, and the exclusive lock — a second
//! `kiln nbd` refused, a killed holder's lock taken over at once, and a holder cut off from
//! the bricks (its process alive in a network namespace whose link is taken down) fenced: none
//! of its writes lands after the next holder's.
//!
//! One test, in stages, over one volume whose kilnd and bricks listen on the host end of a
//! veth pair the test makes (and removes), so that an export in the namespace at the other end
//! reaches them over a link that can be taken down. Needs root, `ip netns`, qemu-io and
//! nbdinfo; skips (saying why) without namespaces.

use crate::common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::managed::{spawn_until, Proc};
use common::{kill_brick_pid, kiln, mgmt_ok, BrickReaper, Kilnd};
use kiln_testkit::net::Veth as Link;
use serde_json::Value;

const MIB: u64 = 1 << 20;

fn need(tool: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        println!("skipping: {tool} is not installed");
    }
    found
}

struct Image {
    kd: Kilnd,
    state: PathBuf,
    bricks: Vec<PathBuf>,
    /// The key of this host's clients (a pool member's).
    secret: PathBuf,
    /// The key of the host in the namespace (a client host: the pool hosts' key is refused
    /// there).
    host_key: PathBuf,
    /// `SERVER:/VOL/disk.img`.
    src: String,
    tmp: PathBuf,
}

impl Image {
    /// `kiln nbd` of the image on `sock` with `args`, optionally inside namespace `ns`;
    /// returns the export and its URI once it listens.
    fn export(&self, ns: Option<&str>, sock: &str, args: &[&str]) -> (Proc, String) {
        let c = self.nbd_cmd(ns, sock, args);
        let (p, line) = spawn_until(c, "kiln nbd: exporting");
        (p, line.rsplit(" at ").next().unwrap().to_owned())
    }

    fn nbd_cmd(&self, ns: Option<&str>, sock: &str, args: &[&str]) -> Command {
        let mut c = match ns {
            Some(_) => kiln_testkit::net::command_in(ns, env!("CARGO_BIN_EXE_kiln")),
            None => kiln(),
        };
        let key = match ns {
            Some(_) => &self.host_key,
            None => &self.secret,
        };
        c.args(["nbd", &self.src, "--secret-file"])
            .arg(key)
            .arg("--listen")
            .arg(format!("unix:{}", self.tmp.join(sock).display()))
            .args(args)
            .env("KILN_LOG", "info")
            .stderr(std::fs::File::create(self.tmp.join(format!("{sock}.log"))).unwrap());
        c
    }

    fn log(&self, sock: &str) -> String {
        std::fs::read_to_string(self.tmp.join(format!("{sock}.log"))).unwrap_or_default()
    }

    fn kiln_ok(&self, args: &[&str]) -> String {
        let out = kiln()
            .args(args)
            .env("KILN_SECRET_FILE", &self.secret)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kiln {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// `len` bytes at `at` of every replica's copy.
    fn on_bricks(&self, at: u64, len: usize) -> Vec<Vec<u8>> {
        self.bricks
            .iter()
            .map(|b| {
                let f = std::fs::File::open(b.join("disk.img")).unwrap();
                let mut buf = vec![0u8; len];
                f.read_exact_at(&mut buf, at).unwrap();
                buf
            })
            .collect()
    }
}

/// qemu-io on `uri` running `cmds`; `Ok` with stdout, or `Err` with everything it said.
fn qemu_io(uri: &str, cmds: &[&str]) -> Result<String, String> {
    let out = qemu_io_cmd(uri, cmds).output().unwrap();
    qemu_io_result(out)
}

fn qemu_io_cmd(uri: &str, cmds: &[&str]) -> Command {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri);
    c
}

fn qemu_io_result(out: std::process::Output) -> Result<String, String> {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // qemu-io exits 0 even when a command fails; its message says so.
    if out.status.success() && !text.contains("failed") && !text.contains("error") {
        Ok(text)
    } else {
        Err(text)
    }
}

/// The entries of `nbdinfo --map=CONTEXT --json` as (offset, length, type).
fn map(uri: &str, context: &str) -> Vec<(u64, u64, u64)> {
    let out = Command::new("nbdinfo")
        .args([&format!("--map={context}"), "--json", uri])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nbdinfo: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let f = |k: &str| e[k].as_u64().unwrap();
            (f("offset"), f("length"), f("type"))
        })
        .collect()
}

fn kill9(p: &Proc) {
    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
    unsafe { libc::kill(p.0.id() as i32, libc::SIGKILL) };
}

/// A client of volume `img` in this process.
fn volume(kd: &Kilnd) -> kiln_client::Volume {
    let src = kiln_client::volume::Source::Server {
        server: kd.addr.clone(),
        volume: "img".into(),
    };
    kiln_client::Volume::from_source(&src).expect("volume")
}

fn setup(tmp: &Path, link: &Link) -> Image {
    let state = tmp.join("state");
    let mgmt = format!("tcp:{}:0", link.near_ip);
    let kd = Kilnd::start_at(
        &state,
        &mgmt,
        &["--mgmt-plaintext", "--brick-port-base", "25800"],
        &[],
    );
    let bricks: Vec<PathBuf> = (0..3).map(|i| tmp.join(format!("b{i}"))).collect();
    let mut args = vec!["volume", "create", "img", "replica", "3"];
    let specs: Vec<String> = bricks
        .iter()
        .map(|b| format!("{}:{}", link.near_ip, b.display()))
        .collect();
    args.extend(specs.iter().map(String::as_str));
    mgmt_ok(&kd, &state, &args);
    mgmt_ok(&kd, &state, &["volume", "start", "img"]);
    let secret = state.join("vols/img/secret");
    let host_key = tmp.join("hv.key");
    let hk = host_key.to_str().unwrap();
    mgmt_ok(
        &kd,
        &state,
        &[
            "auth",
            "add",
            "hv",
            "--volume",
            "img",
            "--root",
            "--key-file",
            hk,
        ],
    );
    let src = format!("{}:/img/disk.img", kd.addr.trim_start_matches("tcp:"));
    // The image, through a client of the volume: 64 MiB, sparse.
    kiln_client::mgmt::use_secret_file(&secret);
    let v = volume(&kd);
    let (fd, _) = kiln_client::block_on(v.create("disk.img", libc::O_RDWR, 0o644)).unwrap();
    let size = kiln_client::SetAttrs {
        valid: kiln_proto::ops::SETATTR_SIZE,
        size: 64 * MIB,
        ..Default::default()
    };
    kiln_client::block_on(v.fsetattr(&fd, size)).unwrap();
    kiln_client::block_on(v.close(fd)).unwrap();
    Image {
        kd,
        state,
        bricks,
        secret,
        host_key,
        src,
        tmp: tmp.to_owned(),
    }
}

#[test]
fn image_lock_and_dirty_records() {
    if !kiln_testkit::is_root() {
        println!("skipping: network namespaces need root");
        return;
    }
    if !need("qemu-io") || !need("nbdinfo") || !need("ip") {
        return;
    }
    let link = match Link::new("kimg", 79) {
        Ok(l) => l,
        Err(e) => {
            println!("skipping: cannot set up a network namespace: {e}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let img = setup(tmp.path(), &link);
    let _reaper = BrickReaper(img.state.clone());

    dirty_records(&img);
    dirty_records_outlive_a_clean_restart(&img);
    one_writer(&img);
    fenced_when_cut_off(&img, &link);
    let _ = &img.kd;
}

/// Writes of 10 MiB at known offsets after `dirty start` are exactly what the record, and
/// the bitmap context an export offers, list; starting again empties it.
fn dirty_records(img: &Image) {
    img.kiln_ok(&["image", "dirty", "start", &img.src, "daily"]);
    let (exp, uri) = img.export(None, "d.sock", &["--bitmap", "daily"]);
    let writes = [(0, MIB), (8 * MIB, 4 * MIB), (40 * MIB, 5 * MIB)];
    for (at, len) in writes {
        qemu_io(&uri, &[&format!("write -P 0x5a {at} {len}")]).unwrap();
    }
    let dirty: Vec<(u64, u64)> = map(&uri, "qemu:dirty-bitmap:daily")
        .into_iter()
        .filter(|e| e.2 & 1 != 0)
        .map(|e| (e.0, e.1))
        .collect();
    assert_eq!(dirty, writes, "the bitmap lists exactly what was written");
    let shown: Value = serde_json::from_str(
        &img.kiln_ok(&["image", "dirty", "show", &img.src, "daily", "--json"]),
    )
    .unwrap();
    assert_eq!(shown["dirty_bytes"], 10 * MIB);
    assert_eq!(shown["ranges"], serde_json::json!(writes));
    // Allocation still answers beside it.
    assert!(map(&uri, "base:allocation").iter().any(|e| e.2 & 1 != 0));

    img.kiln_ok(&["image", "dirty", "start", &img.src, "daily"]);
    let shown = img.kiln_ok(&["image", "dirty", "show", &img.src, "daily"]);
    assert_eq!(shown, "", "a record started again is empty");
    img.kiln_ok(&["image", "dirty", "stop", &img.src, "daily"]);
    let out = kiln()
        .args(["image", "dirty", "show", &img.src, "daily"])
        .env("KILN_SECRET_FILE", &img.secret)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no dirty record"));
    drop(exp);
}

/// A volume stopped and started again (every brick stopped by SIGTERM) still knows a
/// record and what it holds; bricks that die without a clean stop know none, and a backup
/// is told to copy everything.
fn dirty_records_outlive_a_clean_restart(img: &Image) {
    img.kiln_ok(&["image", "dirty", "start", &img.src, "kept"]);
    let (exp, uri) = img.export(None, "k.sock", &[]);
    let writes = [(2 * MIB, MIB), (20 * MIB, 2 * MIB)];
    for (at, len) in writes {
        qemu_io(&uri, &[&format!("write -P 0x3c {at} {len}")]).unwrap();
    }
    drop(exp);
    mgmt_ok(&img.kd, &img.state, &["volume", "stop", "img", "--yes"]);
    for b in &img.bricks {
        assert!(
            b.join(".kiln/dirty.json").exists(),
            "{} kept nothing",
            b.display()
        );
    }
    mgmt_ok(&img.kd, &img.state, &["volume", "start", "img"]);
    let shown: Value =
        serde_json::from_str(&img.kiln_ok(&["image", "dirty", "show", &img.src, "kept", "--json"]))
            .unwrap();
    assert_eq!(shown["ranges"], serde_json::json!(writes), "{shown}");
    for b in &img.bricks {
        assert!(
            !b.join(".kiln/dirty.json").exists(),
            "{} left its kept records on disk while running",
            b.display()
        );
    }

    let st: Value = serde_json::from_str(&mgmt_ok(
        &img.kd,
        &img.state,
        &["volume", "status", "img", "--json"],
    ))
    .unwrap();
    for b in st["volumes"][0]["bricks"].as_array().unwrap() {
        kill_brick_pid(b["pid"].as_u64().unwrap() as i32);
    }
    mgmt_ok(&img.kd, &img.state, &["volume", "start", "img", "force"]);
    let out = kiln()
        .args(["image", "dirty", "show", &img.src, "kept"])
        .env("KILN_SECRET_FILE", &img.secret)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a record outlived SIGKILL of every brick"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("no dirty record"));
}

/// While an export holds the lock a second one is refused and other clients' writes too; a
/// holder killed with SIGKILL lets the next one in at once.
fn one_writer(img: &Image) {
    let (a, uri_a) = img.export(None, "a.sock", &["--lock-ttl", "2"]);
    let lock: Value =
        serde_json::from_str(&img.kiln_ok(&["image", "lock", &img.src, "--json"])).unwrap();
    assert_eq!(lock["locked"], true, "{lock}");
    assert!(
        lock["holder"].as_str().unwrap().contains("kiln-nbd"),
        "{lock}"
    );

    let mut second = img.nbd_cmd(None, "b.sock", &[]);
    let status = second.stdout(Stdio::null()).status().unwrap();
    assert!(
        !status.success(),
        "a second export of a locked image started"
    );
    assert!(
        img.log("b.sock").contains("locked by another export"),
        "{}",
        img.log("b.sock")
    );
    // Another client of the volume cannot write either.
    let v = volume(&img.kd);
    let fd = kiln_client::block_on(v.open("disk.img", libc::O_RDWR)).unwrap();
    let (r, _) = kiln_client::block_on(v.pwritev(&fd, vec![b"intruder".to_vec()], 0));
    let e = r.unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EBUSY), "{e}");
    kiln_client::block_on(v.close(fd)).unwrap();
    qemu_io(&uri_a, &["write -P 0x11 0 1M"]).unwrap();

    let killed = Instant::now();
    kill9(&a);
    let (b, uri_b) = img.export(None, "b.sock", &["--lock-wait", "10"]);
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "took {took:?}: more than the lease"
    );
    qemu_io(&uri_b, &["write -P 0x12 0 1M", "read -P 0x12 0 1M"]).unwrap();
    println!("lock taken over {took:?} after the holder was killed");
    drop(b);
    drop(a);
}

/// An export cut off from the bricks keeps its process and its queued write; the next export
/// takes the lock once the lease lapses and writes; when the link is back, the old export's
/// write is refused on every replica and what the bricks hold is the new holder's.
fn fenced_when_cut_off(img: &Image, link: &Link) {
    let (a, uri_a) = img.export(Some(&link.ns), "c.sock", &["--lock-ttl", "2"]);
    qemu_io(&uri_a, &["write -P 0x21 0 1M"]).unwrap();
    link.link(false);
    let (tx, rx) = std::sync::mpsc::channel();
    let uri = uri_a.clone();
    std::thread::spawn(move || {
        let _ = tx.send(qemu_io(&uri, &["write -P 0x22 2M 1M"]));
    });
    let cut = Instant::now();
    let (b, uri_b) = img.export(None, "e.sock", &["--lock-wait", "30", "--lock-ttl", "2"]);
    let took = cut.elapsed();
    qemu_io(&uri_b, &["write -P 0x33 2M 1M"]).unwrap();
    link.link(true);
    let late = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the cut-off export's write ends");
    assert!(
        late.is_err(),
        "the cut-off export's write succeeded: {late:?}"
    );
    for (i, got) in img.on_bricks(2 * MIB, MIB as usize).iter().enumerate() {
        assert!(
            got.iter().all(|b| *b == 0x33),
            "replica {i} holds a write of the fenced export"
        );
    }
    for (i, got) in img.on_bricks(0, MIB as usize).iter().enumerate() {
        assert!(got.iter().all(|b| *b == 0x21), "replica {i} lost a write");
    }
    assert!(
        img.log("c.sock").contains("taken over"),
        "the cut-off export did not notice: {}",
        img.log("c.sock")
    );
    println!("lease lapsed and taken over {took:?} after the cut; the late write: {late:?}");
    drop(b);
    drop(a);
}

/// Runs `kiln ARGS` with `env`; it must fail within 5 s (else it is killed and the test
/// fails); returns its stderr.
fn fails_fast(args: &[&str], env: &[(&str, &Path)]) -> String {
    let mut c = kiln();
    c.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let started = Instant::now();
    let mut child = c.spawn().expect("spawn kiln");
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if started.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kiln {args:?} did not return within 5 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "kiln {args:?} succeeded");
    err
}

#[test]
fn commands_pointed_at_the_wrong_kind_of_port_fail_fast_saying_what_they_reached() {
    let tmp = tempfile::tempdir().unwrap();
    let v = common::managed::Vol::new(tmp.path(), "wk", 1, "26760");
    let _reaper = BrickReaper(v.state.clone());
    let mgmt = v.kd.addr.clone();
    let brick = format!(
        "tcp:127.0.0.1:{}",
        v.status()["bricks"][0]["port"].as_u64().unwrap()
    );
    let mgmt_secret = v.state.join("mgmt.secret");
    // A key the management port refuses.
    let wrong = tmp.path().join("wrong.key");
    std::fs::write(&wrong, "0123456789abcdef\n").unwrap();
    // Image commands at a management port, the management port given as a volfile's brick.
    let volfile = tmp.path().join("m.toml");
    std::fs::write(
        &volfile,
        format!(
            "[[layer]]\nname = \"m\"\ntype = \"io-stats\"\nsubvolumes = [\"m-client-0\"]\n\n\
             [[layer]]\nname = \"m-client-0\"\ntype = \"protocol-client\"\nremote = \"{mgmt}\"\n"
        ),
    )
    .unwrap();
    let vf = volfile.to_str().unwrap();
    let spec = format!("{mgmt}:/nope/x.img");
    let image_cmds: [&[&str]; 4] = [
        &["list", "x.img"],
        &["lock", "x.img"],
        &["snapshot", "x.img", "s1"],
        &["clone", "x.img@s1", "y.img"],
    ];
    for cmd in image_cmds {
        let mut a = vec!["image", "--volfile", vf];
        a.extend(cmd);
        let err = fails_fast(&a, &[("KILN_SECRET_FILE", &mgmt_secret)]);
        assert!(
            err.contains("management port, not a brick") && err.contains(vf),
            "{a:?}: {err}"
        );
        let err = fails_fast(&a, &[("KILN_SECRET_FILE", &wrong)]);
        assert!(
            err.contains(&mgmt) && err.contains("secret"),
            "{a:?}: {err}"
        );
        // SERVER:/VOL/PATH at the management port asks it for the volume.
        let mut a = vec!["image", cmd[0]];
        let first = cmd[1].replace("x.img", &spec);
        a.push(&first);
        a.extend(&cmd[2..]);
        let err = fails_fast(&a, &[("KILN_SECRET_FILE", &v.secret)]);
        assert!(
            err.contains("volume nope: no such volume, or this client may not use it"),
            "{a:?}: {err}"
        );
    }
    // The other clients of an image, and the load generator, at the management port.
    let vhost_sock = tmp.path().join("x.vhost");
    let sock = format!("unix:{}", tmp.path().join("x.sock").display());
    let err = fails_fast(
        &[
            "vhost-user-blk",
            "--volfile",
            vf,
            "x.img",
            "--socket",
            vhost_sock.to_str().unwrap(),
        ],
        &[("KILN_SECRET_FILE", &mgmt_secret)],
    );
    assert!(err.contains("management port, not a brick"), "{err}");
    let err = fails_fast(
        &["nbd", "--volfile", vf, "x.img", "--listen", &sock],
        &[("KILN_SECRET_FILE", &mgmt_secret)],
    );
    assert!(err.contains("x.img"), "{err}");
    let err = fails_fast(
        &["bench", "--connect", &mgmt, "--runtime", "1"],
        &[("KILN_SECRET_FILE", &mgmt_secret)],
    );
    assert!(err.contains("management port, not a brick"), "{err}");
    // Volume commands at a brick: with the brick's own secret the brick says it manages no
    // volumes; with the management secret it refuses the secret. Either at once.
    let sd = v.state.to_str().unwrap();
    let vs = v.secret.to_str().unwrap();
    for cmd in [
        &["volume", "info"][..],
        &["volume", "status", "wk"],
        &["volume", "list"],
    ] {
        let mut a = cmd.to_vec();
        a.extend(["--server", &brick, "--mgmt-secret-file", vs]);
        let err = fails_fast(&a, &[]);
        assert!(
            err.contains("does not manage volumes") && err.contains(&brick),
            "{a:?}: {err}"
        );
        let mut a = cmd.to_vec();
        a.extend(["--server", &brick, "--state-dir", sd]);
        let err = fails_fast(&a, &[]);
        assert!(err.contains(&brick), "{a:?}: {err}");
    }
}
