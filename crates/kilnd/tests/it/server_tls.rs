//! TLS with mutual certificates against a live kilnd: data goes through intact and encrypted;
//! plaintext clients, clients without a certificate or with one from another CA, and bricks
//! whose certificate does not name the dialled host are refused with clear messages, and the
//! brick logs whom it refused.

use crate::common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kiln_client::{block_on, Client};

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// A CA, a brick identity valid for 127.0.0.1, a client identity, and a second CA with a
    /// client identity of its own.
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path();
        kiln_tls::init_ca(&p.join("ca"), "test CA").expect("CA");
        kiln_tls::issue(
            &p.join("ca"),
            &p.join("brick"),
            "brick",
            &["127.0.0.1".into()],
        )
        .expect("brick identity");
        kiln_tls::issue(&p.join("ca"), &p.join("client"), "client", &[]).expect("client");
        kiln_tls::init_ca(&p.join("other-ca"), "another CA").expect("CA 2");
        kiln_tls::issue(&p.join("other-ca"), &p.join("stranger"), "stranger", &[])
            .expect("stranger");
        // Trusts the brick's CA but holds a certificate from the other one.
        std::fs::create_dir(p.join("impostor")).expect("impostor");
        for (from, f) in [
            ("ca", "ca.pem"),
            ("stranger", "cert.pem"),
            ("stranger", "key.pem"),
        ] {
            std::fs::copy(p.join(from).join(f), p.join("impostor").join(f)).expect("copy");
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn client(&self, name: &str) -> Arc<kiln_tls::ClientConfig> {
        kiln_tls::client_config(&self.path(name)).expect("client config")
    }
}

struct TlsBrick {
    child: std::process::Child,
    port: String,
    log: PathBuf,
    brick: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for TlsBrick {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(identity: &Path) -> TlsBrick {
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, log) = (dir.path().join("brick"), dir.path().join("kilnd.log"));
    std::fs::create_dir(&brick).expect("brick");
    let (child, addr) = common::spawn_tcp_kilnd(
        &brick,
        &[std::ffi::OsStr::new("--tls"), identity.as_os_str()],
        Some(&log),
    );
    let port = addr.rsplit_once(':').expect("port").1.to_owned();
    TlsBrick {
        child,
        port,
        log,
        brick,
        _dir: dir,
    }
}

impl TlsBrick {
    fn addr(&self) -> String {
        format!("tcp:127.0.0.1:{}", self.port)
    }

    /// Waits (bounded) until the brick's log contains `what`.
    fn log_says(&self, what: &str) -> String {
        for _ in 0..200 {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if log.contains(what) {
                return log;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!(
            "kilnd never logged {what:?}: {}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }
}

/// A TCP relay that records every byte going to the brick and back.
fn recording_relay(to: &str) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = format!("tcp:{}", l.local_addr().expect("addr"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let to = to.trim_start_matches("tcp:").to_owned();
    let rec = seen.clone();
    std::thread::spawn(move || {
        let (a, _) = l.accept().expect("accept");
        let b = TcpStream::connect(&to).expect("connect to brick");
        let pipe = |mut from: TcpStream, mut to: TcpStream, rec: Arc<Mutex<Vec<u8>>>| {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = to.shutdown(std::net::Shutdown::Write);
                        return;
                    }
                    Ok(n) => {
                        rec.lock().expect("lock").extend_from_slice(&buf[..n]);
                        if to.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        };
        let (a2, b2) = (a.try_clone().expect("clone"), b.try_clone().expect("clone"));
        let r2 = rec.clone();
        let up = std::thread::spawn(move || pipe(a, b, r2));
        pipe(b2, a2, rec);
        let _ = up.join();
    });
    (addr, seen)
}

#[test]
fn data_goes_through_intact_and_encrypted() {
    let pki = Pki::new();
    let b = start(&pki.path("brick"));
    let (relay, seen) = recording_relay(&b.addr());
    let c = Client::connect_opts(&relay, None, Some(pki.client("client"))).expect("TLS connect");
    let (fh, _) = block_on(c.create("secret.bin", libc::O_RDWR, 0o644)).expect("create");
    // 8 MiB of a recognisable pattern, written and read back in 1 MiB requests, several in
    // flight at once, so records are split and joined every which way.
    let marker = b"KILN-PLAINTEXT-MARKER-0123456789";
    let block: Vec<u8> = (0..1 << 20)
        .map(|i| marker[i % marker.len()] ^ ((i / 4096) as u8))
        .collect();
    let writes: Vec<_> = (0..8u64)
        .map(|i| c.pwritev(fh, vec![block.clone()], i << 20))
        .collect();
    for w in writes {
        assert_eq!(block_on(w).0.expect("write"), 1 << 20);
    }
    let reads: Vec<_> = (0..8u64)
        .map(|i| c.preadv(fh, vec![vec![0u8; 1 << 20]], i << 20))
        .collect();
    for r in reads {
        let (n, bufs) = block_on(r);
        assert_eq!(n.expect("read"), 1 << 20);
        assert!(bufs[0] == block, "data read back differs");
    }
    let on_disk = std::fs::read(b.brick.join("secret.bin")).expect("brick file");
    assert_eq!(on_disk.len(), 8 << 20);
    drop(c);
    let wire = seen.lock().expect("lock").clone();
    assert!(
        wire.len() > 16 << 20,
        "all data passed the relay ({} bytes)",
        wire.len()
    );
    let needle = &block[..marker.len()];
    assert!(
        !wire.windows(needle.len()).any(|w| w == needle),
        "plaintext seen on the wire"
    );
    assert!(
        !wire.windows(10).any(|w| w == b"secret.bin"),
        "a file name seen on the wire"
    );
}

#[test]
fn plaintext_clients_are_refused_with_a_clear_message() {
    let pki = Pki::new();
    let b = start(&pki.path("brick"));
    let e = Client::connect_opts(&b.addr(), None, None)
        .err()
        .expect("a plaintext client must be refused");
    assert!(e.to_string().contains("requires TLS"), "message: {e}");
    assert!(
        e.to_string().contains("KILN_TLS_DIR"),
        "says what to do: {e}"
    );
    b.log_says("plaintext client");
    // The brick still serves TLS clients afterwards.
    let c = Client::connect_opts(&b.addr(), None, Some(pki.client("client"))).expect("TLS");
    block_on(c.mkdir("after", 0o755)).expect("mkdir");
}

#[test]
fn certificates_the_ca_did_not_issue_are_refused() {
    let pki = Pki::new();
    let b = start(&pki.path("brick"));
    // A client certificate from another CA: the brick refuses it.
    let e = Client::connect_opts(&b.addr(), None, Some(pki.client("impostor")))
        .err()
        .expect("a certificate from another CA must be refused");
    let log = b.log_says("refused a TLS client");
    assert!(log.contains("127.0.0.1"), "the log names the peer: {log}");
    assert!(log.contains("UnknownIssuer"), "the log says why: {log}");
    assert!(e.to_string().contains("certificate"), "message: {e}");
    assert!(!b.brick.join("x").exists());

    // A client that sends no certificate at all.
    let roots = {
        let mut r = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for c in rustls::pki_types::CertificateDer::pem_file_iter(pki.path("client/ca.pem"))
            .expect("ca.pem")
        {
            r.add(c.expect("cert")).expect("add");
        }
        r
    };
    let anon = Arc::new(
        rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let before = std::fs::read_to_string(&b.log).unwrap_or_default().len();
    assert!(
        Client::connect_opts(&b.addr(), None, Some(anon)).is_err(),
        "a client without a certificate must be refused"
    );
    for _ in 0..200 {
        let log = std::fs::read_to_string(&b.log).unwrap_or_default();
        if log[before..].contains("refused a TLS client") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        std::fs::read_to_string(&b.log).unwrap_or_default()[before..]
            .contains("refused a TLS client"),
        "the brick logs the client without a certificate"
    );

    // The client checks the brick too: one that trusts only the other CA refuses it.
    let e = Client::connect_opts(&b.addr(), None, Some(pki.client("stranger")))
        .err()
        .expect("refused");
    assert!(
        e.to_string().contains("TLS handshake failed"),
        "message: {e}"
    );

    // And a brick certificate that does not name the host dialled is refused by the client.
    let e = Client::connect_opts(
        &format!("tcp:localhost:{}", b.port),
        None,
        Some(pki.client("client")),
    )
    .err()
    .expect("a certificate for another name must be refused");
    assert!(
        e.to_string().contains("TLS handshake failed"),
        "message: {e}"
    );

    // Meanwhile a proper client works.
    let c = Client::connect_opts(&b.addr(), None, Some(pki.client("client"))).expect("TLS");
    block_on(c.mkdir("ok", 0o755)).expect("mkdir");
    assert!(b.brick.join("ok").is_dir());
}

/// Over TLS a certificate's name can be the identity: a brick that admits an identity of that
/// name holds the client to its capabilities without a key; a certificate whose name is no
/// identity still needs one.
#[test]
fn a_certificate_names_its_identity() {
    let pki = Pki::new();
    kiln_tls::issue(&pki.path("ca"), &pki.path("reader"), "reader", &[]).expect("reader");
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, ids) = (dir.path().join("brick"), dir.path().join("ids.json"));
    std::fs::create_dir(&brick).unwrap();
    std::fs::write(brick.join("f"), b"data").unwrap();
    std::fs::write(
        &ids,
        serde_json::json!({ "volume": "v", "identities": [{
            "name": "reader",
            "key": "0123456789abcdef0123456789abcdef",
            "caps": { "volumes": ["v"], "read_only": true, "users": { "as": { "uid": 1234, "gid": 1234 } } }
        }]})
        .to_string(),
    )
    .unwrap();
    let (mut child, addr) = common::spawn_tcp_kilnd(
        &brick,
        &[
            std::ffi::OsStr::new("--tls"),
            pki.path("brick").as_os_str(),
            std::ffi::OsStr::new("--identities"),
            ids.as_os_str(),
        ],
        None,
    );
    let addr = format!("tcp:{addr}");
    let c = Client::connect_opts(&addr, None, Some(pki.client("reader"))).expect("no key needed");
    let fh = block_on(c.open("f", libc::O_RDONLY)).expect("reads");
    block_on(c.close(fh)).unwrap();
    let e = block_on(c.create("g", libc::O_RDWR, 0o644)).expect_err("read-only");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    let e = Client::connect_opts(&addr, None, Some(pki.client("client")))
        .err()
        .expect("a certificate that names no identity needs a key");
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    let _ = child.kill();
    let _ = child.wait();
}
