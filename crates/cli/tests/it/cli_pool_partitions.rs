//! Partitions of a pool of three hosts (network namespaces on one bridge, a kilnd in each, a
//! replica-3 volume across them, a client host mounting it), timed:
//! - a follower cut off for longer than an election timeout, ten times: when it returns the
//!   leader stays, at the same term, and the pool is never without a leader — the cut-off
//!   member did not spend a term meanwhile (pre-vote);
//! - fio randwrite 4k QD8 with crc32c verify through the mount while one server's link is down
//!   for 20 s and for 60 s, a follower's and the leader's: the slowest write (and read of the
//!   verify pass) takes at most 2 s (the mount declares the silent bricks away), fio sees no
//!   error, the mount logs the brick going away and coming back once each, and after a heal
//!   the three copies are the same bytes;
//! - fio through the mount with every CPU saturated by other processes and no fault: no brick
//!   is declared away.
//!
//! Each of the four tests (the returns, the busy run, a follower's outages, the leader's) has
//! a pool of its own, so they run beside each other. `KILN_RETURNS=N` sets the returns
//! (default 10), `KILN_CUTS=20,60` the outages in seconds, `KILN_SOAK_SECS=S` the busy run
//! (default 30). Needs root, `ip netns` and fio; skips (saying why) without namespaces.

use crate::common;
use crate::hosts;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::wait_for;
use hosts::Hosts;
use serde_json::Value;

/// The slowest write (or read) the outage may cost.
const MAX_IO: Duration = Duration::from_secs(2);

/// A pool of three hosts and a client host, formed; None (having said why) when this machine
/// cannot run the test.
fn pool(tmp: &Path) -> Option<Hosts> {
    let mut h = Hosts::for_test(4, tmp)?;
    h.form_pool("pv");
    Some(h)
}

#[test]
fn ten_follower_returns_keep_the_leader_and_its_term() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(h) = pool(tmp.path()) else {
        return;
    };
    let returns = std::env::var("KILN_RETURNS").map_or(10, |v| v.parse().unwrap());
    let t0 = Instant::now();
    for run in 0..returns {
        a_follower_returns(&h, run);
    }
    println!("{returns} returns took {:?}", t0.elapsed());
}

/// Takes the machine alone (`.config/nextest.toml`): its load is the test's own.
#[test]
fn a_busy_pool_declares_no_brick_away() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(h) = pool(tmp.path()) else {
        return;
    };
    let mnt = tmp.path().join("mnt");
    let _mount = h.mount_at_client("pv", &mnt);
    let soak = std::env::var("KILN_SOAK_SECS").map_or(30, |v| v.parse().unwrap());
    busy_without_faults(&h, &mnt, Duration::from_secs(soak));
}

#[test]
fn a_follower_off_the_network_costs_writes_at_most_two_seconds() {
    outages(false);
}

#[test]
fn the_leader_off_the_network_costs_writes_at_most_two_seconds() {
    outages(true);
}

/// [`writes_through_an_outage`] for each length in `KILN_CUTS` (seconds, default 20,60), on
/// a pool of its own.
fn outages(cut_leader: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let Some(h) = pool(tmp.path()) else {
        return;
    };
    let mnt = tmp.path().join("mnt");
    let _mount = h.mount_at_client("pv", &mnt);
    let cuts = std::env::var("KILN_CUTS").unwrap_or_else(|_| "20,60".into());
    for secs in cuts
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u64>().unwrap())
    {
        writes_through_an_outage(&h, &mnt, Duration::from_secs(secs), cut_leader);
    }
}

/// Processes that spin on every CPU until dropped: a host saturated by someone else's work.
struct Hogs(Vec<std::process::Child>);

impl Hogs {
    fn start() -> Hogs {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let spin = || {
            Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .expect("spawn a CPU hog")
        };
        Hogs((0..cpus).map(|_| spin()).collect())
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The bricks declared away so far in the mount's log.
fn away_so_far(h: &Hosts) -> usize {
    (0..3).map(|i| h.mount_says("pv", "brick away", i)).sum()
}

/// fio through the mount for `soak` with every CPU saturated by other processes and no fault:
/// no brick is declared away (a slow host is not a lost one).
fn busy_without_faults(h: &Hosts, mnt: &Path, soak: Duration) {
    let before = away_so_far(h);
    let hogs = Hogs::start();
    let out = common::fio::randwrite_verify(mnt, "busy", soak);
    drop(hogs);
    assert_eq!(out.errors, Some(0), "fio on a busy host: {}", out.text);
    let away = away_so_far(h) - before;
    assert_eq!(
        away,
        0,
        "a brick was declared away on a busy host:\n{}",
        std::fs::read_to_string(h.mount_log("pv")).unwrap_or_default()
    );
    println!(
        "busy host for {soak:?} (both CPUs spinning): {} writes, fio's slowest write {:?}, \
         read {:?}; 0 bricks away",
        out.writes, out.max_write, out.max_read
    );
}

/// (leader id, term) as host `i` sees the pool.
fn leadership(h: &Hosts, i: usize) -> (Option<u64>, u64) {
    let p = h.pool(i);
    (p["leader"].as_u64(), p["term"].as_u64().unwrap())
}

/// A follower cut off for 6 s (longer than the lease and its longest wait, so it asks at least
/// once) comes back: the leader and the term never change, seen from the majority meanwhile
/// and after, and the returning member follows the same leader at the same term.
fn a_follower_returns(h: &Hosts, run: usize) {
    let leader = h.settled_leader(30);
    let cut = (leader + 1 + run % 2) % 3;
    let other = 3 - leader - cut;
    let before = leadership(h, leader);
    assert!(before.0.is_some());
    let cut_at = Instant::now();
    h.link(cut, false);
    let watch = |until: Instant, what: &str| {
        while Instant::now() < until {
            for i in [leader, other] {
                let now = leadership(h, i);
                assert_eq!(
                    now, before,
                    "run {run}: host {i} saw the leadership change {what} (leader host \
                     {leader}, cut host {cut})"
                );
            }
            // A look every fifth of a second: the pool's heartbeats go every half.
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    watch(
        cut_at + Duration::from_secs(6),
        "while a follower was cut off",
    );
    h.link(cut, true);
    let back = Instant::now();
    wait_for("the returning member to follow the leader", 10, || {
        leadership(h, cut) == before
    });
    let rejoined = back.elapsed();
    watch(back + Duration::from_secs(3), "after the follower returned");
    println!(
        "run {run}: host {cut} cut off for 6 s and back: leader host {leader} kept term {}; \
         it followed again after {rejoined:?}",
        before.1
    );
}

/// fio through the mount while host `cut` (a follower, or with `cut_leader` the pool's leader)
/// is off the network for `down`: the slowest write, fio's errors, then a heal and the copies.
fn writes_through_an_outage(h: &Hosts, mnt: &Path, down: Duration, cut_leader: bool) {
    let leader = h.settled_leader(30);
    let cut = if cut_leader { leader } else { (leader + 1) % 3 };
    let name = format!("cut-{}-{}", down.as_secs(), cut_leader as u8);
    // Written before the link goes down, and for 10 s after it is back.
    let runtime = down + Duration::from_secs(14);
    let fio = {
        let (mnt, name) = (mnt.to_owned(), name.clone());
        std::thread::spawn(move || common::fio::randwrite_verify(&mnt, &name, runtime))
    };
    // Writes are flowing (to every brick) before the link is taken down.
    let brick_file = h
        .tmp
        .join(format!("brick{cut}"))
        .join(format!("{name}.0.0"));
    wait_for("fio's writes to reach the brick", 30, || {
        std::fs::metadata(&brick_file).is_ok_and(|m| m.len() > 0)
    });
    // Timed by the clock too: an I/O stuck through the outage counts even if fio, which
    // reports what completed, never shows it.
    let probe = common::fio::Probe::start(mnt, &name);
    let said = |what| h.mount_says("pv", what, cut);
    let (away, back) = (said("brick away"), said("reconnected to"));
    let t0 = Instant::now();
    h.link(cut, false);
    if cut_leader {
        // The majority elects another leader meanwhile (the outage is the wait's bound).
        let rest: Vec<usize> = (0..3).filter(|&i| i != cut).collect();
        wait_for("the majority to elect a new leader", down.as_secs(), || {
            rest.iter()
                .all(|&i| h.leader(i).is_some_and(|l| l != cut && rest.contains(&l)))
        });
        println!(
            "the majority named a new leader {:?} after the cut (as `pool list` saw it: each \
             call waits for the cut host's ping to fail)",
            t0.elapsed()
        );
    }
    std::thread::sleep(down.saturating_sub(t0.elapsed()));
    h.link(cut, true);
    let out = fio.join().unwrap();
    let probed = probe.stop();
    // The mount said so, once each: the brick went away, and came back.
    wait_for("the mount to reconnect to the brick", 30, || {
        said("reconnected to") > back
    });
    assert_eq!(
        (said("brick away") - away, said("reconnected to") - back),
        (1, 1),
        "the mount's log of the outage:\n{}",
        std::fs::read_to_string(h.mount_log("pv")).unwrap_or_default()
    );
    let what = if cut_leader {
        "the leader"
    } else {
        "a follower"
    };
    assert!(
        out.errors == Some(0),
        "fio with {what} (host {cut}) cut off for {down:?}: {}",
        out.text
    );
    assert!(
        probed.failure.is_none() && probed.slowest <= MAX_IO,
        "with {what} (host {cut}) cut off for {down:?} the probe saw {probed:?}"
    );
    // Reads too: the verify pass after the link is back must not wait on a connection that
    // TCP is still backing off on.
    assert!(
        out.max_write <= MAX_IO && out.max_read <= MAX_IO,
        "with {what} (host {cut}) cut off for {down:?} the slowest write took {:?}, the \
         slowest read {:?}",
        out.max_write,
        out.max_read
    );
    // The heal copies what host `cut`'s brick missed: then the copies are the same bytes.
    let healer = (cut + 1) % 3;
    let state = h.state(healer);
    let state = state.to_str().unwrap();
    let heal = h.kiln_at(healer, &["volume", "heal", "pv", "--state-dir", state]);
    assert!(
        heal.status.success(),
        "heal: {:?} {}{}",
        heal.status,
        String::from_utf8_lossy(&heal.stdout),
        String::from_utf8_lossy(&heal.stderr)
    );
    let copies: Vec<Vec<u8>> = (0..3)
        .map(|i| {
            std::fs::read(h.tmp.join(format!("brick{i}")).join(format!("{name}.0.0"))).unwrap()
        })
        .collect();
    assert!(!copies[0].is_empty());
    for (i, c) in copies.iter().enumerate() {
        assert!(
            c == &copies[0],
            "after the heal, host {i}'s copy of {name} differs from host 0's"
        );
    }
    let info: Value = h.ok(
        healer,
        &["volume", "heal", "pv", "info", "--state-dir", state],
    );
    println!(
        "{what} (host {cut}) cut off for {down:?}: fio's slowest write {:?}, slowest read {:?}, \
         {} writes, 0 errors; the probe's slowest I/O {:?} in {} rounds; healed and identical \
         after {:?} (heal info {info})",
        out.max_write,
        out.max_read,
        out.writes,
        probed.slowest,
        probed.rounds,
        t0.elapsed()
    );
}
