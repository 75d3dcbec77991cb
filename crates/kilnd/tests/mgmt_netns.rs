//! Volume management across two hosts: two network namespaces joined by a veth pair, a
//! management kilnd in each. The hosts share one management secret (host a's
//! `STATE_DIR/mgmt.secret`, copied to host b; a host with another secret is refused). The
//! volume is created on host a with one brick on each host; host b answers status and hands out
//! the volfile from its cached copy (without a secret, as a mounting client asks); data written
//! from host a lands on both bricks. Needs root and `ip netns`; skips (saying why) without them.

mod common;
use common::ip;

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_client::{block_on, mgmt, Volume};
use kiln_layer::volfile::LayerKind;
use serde_json::{json, Value};

const A_IP: &str = "10.77.0.1";
const B_IP: &str = "10.77.0.2";

/// Two namespaces and a veth pair, removed when dropped (with everything still running in
/// them that this test started).
struct Net {
    a: String,
    b: String,
    procs: Vec<Child>,
    states: Vec<PathBuf>,
}

impl Net {
    fn setup() -> Result<Net, String> {
        let pid = std::process::id();
        let net = Net {
            a: format!("kiln-t-{pid}-a"),
            b: format!("kiln-t-{pid}-b"),
            procs: Vec::new(),
            states: Vec::new(),
        };
        ip(&["netns", "add", &net.a])?;
        ip(&["netns", "add", &net.b])?;
        let (va, vb) = (format!("kva{pid}"), format!("kvb{pid}"));
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", &net.a])?;
        ip(&["link", "set", &vb, "netns", &net.b])?;
        for (ns, dev, addr) in [(&net.a, &va, A_IP), (&net.b, &vb, B_IP)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Starts a management kilnd in namespace `ns`, listening on every address of it, with
    /// `extra` arguments.
    fn kilnd(&mut self, ns: &str, state: &Path, extra: &[&Path]) {
        let child = Command::new("ip")
            .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_kilnd")])
            .args([
                "--mgmt",
                "tcp:0.0.0.0:24007",
                "--metrics",
                "off",
                "--state-dir",
            ])
            .arg(state)
            .args(extra)
            .env("KILN_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn kilnd");
        self.procs.push(child);
        self.states.push(state.to_owned());
        let child = self.procs.last_mut().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "kilnd in {ns} exited early"
            );
            if line.starts_with("kilnd: management on") {
                return;
            }
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for c in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Bricks outlive kilnd by design: end the ones these state directories recorded.
        for s in &self.states {
            for pid in recorded_pids(s) {
                let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(&*s.to_string_lossy()))
                    .unwrap_or(false);
                if ours {
                    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
            }
        }
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

fn recorded_pids(state: &Path) -> Vec<u64> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir(state.join("vols"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(t) = std::fs::read(e.path().join("volume.json")) {
            if let Ok(v) = serde_json::from_slice::<Value>(&t) {
                for b in v["bricks"].as_array().into_iter().flatten() {
                    pids.extend(b["pid"].as_u64());
                }
            }
        }
    }
    pids
}

/// Runs `f` on a thread inside network namespace `ns` (threads it starts stay there too).
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let f_ns = std::fs::File::open(&path).expect("open netns");
        // SAFETY: setns(2) on a descriptor we own; it changes only this thread's namespace.
        let r = unsafe { libc::setns(f_ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("namespace thread")
}

/// One management request from namespace `ns`, proving `secret`.
fn call(ns: &str, secret: &[u8], addr: &'static str, req: Value) -> std::io::Result<Value> {
    let secret = secret.to_vec();
    in_ns(ns, move || {
        mgmt::call_with_secret(addr, &req, Some(&secret))
    })
}

const A_MGMT: &str = "tcp:10.77.0.1:24007";
const B_MGMT: &str = "tcp:10.77.0.2:24007";

fn online(status: &Value) -> Vec<bool> {
    status["volumes"][0]["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["online"] == true)
        .collect()
}

#[test]
fn a_volume_over_two_hosts_is_managed_from_either() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipping: network namespaces need root");
        return;
    }
    let mut net = match Net::setup() {
        Ok(n) => n,
        Err(e) => {
            println!("skipping: cannot set up network namespaces: {e}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let (state_a, state_b) = (tmp.path().join("state-a"), tmp.path().join("state-b"));
    let (brick_a, brick_b) = (tmp.path().join("brick-a"), tmp.path().join("brick-b"));
    let (a, b) = (net.a.clone(), net.b.clone());
    net.kilnd(&a, &state_a, &[]);
    // Host b first comes up with a management secret of its own.
    net.kilnd(&b, &state_b, &[]);
    let secret_file = state_a.join("mgmt.secret");
    let secret = std::fs::read_to_string(&secret_file)
        .unwrap()
        .trim()
        .to_owned();
    let secret = secret.as_bytes();
    assert_ne!(
        std::fs::read_to_string(state_b.join("mgmt.secret")).unwrap(),
        std::fs::read_to_string(&secret_file).unwrap(),
        "each kilnd made its own secret"
    );

    // Create on host a: one brick here, one on host b (default management port).
    let bricks = [
        format!("{A_IP}:{}", brick_a.display()),
        format!("{B_IP}:{}", brick_b.display()),
    ];
    let create = json!({ "cmd": "create", "name": "nv", "replica": 2, "bricks": bricks });
    // Host b does not hold host a's secret: host a refuses to send it the volume (and its
    // secret), says why, and keeps nothing.
    let err = call(&a, secret, A_MGMT, create.clone()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("not created")
            && msg.contains("refused this host's management secret")
            && msg.contains("same one"),
        "{msg}"
    );
    assert!(!state_a.join("vols/nv").exists() && !state_b.join("vols/nv").exists());
    // Share the secret the documented way: copy host a's file to host b, restart host b.
    let mut old_b = net.procs.remove(1);
    net.states.remove(1);
    let _ = old_b.kill();
    let _ = old_b.wait();
    std::fs::copy(&secret_file, state_b.join("mgmt.secret")).unwrap();
    net.kilnd(&b, &state_b, &[]);

    let r = call(&a, secret, A_MGMT, create).unwrap();
    assert_eq!(r["volume"]["authority"], Value::Null, "{r}");
    assert!(brick_b.is_dir(), "host b created its brick directory");
    // Host b holds a copy naming host a the authority, and the volume's secret.
    let info_b = call(&b, secret, B_MGMT, json!({ "cmd": "info", "name": "nv" })).unwrap();
    assert_eq!(info_b["volumes"][0]["authority"], A_MGMT, "{info_b}");
    assert_eq!(
        std::fs::read_to_string(state_a.join("vols/nv/secret")).unwrap(),
        std::fs::read_to_string(state_b.join("vols/nv/secret")).unwrap()
    );

    call(&a, secret, A_MGMT, json!({ "cmd": "start", "name": "nv" })).unwrap();

    // Status and volfile from host b.
    let st = call(&b, secret, B_MGMT, json!({ "cmd": "status", "name": "nv" })).unwrap();
    assert_eq!(online(&st), [true, true], "{st}");
    let vf = in_ns(&b, || mgmt::fetch_volfile(B_MGMT, "nv")).unwrap();
    let remotes: Vec<String> = vf
        .layers
        .iter()
        .filter_map(|l| match &l.kind {
            LayerKind::ProtocolClient { remote, .. } => Some(remote.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(remotes.len(), 2, "{vf:?}");
    assert!(
        remotes[0].starts_with(&format!("tcp:{A_IP}:")),
        "{remotes:?}"
    );
    // Host b's own brick is offered at its Unix socket first, then over TCP.
    let (sock, tcp) = remotes[1]
        .split_once(',')
        .expect("two addresses for b's brick");
    assert!(
        sock.starts_with("unix:") && sock.ends_with("nv-1.sock"),
        "{remotes:?}"
    );
    assert!(tcp.starts_with(&format!("tcp:{B_IP}:")), "{remotes:?}");
    assert_eq!(
        vf.layers[1].kind,
        LayerKind::Replicate {
            quorum: None,
            timeout: None
        }
    );

    // Data through the volfile host b handed out, from host a, with host a's secret.
    let vol_secret = mgmt::secret_file_in("nv", None, &state_a).unwrap();
    // SAFETY (edition 2021: safe fn): set before the client threads start; nothing else in
    // this test binary reads the environment concurrently.
    std::env::set_var("KILN_SECRET_FILE", &vol_secret);
    let data: Vec<u8> = (0..64 * 1024).map(|i| (i % 239) as u8).collect();
    let expect = data.clone();
    let back = in_ns(&a, move || {
        let v = Volume::from_volfile(&vf).unwrap();
        let (fd, _) = block_on(v.create("/across", libc::O_RDWR, 0o644)).unwrap();
        let (n, _) = block_on(v.pwritev(&fd, vec![data], 0));
        assert_eq!(n.unwrap(), 64 * 1024);
        let (n, bufs) = block_on(v.preadv(&fd, vec![vec![0u8; 64 * 1024]], 0));
        assert_eq!(n.unwrap(), 64 * 1024);
        block_on(v.close(fd)).unwrap();
        bufs.concat()
    });
    assert_eq!(back, expect);
    assert!(
        brick_a.join("across").exists(),
        "the file is on host a's brick"
    );
    assert_eq!(
        std::fs::metadata(brick_b.join("across"))
            .map(|m| m.len())
            .ok(),
        Some(64 * 1024),
        "and replicated to host b's"
    );

    // Host b's kilnd dies and comes back: it adopts its running brick from its cached copy.
    // This time it names the shared secret with --mgmt-secret-file, the other documented way.
    let mut old_b = net.procs.remove(1);
    net.states.remove(1);
    let _ = old_b.kill();
    let _ = old_b.wait();
    net.kilnd(
        &b,
        &state_b,
        &[Path::new("--mgmt-secret-file"), secret_file.as_path()],
    );
    let st = call(&b, secret, B_MGMT, json!({ "cmd": "status", "name": "nv" })).unwrap();
    assert_eq!(online(&st), [true, true], "{st}");

    // A change asked of host b goes to the authority, which stops both bricks.
    call(&b, secret, B_MGMT, json!({ "cmd": "stop", "name": "nv" })).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = call(&a, secret, A_MGMT, json!({ "cmd": "status", "name": "nv" })).unwrap();
        if online(&st) == [false, false] {
            assert_eq!(st["volumes"][0]["state"], "stopped");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bricks still up after stop: {st}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Delete on the authority; host b forgets its copy.
    call(&a, secret, A_MGMT, json!({ "cmd": "delete", "name": "nv" })).unwrap();
    let list_b = call(&b, secret, B_MGMT, json!({ "cmd": "list" })).unwrap();
    assert_eq!(list_b["volumes"], json!([]), "{list_b}");
    assert!(brick_b.is_dir(), "the data stays");
}
