//! Shared test fixture: a real kilnd process on a temporary brick, and raw frame helpers.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use kiln_proto::frame::{Header, HEADER_LEN};
use kiln_testkit::daemon;
#[allow(unused_imports)] // each test binary uses some of it
pub use kiln_testkit::net::ip;
#[allow(unused_imports)] // each test binary uses some of it
pub use kiln_testkit::rng::{seed, Rng};

/// A kilnd child process serving a temporary brick over TCP and a Unix socket.
pub struct Kilnd {
    pub child: Child,
    pub tcp: String,
    pub unix: String,
    pub brick: PathBuf,
    /// Holds the brick and a sibling "outside" directory that tests check stays untouched.
    pub dir: tempfile::TempDir,
}

impl Kilnd {
    pub fn start() -> Kilnd {
        let dir = tempfile::tempdir().expect("tempdir");
        let brick = dir.path().join("brick");
        std::fs::create_dir(&brick).expect("brick dir");
        let sock = dir.path().join("kilnd.sock");
        let (child, mut out) = daemon::spawn_piped(
            Command::new(env!("CARGO_BIN_EXE_kilnd"))
                .arg("--brick")
                .arg(&brick)
                .args(["--listen", "tcp:127.0.0.1:0", "--listen"])
                .arg(format!("unix:{}", sock.display()))
                .stdin(Stdio::null()),
        );
        let addrs = daemon::announced(&mut out, 2, false).listening;
        let tcp = addrs
            .iter()
            .find(|a| a.starts_with("tcp:"))
            .expect("tcp address")
            .clone();
        let unix = addrs
            .iter()
            .find(|a| a.starts_with("unix:"))
            .expect("unix address")
            .clone();
        Kilnd {
            child,
            tcp,
            unix,
            brick,
            dir,
        }
    }

    pub fn tcp_addr(&self) -> &str {
        self.tcp.strip_prefix("tcp:").expect("tcp: prefix")
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// True while the server process is alive.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Kilnd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A raw connection that speaks frames by hand (for hostile input).
pub struct Raw(pub std::net::TcpStream);

impl Raw {
    pub fn connect(k: &Kilnd) -> Raw {
        let s = std::net::TcpStream::connect(k.tcp_addr()).expect("connect");
        s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .expect("timeout");
        Raw(s)
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).expect("send");
    }

    pub fn request(op: u16, id: u64, args: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut v = Header::request(op, id, args.len() as u32, payload.len() as u32)
            .to_bytes()
            .to_vec();
        v.extend_from_slice(args);
        v.extend_from_slice(payload);
        v
    }

    /// Reads one reply: (header, args, payload). None when the server closed the connection.
    pub fn reply(&mut self) -> Option<(Header, Vec<u8>, Vec<u8>)> {
        let mut h = [0u8; HEADER_LEN];
        if self.0.read_exact(&mut h).is_err() {
            return None;
        }
        let hdr = Header::parse(&h).expect("server sent a valid header");
        let mut args = vec![0u8; hdr.args_len.get() as usize];
        self.0.read_exact(&mut args).ok()?;
        let mut payload = vec![0u8; hdr.payload_len.get() as usize];
        self.0.read_exact(&mut payload).ok()?;
        Some((hdr, args, payload))
    }

    pub fn call(&mut self, op: u16, id: u64, args: &[u8]) -> (Header, Vec<u8>, Vec<u8>) {
        self.send(&Raw::request(op, id, args, &[]));
        self.reply().expect("a reply")
    }
}

/// Every file below `dir` with its contents, for before/after comparisons.
pub fn snapshot(dir: &std::path::Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            let m = std::fs::symlink_metadata(&p).expect("metadata");
            if m.is_dir() {
                out.push((p.clone(), Vec::new()));
                stack.push(p);
            } else if m.file_type().is_symlink() {
                out.push((
                    p.clone(),
                    std::fs::read_link(&p)
                        .expect("readlink")
                        .into_os_string()
                        .into_encoded_bytes(),
                ));
            } else {
                out.push((p.clone(), std::fs::read(&p).expect("read")));
            }
        }
    }
    out.sort();
    out
}

/// Starts kilnd on `brick` listening on a free loopback TCP port, with extra arguments, stderr
/// to `log` (or discarded); returns the child and its address without the `tcp:` prefix.
pub fn spawn_tcp_kilnd(
    brick: &std::path::Path,
    extra: &[&std::ffi::OsStr],
    log: Option<&std::path::Path>,
) -> (Child, String) {
    let mut args: Vec<&std::ffi::OsStr> = vec!["--brick".as_ref(), brick.as_os_str()];
    args.extend_from_slice(extra);
    spawn_kilnd(&args, log)
}

/// Starts kilnd with `args` (which name its brick or volfile) listening on a free loopback TCP
/// port, stderr to `log` (or discarded); returns the child and its address without `tcp:`.
pub fn spawn_kilnd(args: &[&std::ffi::OsStr], log: Option<&std::path::Path>) -> (Child, String) {
    let stderr = match log {
        Some(p) => Stdio::from(std::fs::File::create(p).expect("log file")),
        None => Stdio::null(),
    };
    let (child, addr) = daemon::spawn_listening(
        Command::new(env!("CARGO_BIN_EXE_kilnd"))
            .args(args)
            .args(["--listen", "tcp:127.0.0.1:0"])
            .stderr(stderr),
    );
    let addr = daemon::tcp(&addr).to_owned();
    (child, addr)
}
