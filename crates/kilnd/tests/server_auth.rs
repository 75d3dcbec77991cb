//! The shared-secret handshake against a live kilnd: no secret, a wrong secret and fops before
//! authenticating are refused with clear messages; the right secret works; the secret never
//! crosses the wire; and a server that cannot prove the secret is not trusted.

mod common;

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
