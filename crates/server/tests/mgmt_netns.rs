//! Volume management across two hosts: two network namespaces joined by a veth pair, a
//! management kilnd in each. The volume is created on host a with one brick on each host;
//! host b answers status and hands out the volfile from its cached copy; data written from
//! host a lands on both bricks. Needs root and `ip netns`; skips (saying why) without them.

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

    /// Starts a management kilnd in namespace `ns`, listening on every address of it.
    fn kilnd(&mut self, ns: &str, state: &Path) {
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

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
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

fn call(ns: &str, addr: &'static str, req: Value) -> std::io::Result<Value> {
    in_ns(ns, move || mgmt::call(addr, &req))
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
    net.kilnd(&a, &state_a);
    net.kilnd(&b, &state_b);

    // Create on host a: one brick here, one on host b (default management port).
    let bricks = [
        format!("{A_IP}:{}", brick_a.display()),
        format!("{B_IP}:{}", brick_b.display()),
    ];
    let r = call(
        &a,
        A_MGMT,
        json!({ "cmd": "create", "name": "nv", "replica": 2, "bricks": bricks }),
    )
    .unwrap();
    assert_eq!(r["volume"]["authority"], Value::Null, "{r}");
    assert!(brick_b.is_dir(), "host b created its brick directory");
    // Host b holds a copy naming host a the authority, and the volume's secret.
    let info_b = call(&b, B_MGMT, json!({ "cmd": "info", "name": "nv" })).unwrap();
    assert_eq!(info_b["volumes"][0]["authority"], A_MGMT, "{info_b}");
    assert_eq!(
        std::fs::read_to_string(state_a.join("vols/nv/secret")).unwrap(),
        std::fs::read_to_string(state_b.join("vols/nv/secret")).unwrap()
    );

    call(&a, A_MGMT, json!({ "cmd": "start", "name": "nv" })).unwrap();

    // Status and volfile from host b.
    let st = call(&b, B_MGMT, json!({ "cmd": "status", "name": "nv" })).unwrap();
    assert_eq!(online(&st), [true, true], "{st}");
    let vf = in_ns(&b, || mgmt::fetch_volfile(B_MGMT, "nv")).unwrap();
    let remotes: Vec<String> = vf
        .layers
        .iter()
        .filter_map(|l| match &l.kind {
            LayerKind::ProtocolClient { remote } => Some(remote.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(remotes.len(), 2, "{vf:?}");
    assert!(
        remotes[0].starts_with(&format!("tcp:{A_IP}:")),
        "{remotes:?}"
    );
    assert!(
        remotes[1].starts_with(&format!("tcp:{B_IP}:")),
        "{remotes:?}"
    );
    assert_eq!(vf.layers[1].kind, LayerKind::Replicate { quorum: None });

    // Data through the volfile host b handed out, from host a, with host a's secret.
    let secret = mgmt::secret_file_in("nv", None, &state_a).unwrap();
    // SAFETY (edition 2021: safe fn): set before the client threads start; nothing else in
    // this test binary reads the environment concurrently.
    std::env::set_var("KILN_SECRET_FILE", &secret);
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
    let mut old_b = net.procs.remove(1);
    let _ = old_b.kill();
    let _ = old_b.wait();
    net.kilnd(&b, &state_b);
    let st = call(&b, B_MGMT, json!({ "cmd": "status", "name": "nv" })).unwrap();
    assert_eq!(online(&st), [true, true], "{st}");

    // A change asked of host b goes to the authority, which stops both bricks.
    call(&b, B_MGMT, json!({ "cmd": "stop", "name": "nv" })).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = call(&a, A_MGMT, json!({ "cmd": "status", "name": "nv" })).unwrap();
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
    call(&a, A_MGMT, json!({ "cmd": "delete", "name": "nv" })).unwrap();
    let list_b = call(&b, B_MGMT, json!({ "cmd": "list" })).unwrap();
    assert_eq!(list_b["volumes"], json!([]), "{list_b}");
    assert!(brick_b.is_dir(), "the data stays");
}
