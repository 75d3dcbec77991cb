//! Limits: a client cap, a handshake deadline and strangers counted apart from clients, an idle
//! timeout, and a client that floods requests without reading replies — the server's memory
//! stays bounded and other clients are served; timeouts out of range are refused at start.

use crate::common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::Raw;
use kiln_client::{block_on, Client};
use kiln_proto::codec::Wire;
use kiln_proto::ops::PathReq;
use kiln_proto::Op;

/// A kilnd with extra arguments, on TCP only.
struct Limited {
    child: std::process::Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Limited {
    fn start(extra: &[&str]) -> Limited {
        let dir = tempfile::tempdir().expect("tempdir");
        let extra: Vec<&std::ffi::OsStr> = extra.iter().map(std::ffi::OsStr::new).collect();
        let (child, addr) = common::spawn_tcp_kilnd(dir.path(), &extra, None);
        Limited {
            child,
            addr,
            _dir: dir,
        }
    }

    fn rss_kib(&self) -> u64 {
        let s =
            std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("status");
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .expect("VmRSS")
    }
}

impl Drop for Limited {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads until EOF or the deadline; true if the peer closed.
fn closed_within(s: &mut std::net::TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).expect("timeout");
    let mut b = [0u8; 64];
    matches!(s.read(&mut b), Ok(0))
}

#[test]
fn clients_beyond_the_cap_are_refused_and_the_slot_comes_back() {
    let k = Limited::start(&["--max-connections", "2", "--handshake-timeout", "1"]);
    let a = Client::connect(&k.addr).expect("first");
    let b = Client::connect(&k.addr).expect("second");
    let e = Client::connect(&k.addr)
        .err()
        .expect("a third client is refused");
    assert!(e.to_string().contains("busy"), "refused as busy: {e}");
    // A connection that never says HELLO is closed when its handshake time is up.
    let mut silent = std::net::TcpStream::connect(&k.addr).expect("tcp connect");
    let t = Instant::now();
    assert!(
        closed_within(&mut silent, Duration::from_secs(20)),
        "a silent connection must be closed"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(800),
        "closed early: {:?}",
        t.elapsed()
    );
    assert!(
        block_on(a.lookup("/")).is_ok() && block_on(b.lookup("/")).is_ok(),
        "the first two still work"
    );
    drop(b);
    // The server frees the slot when it sees the close; poll for it (bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    let again = loop {
        match Client::connect(&k.addr) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::yield_now(),
            Err(e) => panic!("the freed slot never came back: {e}"),
        }
    };
    assert!(block_on(again.lookup("/")).is_ok());
}

/// Connections that never finish the handshake cannot keep a client that holds the secret
/// out: 2,000 of them, then a client connects and works.
#[test]
fn two_thousand_idle_strangers_do_not_lock_a_client_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    let brick = dir.path().join("brick");
    std::fs::create_dir(&brick).expect("brick");
    let extra = [
        std::ffi::OsStr::new("--secret-file"),
        secret.as_os_str(),
        std::ffi::OsStr::new("--handshake-timeout"),
        std::ffi::OsStr::new("60"),
    ];
    let (mut child, addr) = common::spawn_tcp_kilnd(&brick, &extra, None);
    let key = std::fs::read_to_string(&secret).expect("secret");
    let idle: Vec<std::net::TcpStream> = (0..2000)
        .map(|i| std::net::TcpStream::connect(&addr).unwrap_or_else(|e| panic!("#{i}: {e}")))
        .collect();
    // The brick may still be accepting the idle ones, each pushing out the oldest stranger:
    // a newcomer is pushed out only if 64 more arrive before its handshake is done, so a few
    // attempts within a bounded time must get one in.
    let deadline = Instant::now() + Duration::from_secs(30);
    let c = loop {
        match Client::connect_with_secret(&addr, Some(key.trim().as_bytes())) {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => eprintln!("retrying: {e}"),
            Err(e) => panic!("locked out by idle strangers: {e}"),
        }
    };
    assert!(block_on(c.lookup("/")).is_ok(), "the client works");
    let (f, _) = block_on(c.create("/f", libc::O_RDWR, 0o644)).expect("create");
    assert!(block_on(c.close(f)).is_ok());
    drop(idle);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn idle_connections_are_closed_and_busy_ones_are_not() {
    let k = Limited::start(&["--idle-timeout", "0.5"]);
    let mut idle = std::net::TcpStream::connect(&k.addr).expect("connect");
    let t = Instant::now();
    assert!(
        closed_within(&mut idle, Duration::from_secs(20)),
        "an idle connection must be closed"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(400),
        "closed before the timeout: {:?}",
        t.elapsed()
    );
    // A client that keeps talking stays connected past several timeouts.
    let busy = Client::connect(&k.addr).expect("connect");
    let until = Instant::now() + Duration::from_millis(1600);
    while Instant::now() < until {
        assert!(
            block_on(busy.lookup("/")).is_ok(),
            "a busy connection was closed"
        );
        std::thread::sleep(Duration::from_millis(100)); // pacing, not synchronisation
    }
}

/// A timeout that is not a finite number of seconds in range is a usage error (exit 2, with a
/// message) of the `kilnd` binary itself, not a panic (exit 101) when it builds its limits.
#[test]
fn timeouts_out_of_range_are_usage_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let brick = dir.path().to_str().unwrap();
    for arg in [
        "--idle-timeout=1e20",
        "--idle-timeout=-1",
        "--handshake-timeout=NaN",
        "--handshake-timeout=inf",
        "--heal-interval=1e309",
    ] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kilnd"))
            .args([
                "--brick",
                brick,
                "--listen",
                "tcp:127.0.0.1:0",
                "--metrics",
                "off",
            ])
            .arg(arg)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn kilnd");
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("kilnd {arg} took the value and ran");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(status.code(), Some(2), "{arg}: {err}");
        assert!(err.contains("is not a number of seconds"), "{arg}: {err}");
    }
}

#[test]
fn a_client_that_never_reads_replies_cannot_grow_server_memory() {
    let k = Limited::start(&["--max-inflight", "64"]);
    let good = Client::connect(&k.addr).expect("connect");
    let before = k.rss_kib();
    let mut flood = std::net::TcpStream::connect(&k.addr).expect("connect");
    flood.set_nonblocking(true).expect("nonblocking");
    let frame = Raw::request(
        Op::Lookup as u16,
        1,
        &PathReq {
            path: String::new(),
        }
        .to_wire(),
        &[],
    );
    let batch: Vec<u8> = frame
        .iter()
        .copied()
        .cycle()
        .take(frame.len() * 1024)
        .collect();
    // Send until the server stops reading (our socket fills up), within a bound.
    let mut sent = 0usize;
    let mut stalled = 0;
    while sent < 512 << 20 && stalled < 200 {
        match flood.write(&batch) {
            Ok(n) => {
                sent += n;
                stalled = 0;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                stalled += 1;
                std::thread::sleep(Duration::from_millis(5)); // pacing while the server drains
            }
            Err(e) => panic!("flood: {e}"),
        }
    }
    assert!(
        stalled >= 200,
        "the server kept reading {sent} bytes of requests nobody collects replies for"
    );
    let after = k.rss_kib();
    assert!(
        after < before + 64 * 1024,
        "server memory grew from {before} KiB to {after} KiB"
    );
    assert!(
        block_on(good.lookup("/")).is_ok(),
        "other clients are still served"
    );
    drop(flood);
    assert!(block_on(good.statfs("/")).is_ok());
}

/// One client cannot hold every descriptor of the brick: past its handle limit its opens fail
/// with EMFILE, and another client still opens files.
#[test]
fn a_client_past_its_handle_limit_gets_emfile_and_others_are_served() {
    let k = Limited::start(&["--max-handles", "64"]);
    std::fs::write(k._dir.path().join("f"), b"x").unwrap();
    let addr = format!("tcp:{}", k.addr);
    let greedy = Client::connect(&addr).expect("connect");
    let mut held = Vec::new();
    let err = loop {
        match block_on(greedy.open("f", libc::O_RDONLY)) {
            Ok(fh) => held.push(fh),
            Err(e) => break e,
        }
        assert!(held.len() <= 64, "opened past the limit");
    };
    assert_eq!(held.len(), 64);
    assert_eq!(err.raw_os_error(), Some(libc::EMFILE), "{err}");
    let other = Client::connect(&addr).expect("another client connects");
    block_on(other.open("f", libc::O_RDONLY)).expect("and opens");
    // A handle given back makes room again.
    block_on(greedy.close(held.pop().unwrap())).unwrap();
    block_on(greedy.open("f", libc::O_RDONLY)).expect("room again");
}

/// Before it proves a key a connection cannot make the server hold a large frame: one above
/// 4 KiB ends the connection, and a stranger's HELLO registers no metrics endpoint.
#[test]
fn strangers_send_small_frames_and_register_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("s");
    let k = Limited::start(&["--secret-file", secret.to_str().unwrap()]);
    let mut s = std::net::TcpStream::connect(&k.addr).unwrap();
    let big = vec![0u8; 64 * 1024];
    let frame = Raw::request(Op::Lookup as u16, 1, &big, &[]);
    // The header alone says 64 KiB of arguments follow: the server answers EPROTO and closes
    // without waiting for them (read to the end, bounded).
    s.write_all(&frame[..kiln_proto::HEADER_LEN]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let r = s.read_to_end(&mut got);
    assert!(
        r.is_ok(),
        "a 64 KiB frame before authentication keeps the connection: {r:?}"
    );
    let h = kiln_proto::Header::parse(got[..kiln_proto::HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(h.status.get(), libc::EPROTO as u32);
    // HELLO with a metrics endpoint, then nothing: the brick's profile lists no client.
    let mut s = std::net::TcpStream::connect(&k.addr).unwrap();
    let hello = kiln_proto::ops::HelloReq {
        version: kiln_proto::frame::VERSION as u32,
        client: "stranger".into(),
        metrics: "10.66.66.66:8080".into(),
    };
    s.write_all(&Raw::request(Op::Hello as u16, 1, &hello.to_wire(), &[]))
        .unwrap();
    let mut h = [0u8; kiln_proto::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let key = std::fs::read(&secret).unwrap();
    let c = Client::connect_with_secret(&format!("tcp:{}", k.addr), Some(key.trim_ascii()))
        .expect("a client with the secret");
    let profile = c.profile(kiln_proto::ops::PROFILE_INFO).unwrap();
    assert_eq!(profile["clients"], serde_json::json!([]), "{profile}");
}
