//! A brick whose file system fills up says so: the client gets ENOSPC, the brick logs it once
//! per file (not once per write) and counts every one in `/metrics`. The brick lives on a
//! 1 MiB tmpfs that the test mounts and removes.

use crate::common;

use std::io::{Read, Write};
use std::process::Command;

use kiln_client::{block_on, Client};

struct Tmpfs(std::path::PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily: a test that failed may leave its kilnd holding the brick open, and a busy
        // tmpfs must still not outlive the test.
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A brick directory in `dir` on a 1 MiB tmpfs (unmounted when the guard drops).
fn tiny_brick(dir: &std::path::Path) -> (std::path::PathBuf, Tmpfs) {
    let brick = dir.join("brick");
    std::fs::create_dir(&brick).expect("brick dir");
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&brick)
        .status()
        .expect("mount");
    assert!(st.success(), "mounting a tmpfs for the brick (needs root)");
    (brick.clone(), Tmpfs(brick))
}

fn metrics(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    out
}

#[test]
fn a_full_brick_logs_once_per_file_and_counts_every_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, _fs) = tiny_brick(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let m = format!("127.0.0.1:{port}");
    let log = dir.path().join("kilnd.log");
    let extra = [std::ffi::OsStr::new("--metrics"), std::ffi::OsStr::new(&m)];
    let (mut child, addr) = common::spawn_tcp_kilnd(&brick, &extra, Some(&log));
    let c = Client::connect(&addr).expect("connect");
    let (f, _) = block_on(c.create("/big", libc::O_RDWR, 0o644)).expect("create");
    let chunk = vec![7u8; 64 << 10];
    let mut enospc = 0;
    for i in 0..64u64 {
        match block_on(c.pwritev(f, vec![chunk.clone()], i * chunk.len() as u64)).0 {
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "write {i}: {e}");
                enospc += 1;
            }
        }
    }
    assert!(
        enospc >= 10,
        "a 1 MiB brick refuses most of 4 MiB: {enospc} refusals"
    );
    let text = metrics(&m);
    let line = text
        .lines()
        .find(|l| l.starts_with("kiln_brick_storage_errors_total{errno=\"ENOSPC\"}"))
        .unwrap_or_else(|| panic!("no storage error counter in {text}"));
    let counted: u64 = line.rsplit(' ').next().unwrap().parse().expect("a count");
    assert_eq!(counted, enospc, "every refused write counted");
    let _ = child.kill();
    let _ = child.wait();
    let logged = std::fs::read_to_string(&log).expect("log");
    let lines = logged
        .lines()
        .filter(|l| l.contains("storage error ENOSPC"))
        .count();
    assert_eq!(
        lines, 1,
        "one log line for one file within a minute:\n{logged}"
    );
    assert!(logged.contains("big"), "the log names the file");
}

/// `volume status` shows a full brick: its space, from the brick's own file system.
#[test]
fn volume_status_shows_a_full_brick() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, _fs) = tiny_brick(dir.path());
    let state = dir.path().join("state");
    let mut kd = Command::new(env!("CARGO_BIN_EXE_kilnd"))
        .arg("--state-dir")
        .arg(&state)
        .args(["--mgmt", "tcp:127.0.0.1:0", "--brick-port-base", "24800"])
        .args(["--metrics", "off", "--heal-interval", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("kilnd");
    let mut line = String::new();
    std::io::BufReader::new(kd.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("kilnd says where it listens");
    let addr = line
        .trim()
        .strip_prefix("kilnd: management on ")
        .unwrap_or_else(|| panic!("unexpected {line:?}"))
        .to_owned();
    let key = kiln_client::mgmt::read_secret(&state.join("mgmt.secret")).expect("secret");
    let call = |req: serde_json::Value| {
        kiln_client::mgmt::call_with_secret(&addr, &req, Some(&key)).expect("mgmt call")
    };
    let spec = format!("127.0.0.1:{}", brick.display());
    call(serde_json::json!({"cmd": "create", "name": "full", "bricks": [spec]}));
    let space = |st: &serde_json::Value| {
        let s = &st["volumes"][0]["bricks"][0]["space"];
        (
            s["size"].as_u64().expect("size"),
            s["free"].as_u64().expect("free"),
        )
    };
    let (size, free) = space(&call(serde_json::json!({"cmd": "status", "name": "full"})));
    assert!(
        size > 0 && free > size / 100,
        "an empty brick: {free} of {size}"
    );
    // Fill the brick's file system to the last block.
    let mut f = std::fs::File::create(brick.join("filler")).expect("filler");
    while f.write_all(&[1u8; 4096]).is_ok() {}
    drop(f);
    let st = call(serde_json::json!({"cmd": "status", "name": "full"}));
    let (size, free) = space(&st);
    assert!(free < size / 100, "a full brick shows so: {free} of {size}");
    let health = |st: &serde_json::Value| st["volumes"][0]["bricks"][0]["health"].clone();
    // Full is not failing: the write probe's ENOSPC is the FULL line's business.
    assert_eq!(health(&st)["read_only"], false, "{st}");
    assert!(health(&st)["write_error"].is_null(), "{st}");
    // A file system gone read-only (as after errors) is failing.
    std::fs::remove_file(brick.join("filler")).expect("room again");
    let ro = Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&brick)
        .status()
        .expect("remount");
    assert!(ro.success(), "remounting the brick read-only");
    let st = call(serde_json::json!({"cmd": "status", "name": "full"}));
    assert_eq!(
        health(&st)["read_only"],
        true,
        "a read-only brick shows so: {st}"
    );
    let _ = kd.kill();
    let _ = kd.wait();
}
