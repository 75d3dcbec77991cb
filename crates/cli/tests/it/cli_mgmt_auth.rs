//! The management port requires the management secret: a real management kilnd (`kiln server`
//! without `--brick`), the real `kiln volume` command and raw clients on real sockets.
//!
//! Without the secret, or with a wrong one, `kiln volume` is refused with a message saying what
//! to do, nothing changes, and kilnd logs the refused peer; with the secret kilnd created in its
//! state directory it works. A raw client that proves nothing can fetch a client volfile (no
//! secret in it) and nothing else: no command, the kilnd-to-kilnd ones included, hands it a
//! volume's secret or changes anything.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use kiln_client::mgmt;
use kiln_proto::codec::Wire;
use kiln_proto::frame::{Header, HEADER_LEN};
use kiln_proto::ops::{AuthReq, HelloReply, HelloReq, MgmtReq, PathReq};
use kiln_proto::Op;
use serde_json::{json, Value};

use crate::common;
#[path = "mgmt_auth/identities.rs"]
mod identities;
use common::{fails, fails_env, ok, run, status, BrickReaper, Kilnd};

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn read_secret(p: &Path) -> Vec<u8> {
    std::fs::read_to_string(p)
        .unwrap()
        .trim()
        .as_bytes()
        .to_vec()
}

#[test]
fn kiln_volume_needs_the_management_secret() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(&state, &[]);
    let a = kd.addr.as_str();
    let sd = state.to_str().unwrap();

    // First start made the secret: 64 hex digits, mode 0600.
    let secret_path = state.join("mgmt.secret");
    assert_eq!(
        mode(&secret_path),
        0o600,
        "the management secret is private"
    );
    let secret = read_secret(&secret_path);
    assert_eq!(secret.len(), 64);
    assert!(secret.iter().all(u8::is_ascii_hexdigit));

    let brick = tmp.path().join("b1");
    let bspec = format!("127.0.0.1:{}", brick.display());
    // A state directory without a secret: what a user on another host has.
    let nowhere = tmp.path().join("nowhere");
    std::fs::create_dir(&nowhere).unwrap();
    let nw = nowhere.to_str().unwrap();

    // No secret: refused, with what to do; nothing was created; kilnd logs the peer.
    let err = fails(&[
        "volume",
        "create",
        "vol",
        &bspec,
        "--server",
        a,
        "--state-dir",
        nw,
    ]);
    assert!(
        err.contains("volume create: vol: failed")
            && err.contains("needs the management secret")
            && err.contains(&format!("{nw}/mgmt.secret"))
            && err.contains("run kiln as root")
            && err.contains("--mgmt-secret-file"),
        "{err}"
    );
    assert!(
        !state.join("vols/vol").exists(),
        "the volume was not created"
    );
    assert!(!brick.exists(), "nor its brick directory");
    kd.wait_log(&["refused", "\"create\"", "127.0.0.1:"]);
    for args in [
        vec!["volume", "list"],
        vec!["volume", "info"],
        vec!["volume", "status"],
        vec!["volume", "start", "vol"],
        vec!["volume", "stop", "vol", "--yes"],
        vec!["volume", "delete", "vol", "--yes"],
    ] {
        let mut full = args.clone();
        full.extend(["--server", a, "--state-dir", nw]);
        let err = fails(&full);
        assert!(
            err.contains("needs the management secret"),
            "{args:?}: {err}"
        );
    }

    // A wrong secret, given by option or by environment: refused; kilnd logs the peer.
    let wrong = tmp.path().join("wrong.secret");
    std::fs::write(&wrong, format!("{}\n", "ab".repeat(32))).unwrap();
    let ws = wrong.to_str().unwrap();
    let err = fails(&[
        "volume",
        "create",
        "vol",
        &bspec,
        "--server",
        a,
        "--mgmt-secret-file",
        ws,
    ]);
    assert!(
        err.contains("refused the management secret: wrong secret")
            && err.contains(&format!(
                "{ws} does not hold this kilnd's management secret"
            )),
        "{err}"
    );
    kd.wait_log(&["failed authentication", "127.0.0.1:"]);
    let err = fails_env(
        &["volume", "list", "--server", a, "--state-dir", sd],
        &[("KILN_MGMT_SECRET_FILE", &wrong)],
    );
    assert!(err.contains("wrong secret"), "the variable wins: {err}");
    assert!(
        !state.join("vols/vol").exists(),
        "the volume was not created"
    );
    // A secret file named explicitly must be readable.
    let missing = tmp.path().join("missing.secret");
    let err = fails(&[
        "volume",
        "list",
        "--server",
        a,
        "--mgmt-secret-file",
        missing.to_str().unwrap(),
    ]);
    assert!(err.contains("cannot read secret file"), "{err}");

    // The right secret, from the kilnd's state directory: everything works.
    let out = ok(&[
        "volume",
        "create",
        "vol",
        &bspec,
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(out.contains("volume create: vol: success"), "{out}");
    assert!(brick.is_dir());
    ok(&["volume", "start", "vol", "--server", a, "--state-dir", sd]);
    assert_eq!(
        ok(&["volume", "list", "--server", a, "--state-dir", sd]).trim(),
        "vol"
    );
    // The same file by option and by environment.
    let sp = secret_path.to_str().unwrap();
    ok(&[
        "volume",
        "info",
        "vol",
        "--server",
        a,
        "--mgmt-secret-file",
        sp,
    ]);
    let out = run(
        &["volume", "status", "vol", "--server", a, "--state-dir", nw],
        &[("KILN_MGMT_SECRET_FILE", &secret_path)],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A client volfile (what `kiln mount HOST:/VOL` fetches) is handed to a client that proves
    // the volume's secret (or an identity allowed on it), not to one without; it holds no
    // secret.
    let vol_secret = std::fs::read_to_string(state.join("vols/vol/secret")).unwrap();
    let err = fails(&["volume", "volfile", "vol", "--server", a, "--state-dir", nw]);
    assert!(
        err.contains("no such volume, or this client may not use it"),
        "{err}"
    );
    let vf = ok(&["volume", "volfile", "vol", "--server", a, "--state-dir", sd]);
    assert!(vf.contains("protocol-client"), "{vf}");
    assert!(!vf.contains(vol_secret.trim()) && !vf.contains(std::str::from_utf8(&secret).unwrap()));
    let key = mgmt::Key::from_file_text(vol_secret.trim().as_bytes());
    let v = mgmt::fetch_volfile_with(a, "vol", Some(&key)).unwrap();
    assert_eq!(v.layers.len(), 2);
    let wrong = mgmt::Key::from_file_text("ab".repeat(32).as_bytes());
    assert!(mgmt::fetch_volfile_with(a, "vol", Some(&wrong)).is_err());
    assert!(mgmt::fetch_volfile_with(a, "vol", None).is_err());

    // Stop and delete with the secret; without it the volume stays started.
    assert!(fails(&[
        "volume",
        "stop",
        "vol",
        "--yes",
        "--server",
        a,
        "--state-dir",
        nw
    ])
    .contains("needs the management secret"));
    assert!(ok(&["volume", "info", "vol", "--server", a, "--state-dir", sd]).contains("Started"));
    ok(&[
        "volume",
        "stop",
        "vol",
        "--yes",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    ok(&[
        "volume",
        "delete",
        "vol",
        "--yes",
        "--server",
        a,
        "--state-dir",
        sd,
    ]);
    assert!(!state.join("vols/vol").exists());
}

#[test]
fn kilnd_takes_its_secret_from_mgmt_secret_file() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let shared = tmp.path().join("cluster.secret");
    let kd = Kilnd::start(&state, &["--mgmt-secret-file", shared.to_str().unwrap()]);
    let a = kd.addr.as_str();
    let sd = state.to_str().unwrap();
    assert_eq!(mode(&shared), 0o600, "created, private");
    assert!(
        !state.join("mgmt.secret").exists(),
        "no second secret in the state directory"
    );
    let err = fails(&["volume", "list", "--server", a, "--state-dir", sd]);
    assert!(err.contains("needs the management secret"), "{err}");
    ok(&[
        "volume",
        "list",
        "--server",
        a,
        "--mgmt-secret-file",
        shared.to_str().unwrap(),
    ]);
    // An existing file is used as it is (how hosts of a cluster share one).
    drop(kd);
    let before = read_secret(&shared);
    let kd = Kilnd::start(&state, &["--mgmt-secret-file", shared.to_str().unwrap()]);
    assert_eq!(read_secret(&shared), before);
    ok(&[
        "volume",
        "list",
        "--server",
        kd.addr.as_str(),
        "--mgmt-secret-file",
        shared.to_str().unwrap(),
    ]);
}

/// A raw connection to a management port: frames by hand, no library in between.
struct Raw {
    sock: TcpStream,
    id: u64,
}

impl Raw {
    fn connect(addr: &str) -> Raw {
        let sock = TcpStream::connect(addr.strip_prefix("tcp:").unwrap_or(addr)).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Raw { sock, id: 0 }
    }

    /// One request; the reply's status, arguments and payload, or None when the server closed
    /// the connection.
    fn send(&mut self, op: Op, args: &[u8]) -> Option<(u32, Vec<u8>, Vec<u8>)> {
        self.id += 1;
        let mut f = Header::request(op as u16, self.id, args.len() as u32, 0)
            .to_bytes()
            .to_vec();
        f.extend_from_slice(args);
        self.sock.write_all(&f).ok()?;
        let mut h = [0u8; HEADER_LEN];
        self.sock.read_exact(&mut h).ok()?;
        let h = Header::parse(&h).unwrap();
        let alen = h.args_len.get() as usize;
        let mut rest = vec![0u8; alen + h.payload_len.get() as usize];
        self.sock.read_exact(&mut rest).ok()?;
        let payload = rest.split_off(alen);
        Some((h.status.get(), rest, payload))
    }

    /// A MGMT request; the reply's raw JSON bytes.
    fn mgmt(&mut self, req: &Value) -> Vec<u8> {
        let args = MgmtReq {
            json: req.to_string().into_bytes(),
        }
        .to_wire();
        let (status, _, payload) = self.send(Op::Mgmt, &args).expect("a MGMT reply");
        assert_eq!(status, 0, "{req}");
        payload
    }

    fn hello(&mut self) -> HelloReply {
        let req = HelloReq {
            version: kiln_proto::frame::VERSION as u32,
            client: "raw".into(),
            metrics: String::new(),
        };
        let (status, args, _) = self.send(Op::Hello, &req.to_wire()).unwrap();
        assert_eq!(status, 0);
        HelloReply::from_wire(&args).unwrap()
    }

    /// True when the server has closed the connection.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.sock.read(&mut b), Ok(0) | Err(_))
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn an_unauthenticated_client_gets_no_volume_secret() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(&state, &[]);
    let a = kd.addr.as_str();
    let secret = read_secret(&state.join("mgmt.secret"));
    let brick = tmp.path().join("b1");
    let bspec = format!("127.0.0.1:{}", brick.display());
    let authed = |req: Value| mgmt::call_with_secret(a, &req, Some(&secret));
    authed(json!({ "cmd": "create", "name": "vol", "bricks": [bspec] })).unwrap();
    authed(json!({ "cmd": "start", "name": "vol" })).unwrap();
    let vol_secret = read_secret(&state.join("vols/vol/secret"));
    let info = || authed(json!({ "cmd": "info", "name": "vol" })).unwrap();
    let def_before = info();
    let def = def_before["volumes"][0].clone();

    // A forged copy that names this client the authority, with a secret of its choosing.
    let mut forged = def.clone();
    forged["authority"] = json!("tcp:127.0.0.1:9");
    let mut evil = forged.clone();
    evil["name"] = json!("evil");
    let planted = "cd".repeat(32);
    let cmds = [
        json!({ "cmd": "create", "name": "other", "bricks": [format!("127.0.0.1:{}/x", tmp.path().display())] }),
        json!({ "cmd": "start", "name": "vol", "force": true }),
        json!({ "cmd": "stop", "name": "vol" }),
        json!({ "cmd": "delete", "name": "vol" }),
        json!({ "cmd": "info", "name": "vol" }),
        json!({ "cmd": "info" }),
        json!({ "cmd": "list" }),
        json!({ "cmd": "status", "name": "vol" }),
        json!({ "cmd": "peer-sync", "def": forged, "secret": planted }),
        json!({ "cmd": "peer-sync", "def": evil, "secret": planted }),
        json!({ "cmd": "brick-start", "def": forged, "index": 0, "secret": planted }),
        json!({ "cmd": "brick-stop", "name": "vol", "index": 0 }),
        json!({ "cmd": "pool-write", "change": { "op": "put", "key": "secret/vol", "value": planted } }),
        json!({ "cmd": "raft", "to": 1, "rpc": "vote", "body": {} }),
        json!({ "cmd": "pool-join", "prepare": true }),
        json!({ "cmd": "pool-leave", "id": 1 }),
        json!({ "cmd": "pool-list" }),
        json!({ "cmd": "peer-probe", "host": "127.0.0.1:9" }),
        json!({ "cmd": "peer-detach", "host": "127.0.0.1" }),
        json!({ "cmd": "secret", "name": "vol" }),
        json!({ "name": "vol" }),
    ];
    // Without HELLO, and after a HELLO with no AUTH: every command but volfile is refused.
    for hello_first in [false, true] {
        let mut raw = Raw::connect(a);
        if hello_first {
            let h = raw.hello();
            assert!(
                h.auth_required && h.nonce.len() == 32,
                "kilnd asks for the secret"
            );
        }
        for req in &cmds {
            let reply = raw.mgmt(req);
            assert!(
                !contains(&reply, &vol_secret) && !contains(&reply, &secret),
                "{req} revealed a secret"
            );
            let v: Value = serde_json::from_slice(&reply).unwrap();
            assert_eq!(v["ok"], false, "{req}: {v}");
            assert_eq!(v["auth_required"], true, "{req}: {v}");
            assert!(
                v["error"]
                    .as_str()
                    .unwrap()
                    .contains("needs the management secret"),
                "{v}"
            );
        }
        // Not even the client graph: a volume that exists and one that does not get the same
        // answer, with no address in it.
        let reply = raw.mgmt(&json!({ "cmd": "volfile", "name": "vol" }));
        let none = raw.mgmt(&json!({ "cmd": "volfile", "name": "nothing" }));
        let v: Value = serde_json::from_slice(&reply).unwrap();
        let n: Value = serde_json::from_slice(&none).unwrap();
        assert_eq!(v["ok"], false, "{v}");
        assert!(!contains(&reply, b"127.0.0.1"), "{v}");
        assert_eq!(
            v["error"]
                .as_str()
                .unwrap()
                .replace("volume vol:", "volume X:"),
            n["error"]
                .as_str()
                .unwrap()
                .replace("volume nothing:", "volume X:"),
            "an existing volume and a missing one look alike"
        );
        // Any other fop (here a profile report, then a lookup) ends the connection.
        let (status, _, _) = raw
            .send(
                Op::Profile,
                &kiln_proto::ops::ProfileReq {
                    cmd: kiln_proto::ops::PROFILE_INFO,
                }
                .to_wire(),
            )
            .unwrap();
        assert_eq!(status, libc::EACCES as u32);
        assert!(raw.closed(), "refused fops close the connection");
        let mut raw = Raw::connect(a);
        let args = PathReq { path: "/".into() }.to_wire();
        assert_eq!(raw.send(Op::Lookup, &args).unwrap().0, libc::EACCES as u32);
    }
    // A wrong proof: refused and closed.
    let mut raw = Raw::connect(a);
    let h = raw.hello();
    let nonce = [7u8; 32];
    let proof = kiln_proto::auth::mac(
        b"not the secret",
        &kiln_proto::auth::client_transcript(&h.nonce, &nonce, ""),
    );
    let req = AuthReq {
        client_nonce: nonce.to_vec(),
        proof,
        identity: String::new(),
    };
    assert_eq!(
        raw.send(Op::Auth, &req.to_wire()).unwrap().0,
        libc::EACCES as u32
    );
    assert!(raw.closed());

    // Nothing changed: the definition, the secret, no planted volume, the brick still runs.
    assert_eq!(info(), def_before);
    assert_eq!(read_secret(&state.join("vols/vol/secret")), vol_secret);
    assert!(!state.join("vols/evil").exists());
    assert!(!state.join("vols/other").exists());
    let st = authed(json!({ "cmd": "status", "name": "vol" })).unwrap();
    assert_eq!(st["volumes"][0]["bricks"][0]["online"], true, "{st}");
    let log = kd.wait_log(&["refused", "\"peer-sync\"", "127.0.0.1:"]);
    assert!(log.contains("\"brick-start\""), "{log}");
}

/// Two tenants of one volume, each confined to its subtree, through a FUSE mount and
/// `kiln nbd`: each reaches only its own files, the read-only one writes nothing, neither makes
/// devices, root files or anything in `.kiln`; removing one fails its mount's I/O while the
/// other's goes on.
#[test]
fn two_tenants_through_a_mount_and_nbd() {
    use common::managed::Vol;
    use std::os::unix::fs::MetadataExt;

    let tmp = tempfile::tempdir().unwrap();
    let vol = Vol::new(tmp.path(), "tt", 1, "26900");
    let _reaper = BrickReaper(vol.state.clone());
    let (k1, k2) = (tmp.path().join("t1.key"), tmp.path().join("t2.key"));
    let (k1s, k2s) = (k1.to_str().unwrap(), k2.to_str().unwrap());
    for args in tenants("tt", k1s, k2s) {
        vol.mgmt(&args);
    }
    let brick = tmp.path().join("b0");
    for (d, id) in [("t1", 1001), ("t2", 1002)] {
        std::fs::create_dir(brick.join(d)).unwrap();
        std::os::unix::fs::chown(brick.join(d), Some(id), Some(id)).unwrap();
    }
    std::fs::write(brick.join("t2/data"), b"two").unwrap();
    std::fs::write(brick.join("t1/disk.img"), vec![7u8; 1 << 20]).unwrap();
    std::os::unix::fs::chown(brick.join("t1/disk.img"), Some(1001), Some(1001)).unwrap();

    let (m1, m2) = (tmp.path().join("m1"), tmp.path().join("m2"));
    std::fs::create_dir(&m1).unwrap();
    std::fs::create_dir(&m2).unwrap();
    let mount1 = vol.mount_as(&m1, &k1);
    let _mount2 = vol.mount_as(&m2, &k2);
    let kind = |r: std::io::Result<()>| r.unwrap_err().raw_os_error();

    // t1: its subtree, as its user, whoever asks on the client (the test runs as root).
    std::fs::write(m1.join("t1/new"), b"mine").expect("t1 writes in /t1");
    assert_eq!(std::fs::metadata(brick.join("t1/new")).unwrap().uid(), 1001);
    assert_eq!(
        kind(std::fs::read_dir(&m1).map(|_| ())),
        Some(libc::EACCES),
        "the root"
    );
    assert_eq!(
        kind(std::fs::read(m1.join("t2/data")).map(|_| ())),
        Some(libc::EACCES)
    );
    assert!(std::fs::metadata(m1.join(".kiln")).is_err());
    let dev =
        std::ffi::CString::new(m1.join("t1/null").into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a plain system call on a NUL-terminated path.
    let r = unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    assert_eq!(
        (r, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::EPERM))
    );
    assert!(!brick.join("t1/null").exists());
    // A set-ID file is its own user's, never root's.
    std::fs::write(m1.join("t1/suid"), b"#!").unwrap();
    std::fs::set_permissions(
        m1.join("t1/suid"),
        std::os::unix::fs::PermissionsExt::from_mode(0o4755),
    )
    .unwrap();
    assert_eq!(
        std::fs::metadata(brick.join("t1/suid")).unwrap().uid(),
        1001
    );

    // t2: reads its data, writes nothing.
    assert_eq!(std::fs::read(m2.join("t2/data")).unwrap(), b"two");
    assert_eq!(
        kind(std::fs::write(m2.join("t2/x"), b"x")),
        Some(libc::EROFS)
    );
    assert_eq!(
        kind(std::fs::read(m2.join("t1/new")).map(|_| ())),
        Some(libc::EACCES)
    );

    // kiln nbd: t1 exports its image; t2 cannot export it.
    let s1 = tmp.path().join("t1.nbd");
    let (nbd1, line) =
        common::managed::spawn_until(vol.nbd_cmd("/t1/disk.img", &s1, &k1), "kiln nbd: exporting");
    let uri = line.rsplit(" at ").next().unwrap().to_owned();
    let info = std::process::Command::new("nbdinfo")
        .args(["--size", &uri])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&info.stdout).trim(),
        "1048576",
        "nbdinfo {uri}: {}",
        String::from_utf8_lossy(&info.stderr)
    );
    drop(nbd1);
    let out = vol
        .nbd_cmd("/t1/disk.img", &tmp.path().join("t2.nbd"), &k2)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success(), "t2 exported t1's image");

    // Removing t1: its mount's I/O fails within a second; t2's goes on.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(m1.join("t1/new"))
        .unwrap();
    let t0 = std::time::Instant::now();
    vol.mgmt(&["auth", "rm", "t1"]);
    loop {
        use std::os::unix::fs::FileExt;
        if f.write_at(b"mine", 0).is_err() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "t1's mount still writes after rm"
        );
    }
    assert_eq!(std::fs::read(m2.join("t2/data")).unwrap(), b"two");
    assert_eq!(std::fs::read(brick.join("t1/new")).unwrap(), b"mine");
    drop(f);
    drop(mount1);
}

/// `kiln auth add` of two tenants of `vol`: t1 read-write in /t1 as 1001, t2 read-only in /t2
/// as 1002, their keys written to `k1` and `k2`.
fn tenants<'a>(vol: &'a str, k1: &'a str, k2: &'a str) -> [Vec<&'a str>; 2] {
    [
        vec!["auth", "add", "t1", "--volume", vol, "--subtree", "/t1"],
        vec![
            "auth",
            "add",
            "t2",
            "--volume",
            vol,
            "--subtree",
            "/t2",
            "--read-only",
        ],
    ]
    .map(|mut a| {
        let (id, key) = if a[2] == "t1" {
            ("1001:1001", k1)
        } else {
            ("1002:1002", k2)
        };
        a.extend(["--as", id, "--key-file", key]);
        a
    })
}

/// docs/security.md's `kiln auth` walk-through, run as written (its key paths moved into a
/// temporary directory, and this kilnd's address added): every command succeeds, and what
/// the guide says of each holds.
#[test]
fn the_security_guides_commands_work_as_written() {
    let guide = std::fs::read_to_string(
        std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo test sets CARGO_MANIFEST_DIR"),
        )
        .join("../../docs/security.md"),
    )
    .expect("docs/security.md");
    let block = guide
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the guide's first sh block");
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let kd = Kilnd::start(&state, &[]);
    let (a, sd) = (kd.addr.as_str(), state.to_str().unwrap());
    let dir = tmp.path().to_str().unwrap().to_owned();
    let mut ran = 0;
    for line in block.lines() {
        let line = line.split(" #").next().unwrap().trim();
        if line.is_empty() {
            continue;
        }
        // Words, with '…' quoting (all the guide uses).
        let mut words: Vec<String> = Vec::new();
        let mut quoted = false;
        let mut cur = String::new();
        for c in line.chars() {
            match c {
                '\'' => quoted = !quoted,
                ' ' if !quoted => {
                    if !cur.is_empty() {
                        words.push(std::mem::take(&mut cur));
                    }
                }
                c => cur.push(c),
            }
        }
        words.push(cur);
        assert_eq!(words[0], "kiln", "{line}");
        let mut args: Vec<String> = words[1..]
            .iter()
            .map(|w| match w.strip_prefix("/etc/kiln/") {
                Some(f) => format!("{dir}/{f}"),
                None if w.ends_with(".key") => format!("{dir}/{w}"),
                None => w.clone(),
            })
            .collect();
        args.extend(["--server", a, "--state-dir", sd].map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ok(&args);
        match &args[..2] {
            ["auth", "list"] => {
                assert!(
                    out.contains("hv1") && out.contains("t2") && out.contains("ops"),
                    "{out}"
                );
                assert!(!out.contains("key"), "list shows no keys: {out}");
            }
            ["auth", "add" | "get" | "rotate"] if args.contains(&"--key-file") => {
                let i = args.iter().position(|w| *w == "--key-file").unwrap();
                assert_eq!(mode(Path::new(args[i + 1])), 0o600, "{line}");
            }
            _ => {}
        }
        ran += 1;
    }
    assert_eq!(ran, 8, "the guide's walk-through has eight commands");
    let list = ok(&["auth", "list", "--json", "--server", a, "--state-dir", sd]);
    let v: Value = serde_json::from_str(&list).unwrap();
    let names: Vec<&str> = v["identities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["hv1", "ops"], "t2 was removed last");
}
