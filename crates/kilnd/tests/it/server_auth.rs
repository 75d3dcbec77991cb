//! The shared-secret handshake against a live kilnd: no secret, a wrong secret and fops before
//! authenticating are refused with clear messages; the right secret works; the secret never
//! crosses the wire; and a server that cannot prove the secret is not trusted.

use crate::common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use common::Raw;
use kiln_client::{block_on, Client};
use kiln_proto::codec::Wire;
use kiln_proto::frame::{Header, HEADER_LEN};
use kiln_proto::ops::{HelloReply, HelloReq, PathReq};
use kiln_proto::{errno, Op};

struct Secured {
    child: std::process::Child,
    addr: String,
    secret: Vec<u8>,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn start() -> Secured {
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, secret_file, log) = (
        dir.path().join("brick"),
        dir.path().join("brick.secret"),
        dir.path().join("kilnd.log"),
    );
    std::fs::create_dir(&brick).expect("brick");
    let (child, addr) = common::spawn_tcp_kilnd(
        &brick,
        &[
            std::ffi::OsStr::new("--secret-file"),
            secret_file.as_os_str(),
        ],
        Some(&log),
    );
    let addr = format!("tcp:{addr}");
    let secret = std::fs::read_to_string(&secret_file)
        .expect("kilnd created the secret file")
        .trim()
        .as_bytes()
        .to_vec();
    assert_eq!(secret.len(), 64, "a new secret is 32 random bytes in hex");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&secret_file)
            .expect("meta")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    Secured {
        child,
        addr,
        secret,
        log,
        _dir: dir,
    }
}

impl Drop for Secured {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn clients_must_prove_the_secret() {
    let s = start();
    let e = Client::connect_with_secret(&s.addr, None)
        .err()
        .expect("no secret is refused");
    assert!(e.to_string().contains("requires a secret"), "{e}");
    let e = Client::connect_with_secret(&s.addr, Some(b"not the secret"))
        .err()
        .expect("a wrong secret is refused");
    assert!(e.to_string().contains("wrong secret"), "{e}");
    let c = Client::connect_with_secret(&s.addr, Some(&s.secret)).expect("the right secret works");
    assert!(block_on(c.lookup("/")).is_ok());

    // A raw client that skips AUTH gets EACCES to its first real fop, then a close.
    let mut raw =
        Raw(TcpStream::connect(s.addr.strip_prefix("tcp:").expect("tcp")).expect("connect"));
    let (h, a, _) = raw.call(
        Op::Hello as u16,
        1,
        &HelloReq {
            version: 1,
            client: "raw".into(),
            metrics: String::new(),
        }
        .to_wire(),
    );
    assert_eq!(h.status.get(), 0);
    let hello = HelloReply::from_wire(&a).expect("hello reply");
    assert!(hello.auth_required && hello.nonce.len() == 32);
    let (h, _, _) = raw.call(
        Op::Lookup as u16,
        2,
        &PathReq {
            path: String::new(),
        }
        .to_wire(),
    );
    assert_eq!(h.status.get(), errno::EACCES);
    assert!(raw.reply().is_none(), "closed after the refusal");
    // PING and BYE are no exception: a stranger is refused them too.
    for op in [Op::Ping, Op::Bye] {
        let mut raw =
            Raw(TcpStream::connect(s.addr.strip_prefix("tcp:").expect("tcp")).expect("connect"));
        let hello = HelloReq {
            version: 1,
            client: "raw".into(),
            metrics: String::new(),
        };
        let (h, _, _) = raw.call(Op::Hello as u16, 1, &hello.to_wire());
        assert_eq!(h.status.get(), 0);
        let (h, _, _) = raw.call(op as u16, 2, &[]);
        assert_eq!(h.status.get(), errno::EACCES, "{op:?} before AUTH");
        assert!(raw.reply().is_none(), "closed after refusing {op:?}");
    }

    drop(c);
    let log = std::fs::read_to_string(&s.log).expect("log");
    assert!(
        log.contains("failed authentication"),
        "the server logs refused clients: {log}"
    );
}

/// Forwards one connection to `to`, recording every byte in both directions.
fn recording_proxy(to: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = format!("tcp:{}", l.local_addr().expect("addr"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    std::thread::spawn(move || {
        let (a, _) = l.accept().expect("accept");
        let b = TcpStream::connect(to).expect("connect upstream");
        for (mut from, mut into) in [
            (a.try_clone().expect("clone"), b.try_clone().expect("clone")),
            (b, a),
        ] {
            let seen = s2.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 || into.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    seen.lock().expect("lock").extend_from_slice(&buf[..n]);
                }
                let _ = into.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (addr, seen)
}

#[test]
fn the_secret_never_crosses_the_wire() {
    let s = start();
    let (proxy, seen) = recording_proxy(s.addr.strip_prefix("tcp:").expect("tcp").to_owned());
    let c =
        Client::connect_with_secret(&proxy, Some(&s.secret)).expect("connect through the proxy");
    assert!(block_on(c.statfs("/")).is_ok());
    drop(c);
    let bytes = seen.lock().expect("lock").clone();
    assert!(bytes.len() > 100, "the proxy saw the handshake");
    assert!(
        !bytes
            .windows(16)
            .any(|w| s.secret.windows(16).any(|x| x == w)),
        "part of the secret crossed the wire"
    );
}

#[test]
fn a_server_that_cannot_prove_the_secret_is_not_trusted() {
    // A fake brick: asks for authentication, accepts any proof, answers with a bogus one.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = format!("tcp:{}", l.local_addr().expect("addr"));
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        for _ in 0..2 {
            let mut h = [0u8; HEADER_LEN];
            s.read_exact(&mut h).expect("header");
            let hdr = Header::parse(&h).expect("valid header");
            let mut args = vec![0u8; hdr.args_len.get() as usize];
            s.read_exact(&mut args).expect("args");
            let reply = if hdr.opcode.get() == Op::Hello as u16 {
                HelloReply {
                    version: 1,
                    server: "impostor".into(),
                    max_payload: 1 << 20,
                    auth_required: true,
                    nonce: vec![7; 32],
                    flags: 0,
                }
                .to_wire()
            } else {
                kiln_proto::ops::AuthReply { proof: vec![0; 32] }.to_wire()
            };
            let mut out = Header::reply(
                hdr.opcode.get(),
                hdr.request_id.get(),
                0,
                reply.len() as u32,
                0,
            )
            .to_bytes()
            .to_vec();
            out.extend_from_slice(&reply);
            s.write_all(&out).expect("reply");
        }
    });
    let e = Client::connect_with_secret(&addr, Some(b"our secret"))
        .err()
        .expect("an impostor is refused");
    assert!(e.to_string().contains("could not prove"), "{e}");
}

/// Named identities on a brick (`kilnd --identities FILE`): each proves its own key and is held
/// to its capabilities on every fop, whatever its client sends.
mod identities {
    use super::*;
    use kiln_client::Fh;
    use std::io::IoSlice;
    use std::os::unix::fs::MetadataExt;
    use std::time::{Duration, Instant};

    const T1: &str = "t1 1111111111111111111111111111111111111111111111111111111111111111";
    const T2: &str = "t2 2222222222222222222222222222222222222222222222222222222222222222";
    const ADMIN: &str = "ops 3333333333333333333333333333333333333333333333333333333333333333";
    const NODEV: &str = "nodev 6666666666666666666666666666666666666666666666666666666666666666";

    use std::os::unix::fs::PermissionsExt;

    fn ident(key_line: &str, caps: serde_json::Value) -> serde_json::Value {
        let (name, key) = key_line.split_once(' ').unwrap();
        serde_json::json!({ "name": name, "key": key, "caps": caps })
    }

    fn table(with_t1: bool, t1_key: &str) -> String {
        let mut ids = vec![
            ident(
                T2,
                serde_json::json!({ "volumes": ["v"], "read_only": true, "subtree": "t2",
                                    "users": { "as": { "uid": 1234, "gid": 1234 } } }),
            ),
            ident(
                ADMIN,
                serde_json::json!({ "volumes": ["*"], "root": true, "devices": true }),
            ),
            // Root, but no devices.
            ident(NODEV, serde_json::json!({ "volumes": ["v"], "root": true })),
            // Another volume's identity: never admitted here.
            ident(
                "other 4444444444444444444444444444444444444444444444444444444444444444",
                serde_json::json!({ "volumes": ["elsewhere"], "root": true }),
            ),
        ];
        if with_t1 {
            ids.push(ident(
                t1_key,
                serde_json::json!({ "volumes": ["v"], "subtree": "t1", "users": "as-caller" }),
            ));
        }
        serde_json::json!({ "volume": "v", "identities": ids }).to_string()
    }

    struct Brick {
        child: std::process::Child,
        addr: String,
        brick: std::path::PathBuf,
        ids: std::path::PathBuf,
        log: std::path::PathBuf,
        _dir: tempfile::TempDir,
    }

    impl Drop for Brick {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Brick {
        fn start() -> Brick {
            let dir = tempfile::tempdir().unwrap();
            let brick = dir.path().join("brick");
            for d in ["t1", "t2"] {
                std::fs::create_dir_all(brick.join(d)).unwrap();
            }
            std::fs::write(brick.join("t2/data"), b"tenant two").unwrap();
            // t1's directory is open to its users (nobody among them); t2's is 1234's.
            std::fs::set_permissions(brick.join("t1"), std::fs::Permissions::from_mode(0o777))
                .unwrap();
            std::os::unix::fs::chown(brick.join("t2"), Some(1234), Some(1234)).unwrap();
            std::os::unix::fs::chown(brick.join("t2/data"), Some(1234), Some(1234)).unwrap();
            std::fs::write(brick.join("rootfile"), b"root only").unwrap();
            std::fs::set_permissions(
                brick.join("rootfile"),
                std::fs::Permissions::from_mode(0o600),
            )
            .unwrap();
            let ids = dir.path().join("ids.json");
            std::fs::write(&ids, table(true, T1)).unwrap();
            let log = dir.path().join("kilnd.log");
            let (child, addr) = common::spawn_tcp_kilnd(
                &brick,
                &["--identities".as_ref(), ids.as_os_str()],
                Some(&log),
            );
            Brick {
                child,
                addr: format!("tcp:{addr}"),
                brick,
                ids,
                log,
                _dir: dir,
            }
        }

        /// Waits (bounded) until kilnd has read the table `n` times.
        fn wait_loads(&self, n: usize) {
            let t0 = Instant::now();
            loop {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                if log.matches("identities: ").count() >= n {
                    return;
                }
                assert!(t0.elapsed() < Duration::from_secs(10), "{log}");
                std::thread::yield_now();
            }
        }

        fn client(&self, key: &str) -> std::io::Result<Client> {
            Client::connect_with_secret(&self.addr, Some(key.as_bytes()))
        }

        /// Writes the table anew and tells kilnd to read it.
        fn reload(&self, text: String) {
            let tmp = self.ids.with_extension("new");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &self.ids).unwrap();
            let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
            rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
        }
    }

    fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
        r.expect_err("refused").raw_os_error().unwrap_or(-1)
    }

    #[test]
    fn each_identity_is_held_to_its_capabilities() {
        let b = Brick::start();
        let t1 = b.client(T1).expect("t1 proves its key");
        let t2 = b.client(T2).expect("t2 proves its key");

        // t1: inside its subtree it works, as nobody (no credentials sent, no root held).
        let (fh, attr) = block_on(t1.create("t1/f", libc::O_RDWR, 0o644)).expect("t1 creates");
        assert_eq!(
            (attr.uid, attr.gid),
            (65534, 65534),
            "runs as nobody, not root"
        );
        block_on(t1.close(fh)).unwrap();
        // On the way to its subtree: attributes only; elsewhere: nothing.
        block_on(t1.lookup("")).expect("the root's attributes");
        block_on(t1.lookup("t1")).expect("its subtree's attributes");
        assert_eq!(
            errno_of(block_on(t1.readdir(""))),
            libc::EACCES,
            "root listing"
        );
        assert_eq!(errno_of(block_on(t1.lookup("t2/data"))), libc::EACCES);
        assert_eq!(
            errno_of(block_on(t1.open("t2/data", libc::O_RDONLY))),
            libc::EACCES
        );
        assert_eq!(
            errno_of(block_on(t1.open("rootfile", libc::O_RDONLY))),
            libc::EACCES
        );
        assert_eq!(
            errno_of(block_on(t1.rename("t1/f", "t2/stolen", 0))),
            libc::EACCES,
            "a rename out of the subtree"
        );
        assert_eq!(errno_of(block_on(t1.link("t2/data", "t1/l"))), libc::EACCES);
        // Symlinks inside the subtree that point out of it lead nowhere; ones that stay in
        // it work.
        block_on(t1.symlink("../t2/data", "t1/esc")).expect("a symlink is only a name");
        block_on(t1.symlink("../t2", "t1/dir")).unwrap();
        block_on(t1.symlink("f", "t1/same")).unwrap();
        assert_eq!(
            errno_of(block_on(t1.open("t1/esc", libc::O_RDONLY))),
            libc::EACCES
        );
        assert_eq!(
            errno_of(block_on(t1.open("t1/dir/data", libc::O_RDONLY))),
            libc::EACCES
        );
        assert_eq!(errno_of(block_on(t1.lookup("t1/dir/data"))), libc::EACCES);
        assert_eq!(errno_of(block_on(t1.readdir("t1/dir"))), libc::EACCES);
        let fh = block_on(t1.open("t1/same", libc::O_RDONLY)).expect("a symlink within");
        block_on(t1.close(fh)).unwrap();
        // A device node: nobody may not make one.
        assert_eq!(
            errno_of(block_on(t1.mknod(
                "t1/loop",
                libc::S_IFBLK | 0o600,
                libc::makedev(7, 0)
            ))),
            libc::EPERM
        );
        assert!(!b.brick.join("t1/loop").exists());
        // SYNCDIR names a path: within the subtree it runs (as nobody), beyond it it is refused.
        block_on(t1.syncdir("t1")).expect("t1 syncs its own directory");
        assert_eq!(errno_of(block_on(t1.syncdir("t2"))), libc::EACCES);
        assert_eq!(errno_of(block_on(t1.syncdir(""))), libc::EACCES);

        // t2: read-only, as 1234:1234, confined to t2.
        let fh = block_on(t2.open("t2/data", libc::O_RDONLY)).expect("t2 reads its data");
        let mut buf = vec![0u8; 64];
        let n = t2
            .preadv_blocking(fh, &mut [std::io::IoSliceMut::new(&mut buf)], 0)
            .unwrap();
        assert_eq!(&buf[..n], b"tenant two");
        let w = t2.pwritev_blocking(fh, &[IoSlice::new(b"x")], 0);
        assert!(w.is_err(), "a read-only handle does not write");
        assert_eq!(
            errno_of(block_on(t2.open("t2/data", libc::O_RDWR))),
            libc::EROFS
        );
        assert_eq!(
            errno_of(block_on(t2.create("t2/new", libc::O_RDWR, 0o644))),
            libc::EROFS
        );
        assert_eq!(errno_of(block_on(t2.unlink("t2/data"))), libc::EROFS);
        assert_eq!(errno_of(block_on(t2.lookup("t1/f"))), libc::EACCES);
        // Syncing changes nothing: a read-only identity may, in its subtree only.
        block_on(t2.syncdir("t2")).expect("t2 syncs its directory");
        assert_eq!(errno_of(block_on(t2.syncdir("t1"))), libc::EACCES);
        assert_eq!(
            std::fs::read(b.brick.join("t2/data")).unwrap(),
            b"tenant two"
        );

        // Unknown identities, other volumes' identities and wrong keys are refused.
        for key in [
            "nobody-here 1111111111111111111111111111111111111111111111111111111111111111",
            "other 4444444444444444444444444444444444444444444444444444444444444444",
            "t1 1111111111111111111111111111111111111111111111111111111111111112",
            "1111111111111111111111111111111111111111111111111111111111111111",
        ] {
            let e = b.client(key).err().expect("refused");
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{key}: {e}");
        }

        // Root without the devices capability: no device node, with or without credentials.
        let nodev = b.client(NODEV).expect("nodev");
        let dev = libc::makedev(1, 3);
        let r = block_on(nodev.mknod("n", libc::S_IFCHR | 0o600, dev));
        assert_eq!(errno_of(r), libc::EPERM);
        let root_cred = kiln_client::Volume::from_volfile_with_secret(
            &kiln_client::Volume::default_volfile(&b.addr),
            Some(NODEV.as_bytes()),
        )
        .unwrap()
        .on_behalf_of(Some(std::sync::Arc::new(kiln_proto::Cred::default())));
        let r = block_on(root_cred.mknod("n", libc::S_IFCHR | 0o600, dev));
        assert_eq!(errno_of(r), libc::EPERM, "root credentials without devices");
        assert!(!b.brick.join("n").exists());
        block_on(nodev.mknod("fifo", libc::S_IFIFO | 0o600, 0)).expect("a FIFO needs nothing");

        // An identity that holds root, as-caller: the brick's own credentials without any.
        let admin = b.client(ADMIN).expect("ops");
        let (fh, attr) = block_on(admin.create("made-by-ops", libc::O_RDWR, 0o600)).unwrap();
        assert_eq!(attr.uid, 0);
        block_on(admin.close(fh)).unwrap();
        assert_eq!(
            std::fs::metadata(b.brick.join("t1/f")).unwrap().uid(),
            65534
        );
        drop(admin);

        // Removing t1: its open handle fails and it cannot come back, within a second; t2
        // goes on.
        let (fh1, _) = block_on(t1.create("t1/g", libc::O_RDWR, 0o644)).unwrap();
        let t0 = Instant::now();
        b.reload(table(false, T1));
        let gone = loop {
            if t1
                .pwritev_blocking(fh1, &[IoSlice::new(b"late")], 0)
                .is_err()
            {
                break t0.elapsed();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "t1 still writes after removal"
            );
            std::thread::yield_now();
        };
        assert!(gone < Duration::from_secs(1), "closed after {gone:?}");
        assert!(b.client(T1).is_err(), "a removed identity cannot reconnect");
        let n = t2
            .preadv_blocking(fh, &mut [std::io::IoSliceMut::new(&mut buf)], 0)
            .unwrap();
        assert_eq!(&buf[..n], b"tenant two", "t2's handle still reads");

        // Rotating t1's key: the old key is refused, the new one works.
        let rotated = "t1 5555555555555555555555555555555555555555555555555555555555555555";
        b.reload(table(true, rotated));
        b.wait_loads(3);
        let t1b = b
            .client(rotated)
            .expect("the new key works once the table is read");
        assert!(b.client(T1).is_err(), "the old key is refused");
        block_on(t1b.lookup("t1/f")).expect("t1 is back with its new key");
        let _: Fh = fh;
        let log = std::fs::read_to_string(&b.log).unwrap();
        assert!(log.contains("closing: the identity was removed"), "{log}");
    }
}
