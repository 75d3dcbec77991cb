//! Replicate reads from the replica on the client's own host: one brick on this host and two
//! in a network namespace (another "host", reached over a veth pair). Handles opened while all
//! three are up; then the two remote bricks are frozen (SIGSTOP) and every handle must still
//! read at once — which only holds if every handle prefers the local replica. Needs root and
//! `ip netns`; skips (saying why) without them.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kiln_client::{block_on, Volume};
use kiln_layer::replicate::ReplicateConfig;
use kiln_layer::volfile::{LayerDef, LayerKind, ProtocolClientConfig, Volfile};
use kiln_testkit::net::Veth;

/// A namespace joined to this one by a veth pair; bricks started in it die with it.
struct Remote {
    link: Veth,
    bricks: Vec<Child>,
}

impl Drop for Remote {
    fn drop(&mut self) {
        for c in &mut self.bricks {
            // SAFETY: kill(2) with a pid and a signal number has no memory effects.
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts a replica brick (marks over posix) on `dir`, in namespace `ns` if given, listening
/// on `ip`; returns the process and its address.
fn brick(ns: Option<&str>, dir: &std::path::Path, ip_addr: &str) -> (Child, String) {
    std::fs::create_dir_all(dir).unwrap();
    let vf = dir.with_extension("toml");
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::write(&vf, kiln_server::replica_volfile(dir, &name).to_toml()).unwrap();
    let mut cmd = kiln_testkit::net::command_in(ns, env!("CARGO_BIN_EXE_kilnd"));
    cmd.arg("--volfile")
        .arg(&vf)
        .args(["--listen", &format!("tcp:{ip_addr}:0"), "--metrics", "off"])
        .stderr(Stdio::null());
    kiln_testkit::daemon::spawn_listening(&mut cmd)
}

#[test]
fn reads_stay_on_the_replica_of_this_host() {
    if !kiln_testkit::is_root() {
        eprintln!("skipped: needs root for network namespaces");
        return;
    }
    let mut remote = match Veth::new("klr", 78).map(|link| Remote {
        link,
        bricks: Vec::new(),
    }) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| -> PathBuf { tmp.path().join(n) };
    let (b1, a1) = brick(Some(&remote.link.ns), &dir("far1"), &remote.link.far_ip);
    remote.bricks.push(b1);
    let (local, local_addr) = brick(None, &dir("near"), "127.0.0.1");
    let mut local = scopeguard(local);
    let (b2, a2) = brick(Some(&remote.link.ns), &dir("far2"), &remote.link.far_ip);
    remote.bricks.push(b2);
    // The local brick in the middle: a preference that ignored locality and started at the
    // first replica, or took turns over all three, would send most handles far.
    let addrs = [a1, local_addr, a2];
    let mut layers = vec![LayerDef {
        name: "rep".into(),
        subvolumes: (0..3).map(|i| format!("client-{i}")).collect(),
        kind: LayerKind::Replicate(ReplicateConfig::default()),
    }];
    for (i, a) in addrs.iter().enumerate() {
        layers.push(LayerDef {
            name: format!("client-{i}"),
            subvolumes: Vec::new(),
            kind: LayerKind::ProtocolClient(ProtocolClientConfig::to(a)),
        });
    }
    let v = Volume::from_volfile(&Volfile { layers }).expect("volume");
    let data: Vec<u8> = (0..1 << 20).map(|i| (i % 249) as u8).collect();
    let (fd, _) = block_on(v.create("/f", libc::O_RDWR, 0o644)).unwrap();
    assert_eq!(
        block_on(v.pwritev(&fd, vec![data.clone()], 0)).0.unwrap(),
        1 << 20
    );
    block_on(v.close(fd)).unwrap();
    let handles: Vec<_> = (0..12)
        .map(|_| block_on(v.open("/f", libc::O_RDONLY)).unwrap())
        .collect();

    // Freeze the far bricks: a read sent there would not come back.
    for c in &remote.bricks {
        // SAFETY: kill(2) with a pid and a signal number has no memory effects.
        unsafe { libc::kill(c.id() as i32, libc::SIGSTOP) };
    }
    let v = std::sync::Arc::new(v);
    let (tx, rx) = mpsc::channel();
    for (k, fd) in handles.iter().enumerate() {
        let (v, fd, tx) = (v.clone(), fd.clone(), tx.clone());
        std::thread::spawn(move || {
            let off = (k as u64 * 65536) % (1 << 20);
            let (n, bufs) = block_on(v.preadv(&fd, vec![vec![0u8; 65536]], off));
            let _ = tx.send((k, n.map(|n| (n, bufs))));
        });
    }
    for _ in 0..handles.len() {
        let (k, r) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a read went to a frozen far replica instead of the local one");
        let (n, bufs) = r.unwrap_or_else(|e| panic!("read {k}: {e}"));
        let off = (k * 65536) % (1 << 20);
        assert_eq!(n, 65536);
        assert_eq!(bufs[0], data[off..off + 65536], "read {k}");
    }
    for c in &remote.bricks {
        // SAFETY: as above.
        unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
    }
    for fd in handles {
        block_on(v.close(fd)).unwrap();
    }
    let _ = local.0.kill();
}

/// Kills the child when dropped.
struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
fn scopeguard(c: Child) -> Guard {
    Guard(c)
}
