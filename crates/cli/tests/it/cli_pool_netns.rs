//! A trusted storage pool over real hosts: network namespaces on one bridge, a management
//! kilnd in each (`kiln server`), driven with `kiln peer|pool|volume` as an operator would.
//!
//! One test, in stages, because a pool of three takes seconds to form and to fail over:
//! - every kilnd serves and dials with a TLS identity of its own (`kiln tls`); a kilnd with
//!   another management secret cannot be probed; three that share one form a pool, and a
//!   replica-3 volume is created across them and started from different members, while
//!   tcpdump on the bridge finds no secret (and no definition) in what crossed the wire;
//! - seeded runs: a command (`set`, `create`) goes to a member and the leader is killed with
//!   SIGKILL at a random moment; the command is made whole or not at all, a survivor takes
//!   the next command, the killed host restarts and catches up (every member at the same
//!   version, the same definitions);
//! - a partition (one host's link down): the majority side changes, the minority refuses
//!   with a clear error, and after the link is back all agree;
//! - a rolling restart of the three kilnds under a FUSE mount in a fourth namespace with fio
//!   writing and verifying: no I/O error;
//! - a member holding bricks cannot be detached; a fourth host joins, is detached and is alone
//!   again.
//!
//! `KILN_RUNS=N` sets the seeded runs (default 6), `KILN_SEED=S` repeats one. Needs root,
//! `ip netns`, fio and tcpdump; skips (saying why) without namespaces.

use crate::common;
use crate::hosts;
#[path = "pool_netns/identities.rs"]
mod identities;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::wait_for;
use hosts::Hosts;
use serde_json::Value;

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// tcpdump on every port of the bridge (every packet between the hosts), to a file.
struct Capture {
    child: Child,
    file: PathBuf,
    err: BufReader<std::process::ChildStderr>,
}

impl Capture {
    fn start(ns: &str, file: &Path) -> Capture {
        let mut child = Command::new("ip")
            .args([
                "netns", "exec", ns, "tcpdump", "-i", "br0", "-U", "-s", "0", "-w",
            ])
            .arg(file)
            .stderr(Stdio::piped())
            .spawn()
            .expect("tcpdump (scripts/test.sh installs it)");
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        while !line.contains("listening on") {
            line.clear();
            assert!(
                err.read_line(&mut line).unwrap() > 0,
                "tcpdump did not start"
            );
        }
        Capture {
            child,
            file: file.to_owned(),
            err,
        }
    }

    /// Stops the capture (SIGINT: tcpdump writes what it has) and returns the file's bytes.
    fn stop(mut self) -> Vec<u8> {
        // Packets reach the file as tcpdump reads them from its ring, a while after they
        // crossed: stop once it has written some and nothing new for half a second.
        let (mut size, mut since) = (0, Instant::now());
        wait_for("tcpdump to catch up", 20, || {
            let now = std::fs::metadata(&self.file).map_or(0, |m| m.len());
            if now != size {
                (size, since) = (now, Instant::now());
            }
            size > 24 && since.elapsed() >= Duration::from_millis(500)
        });
        // SAFETY: kill(2) with a pid and a signal number has no memory effects.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut self.err, &mut rest);
        let pcap = std::fs::read(&self.file).unwrap();
        println!(
            "tcpdump: {} bytes; {}",
            pcap.len(),
            rest.replace('\n', "; ")
        );
        pcap
    }
}

/// A small deterministic generator for the runs' timings.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The volume definitions a member holds (name → JSON), without the bricks' pids and ports
/// (which the restore of a killed host may still be recording).
fn defs(info: &Value) -> Vec<(String, String, String)> {
    info["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_owned(),
                v["state"].to_string(),
                v["io_timeout"].to_string(),
            )
        })
        .collect()
}

#[test]
fn a_pool_of_three_hosts_survives_leader_kills_partitions_and_restarts() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(mut h) = Hosts::for_test(4, tmp.path()) else {
        return;
    };
    let begun = Instant::now();
    h.issue_identities();
    // Host 2 first starts with a management secret of its own: it cannot be probed.
    h.start(0);
    h.start(1);
    h.start(2);
    let out = h.kiln_at(0, &["peer", "probe", &h.ip(2)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("management secret"),
        "{err}"
    );
    for i in [1, 2] {
        h.stop(i, false);
        std::fs::copy(
            h.state(0).join("mgmt.secret"),
            h.state(i).join("mgmt.secret"),
        )
        .unwrap();
        h.start(i);
    }
    let p = h.ok(0, &["peer", "probe", &h.ip(1)]);
    assert_eq!(p["members"], 2, "{p}");
    // Asked of a member that is not the leader, a probe is made by the leader.
    let p = h.ok(1, &["peer", "probe", &format!("{}:24007", h.ip(2))]);
    assert_eq!(p["members"], 3, "{p}");
    let pool = h.pool(2);
    let members = pool["members"].as_array().unwrap();
    assert_eq!(members.len(), 3, "{pool}");
    assert!(members.iter().all(|m| m["reachable"] == true), "{pool}");
    assert_eq!(
        members.iter().filter(|m| m["role"] == "leader").count(),
        1,
        "{pool}"
    );
    // A host not in the pool cannot hold a brick.
    let out = h.kiln_at(0, &["volume", "create", "x", &format!("{}:/x", h.ip(3))]);
    assert!(!out.status.success());
    // A brick in another host's state directory: the member that takes the definition cannot
    // see that directory, so the brick's own host refuses to run it (its clients would read
    // the pool's secrets), and the volume stays unstarted.
    let leak = format!("{}:{}", h.ip(1), h.state(1).join("vols/leak").display());
    h.ok(0, &["volume", "create", "leak", &leak]);
    let out = h.kiln_at(0, &["volume", "start", "leak"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("kilnd's state directory"),
        "{err}"
    );
    h.ok(0, &["volume", "delete", "leak", "--yes"]);

    // A replica-3 volume across the hosts, created on one member and started on another.
    let bricks: Vec<String> = (0..3)
        .map(|i| {
            format!(
                "{}:{}",
                h.ip(i),
                tmp.path().join(format!("brick{i}")).display()
            )
        })
        .collect();
    let mut create = vec!["volume", "create", "pv", "replica", "3"];
    create.extend(bricks.iter().map(String::as_str));
    // Everything on the wire between the hosts meanwhile is captured on the bridge.
    let capture = Capture::start(&h.ns_name("sw"), &tmp.path().join("create.pcap"));
    h.ok(1, &create);
    h.ok(2, &["volume", "start", "pv"]);
    h.agreed_version(30);
    let wire = capture.stop();
    let vol_secret = std::fs::read_to_string(h.state(0).join("vols/pv/secret")).unwrap();
    let mgmt_secret = std::fs::read_to_string(h.state(0).join("mgmt.secret")).unwrap();
    assert!(
        contains(&wire, b"\x17\x03\x03") && wire.len() > 10_000,
        "the capture saw the pool's TLS traffic ({} bytes)",
        wire.len()
    );
    for s in [vol_secret.trim(), mgmt_secret.trim()] {
        assert!(
            !contains(&wire, s.as_bytes()),
            "a secret crossed the wire in clear text"
        );
    }
    // Not even the volume's name or its bricks' directories are readable there.
    assert!(
        !contains(&wire, b"brick1"),
        "definitions crossed the wire in clear text"
    );
    let st = h.ok(0, &["volume", "status", "pv"]);
    let online: Vec<bool> = st["volumes"][0]["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["online"] == true)
        .collect();
    assert_eq!(online, [true; 3], "{st}");
    for i in 0..3 {
        assert!(
            h.state(i).join("vols/pv/secret").exists(),
            "host {i} holds the volume's secret"
        );
    }

    // Each phase's time is printed: this is CI's longest test, and the first place to look
    // when CI grows slow.
    println!("the pool and its volume were made in {:?}", begun.elapsed());
    let t0 = Instant::now();
    leader_kills(&mut h);
    println!("leader kills took {:?}", t0.elapsed());
    let t0 = Instant::now();
    partition(&mut h);
    println!("partitions took {:?}", t0.elapsed());
    let t0 = Instant::now();
    rolling_restart(&mut h, tmp.path());
    println!("rolling restart and growth took {:?}", t0.elapsed());

    let t0 = Instant::now();
    identities::identities_across_the_pool(&h, tmp.path());
    println!("identities across the pool took {:?}", t0.elapsed());

    // A member holding bricks is not detached; one without is, and forgets the pool.
    let out = h.kiln_at(0, &["peer", "detach", &h.ip(2)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("holds bricks of volume")
            && !err.contains("made or not"),
        "{err}"
    );
    std::fs::create_dir_all(h.state(3)).unwrap();
    std::fs::copy(
        h.state(0).join("mgmt.secret"),
        h.state(3).join("mgmt.secret"),
    )
    .unwrap();
    h.start(3);
    h.ok(0, &["peer", "probe", &h.ip(3)]);
    assert_eq!(h.pool(3)["members"].as_array().unwrap().len(), 4);
    h.ok(1, &["peer", "detach", &h.ip(3)]);
    wait_for("the detached host to be alone", 30, || {
        h.pool(3)["members"][0]["role"] == "alone"
    });
    assert_eq!(h.pool(0)["members"].as_array().unwrap().len(), 3);
}

/// Seeded runs of "a command, and the leader killed meanwhile": 4 per CI run (each a new seed;
/// a failure prints it), KILN_RUNS=N for a longer soak.
fn leader_kills(h: &mut Hosts) {
    let runs: u64 = std::env::var("KILN_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(4);
    let base: u64 = std::env::var("KILN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let mut made = 0;
    // Per command: (runs, made whole).
    let mut kinds: std::collections::BTreeMap<String, (u32, u32)> = Default::default();
    for run in 0..runs {
        let seed = base.wrapping_add(run * 0x9e37_79b9) | 1;
        let mut rng = Rng(seed);
        let leader = h.settled_leader(30);
        // The command goes to a random member (the leader itself, or one that forwards).
        let to = rng.below(3) as usize;
        let name = format!("k{run}");
        let timeout = (10 + run).to_string();
        let dir = h.tmp.join(format!("extra-{name}"));
        let brick = format!("{}:{}", h.ip(rng.below(3) as usize), dir.display());
        let args: Vec<&str> = match rng.below(3) {
            0 => vec!["volume", "set", "pv", "io-timeout", &timeout],
            1 => vec!["volume", "create", &name, &brick],
            _ => {
                // A volume to start, made before the kill.
                h.ok(leader, &["volume", "create", &name, &brick]);
                vec!["volume", "start", &name]
            }
        };
        let before = defs(&h.info(leader));
        let delay = Duration::from_micros(rng.below(400_000));
        let secret = h.state(0).join("mgmt.secret");
        let mut cmd = kiln_testkit::net::command_in(Some(&h.ns(to)), env!("CARGO_BIN_EXE_kiln"));
        cmd.args(&args)
            .args(["--server", &h.mgmt(to), "--json", "--mgmt-secret-file"])
            .arg(&secret)
            .env("KILN_TLS_DIR", h.client_tls())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().unwrap();
        std::thread::sleep(delay);
        h.stop(leader, true);
        let out = child.wait_with_output().unwrap();
        let said_ok = out.status.success();
        // The survivors elect a leader and take the next command.
        let next = h.settled_leader(30);
        assert_ne!(next, leader, "seed {seed}");
        let survivor = h.up()[0];
        let after = defs(&h.info(survivor));
        let wanted: Vec<(String, String, String)> = if args[1] == "start" {
            before
                .iter()
                .map(|(n, s, t)| match *n == name {
                    true => (n.clone(), "\"started\"".into(), t.clone()),
                    false => (n.clone(), s.clone(), t.clone()),
                })
                .collect()
        } else if args[1] == "set" {
            before
                .iter()
                .map(|(n, s, t)| {
                    let t = if n == "pv" {
                        timeout.clone()
                    } else {
                        t.clone()
                    };
                    (n.clone(), s.clone(), t)
                })
                .collect()
        } else {
            let mut w = before.clone();
            w.push((name.clone(), "\"created\"".into(), "null".into()));
            w.sort();
            w
        };
        let whole = after == wanted;
        assert!(
            whole || after == before,
            "seed {seed}: {args:?} left a half change: before {before:?}, after {after:?}"
        );
        if said_ok {
            assert!(
                whole,
                "seed {seed}: {args:?} said done but is not: {after:?}"
            );
        }
        made += whole as u32;
        let k = kinds.entry(args[1].to_owned()).or_default();
        k.0 += 1;
        k.1 += whole as u32;
        // A created volume's secret reaches every survivor with it, or neither is there.
        if args[1] == "create" {
            for &i in &h.up() {
                let p = h.state(i).join(format!("vols/{name}/secret"));
                wait_for("the secret to follow the definition", 10, || {
                    p.exists() == whole
                });
            }
        }
        h.ok(survivor, &["volume", "set", "pv", "io-timeout", "30"]);
        // The killed host comes back and catches up.
        h.start(leader);
        let v = h.agreed_version(30);
        let all: Vec<_> = (0..3).map(|i| defs(&h.info(i))).collect();
        assert!(
            all.iter().all(|d| *d == all[0]),
            "seed {seed}: members disagree at version {v}: {all:?}"
        );
        if args[1] == "start" {
            started_whole_or_no_bricks(h, &name, whole, seed);
        }
    }
    println!(
        "{runs} leader kills: {made} commands made whole, the rest not at all; \
         (runs, made) per command: {kinds:?}"
    );
}

/// After a `start` whose leader was killed: started, its brick runs and answers; not
/// started, no brick process of it is left on any host (the orphan reaper's work).
fn started_whole_or_no_bricks(h: &Hosts, name: &str, whole: bool, seed: u64) {
    let procs = || -> Vec<u32> { (0..3).flat_map(|i| brick_pids(&h.state(i), name)).collect() };
    if whole {
        h.ok(h.up()[0], &["volume", "start", name, "force"]);
        let st = h.ok(h.up()[0], &["volume", "status", name]);
        let online = st["volumes"][0]["bricks"][0]["online"] == true;
        assert!(
            online,
            "seed {seed}: started {name} has its brick down: {st}"
        );
        assert_eq!(
            procs().len(),
            1,
            "seed {seed}: {name} runs more than one brick"
        );
    } else {
        wait_for("the bricks of a volume not started to stop", 30, || {
            procs().is_empty()
        });
    }
}

/// The processes running a brick of `vol` from the state directory `state`.
fn brick_pids(state: &Path, vol: &str) -> Vec<u32> {
    let want = state.join("vols").join(vol).join("bricks");
    let want = want.as_os_str().as_encoded_bytes();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        if !zombie && cmd.split(|b| *b == 0).any(|a| a.starts_with(want)) {
            out.push(pid);
        }
    }
    out
}

/// One host cut off: the majority changes, the minority refuses, and all agree afterwards.
fn partition(h: &mut Hosts) {
    // Cut off a follower, then (a second time) the leader itself.
    for cut_leader in [false, true] {
        // (The leader is asked for anew: the second cut takes the one the first left.)
        let leader = h.settled_leader(30);
        let cut = if cut_leader { leader } else { (leader + 1) % 3 };
        h.link(cut, false);
        let rest: Vec<usize> = (0..3).filter(|&i| i != cut).collect();
        let value = (40 + cut).to_string();
        // The cut-off host is asked meanwhile: it waits its patience for a majority (10 s)
        // while the majority elects a leader and takes its change; then it says so, in one
        // sentence whatever it was waiting for.
        let asked = Instant::now();
        let alone = h
            .kiln_cmd(cut, &["volume", "set", "pv", "io-timeout", "77"])
            .spawn()
            .expect("run kiln");
        let t0 = Instant::now();
        h.ok(rest[0], &["volume", "set", "pv", "io-timeout", &value]);
        let took = t0.elapsed();
        let out = alone.wait_with_output().expect("run kiln");
        let refused_after = asked.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("the pool has no leader"),
            "the cut-off host took a change, or said something else: {err}"
        );
        assert!(
            refused_after < Duration::from_secs(12),
            "the cut-off host answered after {refused_after:?}"
        );
        h.link(cut, true);
        h.agreed_version(30);
        // `volume set` on one host is what `volume get` says on every host.
        for i in 0..3 {
            let got = h.ok(i, &["volume", "get", "pv", "io-timeout"]);
            assert_eq!(got["options"][0]["value"], value, "host {i}: {got}");
        }
        let what = if cut_leader {
            "the leader"
        } else {
            "a follower"
        };
        println!(
            "{what} (host {cut}) cut off: the majority's change took {took:?}, the cut-off \
             host refused its own after {refused_after:?}"
        );
    }
}

/// Every kilnd restarted in turn under a mounted volume with fio writing and verifying.
/// A second replica set across the three hosts, added while the mount (in the client
/// namespace) writes: it switches to the grown graph by itself, and new files land on the new
/// set — on all three hosts alike.
fn grow_under_the_mount(h: &Hosts, mnt: &Path) {
    let dirs: Vec<PathBuf> = (0..3).map(|i| h.tmp.join(format!("grow-{i}"))).collect();
    let specs: Vec<String> = (0..3)
        .map(|i| format!("{}:{}", h.ip(i), dirs[i].display()))
        .collect();
    let mut args = vec!["volume", "add-brick", "pv", "replica", "3"];
    args.extend(specs.iter().map(String::as_str));
    h.ok(1, &args);
    for i in 0..3 {
        let info = h.info(i);
        let n = info["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "pv")
            .map(|v| v["bricks"].as_array().unwrap().len());
        assert_eq!(n, Some(6), "host {i} sees the grown volume");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for k in 0.. {
        let name = format!("grown-{k}");
        std::fs::write(mnt.join(&name), name.as_bytes()).unwrap();
        let copies: Vec<Option<Vec<u8>>> = dirs
            .iter()
            .map(|d| std::fs::read(d.join(&name)).ok())
            .collect();
        if copies.iter().all(|c| c.as_deref() == Some(name.as_bytes())) {
            break;
        }
        if Instant::now() > deadline {
            let vf = h.kiln_at(0, &["volume", "volfile", "pv"]);
            panic!(
                "no new file landed on the new replica set in 30 s (last {name}: {copies:?});\
                 status {}\nvolfile at host 0: {}{}",
                h.ok(0, &["volume", "status", "pv"]),
                String::from_utf8_lossy(&vf.stdout),
                String::from_utf8_lossy(&vf.stderr)
            );
        }
    }
    // A rebalance across the hosts, under the mount: asked at one member, run by the leader,
    // followed to its end and seen the same from another member.
    let out = h.kiln_at(2, &["volume", "rebalance", "pv", "start", "--wait"]);
    assert!(
        out.status.success(),
        "rebalance at host 2: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = h.ok(0, &["volume", "rebalance", "pv", "status"]);
    assert_eq!(st["state"], "completed", "{st}");
    assert_eq!(st["failed"], 0, "{st}");
}

fn rolling_restart(h: &mut Hosts, tmp: &Path) {
    let mnt = tmp.join("mnt");
    let _mount = h.mount_at_client("pv", &mnt);
    let fio = std::thread::spawn({
        let mnt = mnt.clone();
        move || common::fio::randwrite_verify(&mnt, "roll", Duration::from_secs(20))
    });
    for i in 0..3 {
        h.stop(i, false);
        h.start(i);
        h.agreed_version(30);
    }
    grow_under_the_mount(h, &mnt);
    let out = fio.join().unwrap();
    assert_eq!(
        out.errors,
        Some(0),
        "fio under a rolling restart: {}",
        out.text
    );
}
