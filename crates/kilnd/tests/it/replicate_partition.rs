//! A replica cut off from the network costs writes a bounded pause, not the length of the
//! outage: replica 3, two bricks here and one in a network namespace behind a veth pair whose
//! link the test takes down for longer than the ping timeout, while four writers write 4 KiB
//! blocks. No write fails or waits 2 s, the brick is declared away once, the others hold marks
//! for what it missed, and after the link is back heal makes the three copies identical.
//! Needs root and `ip netns`; skips (saying why) without them.

use crate::replica;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use replica::{index_empty, volfile, wait_for, writers, Brick};

const FILE: &str = "disk";
const SIZE: u64 = 16 << 20;
/// How long the link stays down: well past the ping timeout and its stall tier.
const OUTAGE: Duration = Duration::from_secs(8);

#[test]
fn a_replica_cut_off_from_the_network_pauses_writes_under_two_seconds() {
    if !kiln_testkit::is_root() {
        println!("skipping: network namespaces need root");
        return;
    }
    let cut = match kiln_testkit::net::Veth::new("kcut", 81) {
        Ok(c) => c,
        Err(e) => {
            println!("skipping: no network namespace here ({e})");
            return;
        }
    };
    let root = tempfile::tempdir().unwrap();
    let mut bricks = vec![Brick::new(root.path(), 0), Brick::new(root.path(), 1)];
    bricks.push(Brick::in_netns(root.path(), 2, &cut.ns, &cut.far_ip));
    let vol = Arc::new(Volume::from_volfile(&volfile(&bricks)).expect("connect"));
    let (fd, _) = block_on(vol.create(FILE, libc::O_RDWR, 0o644)).expect("create");
    let fd = Arc::new(fd);

    // Four writers, 4 KiB blocks at random, each timing every write.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let writers = writers(&vol, &fd, SIZE, &stop, &done);
    let at_least = |n: u64| {
        let d = done.clone();
        wait_for(&format!("{n} writes"), 60, move || {
            d.load(Ordering::Relaxed) >= n
        });
    };
    at_least(200);
    let away = kiln_client::conn::bricks_away();
    // This client's connections to the brick about to be cut.
    let far = bricks[2].addr.trim_start_matches("tcp:").to_owned();
    let old: Vec<String> = kiln_testkit::net::tcp_sockets(None)
        .expect("socket table")
        .into_iter()
        .filter(|s| s.remote == far && s.state == "ESTABLISHED")
        .map(|s| s.local)
        .collect();
    assert!(!old.is_empty(), "no connection to {far}");

    cut.link(false);
    let cut_at = Instant::now();
    let before = done.load(Ordering::Relaxed);
    // Writes go on while the link is down.
    at_least(before + 200);
    let resumed = cut_at.elapsed();
    // The outage lasts its length; the writers are what is measured meanwhile.
    std::thread::sleep(OUTAGE.saturating_sub(cut_at.elapsed()));
    cut.link(true);

    let rep = heal::replicate_layers(vol.top()).remove(0);
    wait_for("the client to reconnect to the cut brick", 30, || {
        rep.children()[2].up()
    });
    at_least(done.load(Ordering::Relaxed) + 200);
    stop.store(true, Ordering::Relaxed);
    let mut worst = Duration::ZERO;
    for w in writers {
        let (t, errors) = w.join().expect("writer");
        assert!(errors.is_empty(), "writes failed: {errors:?}");
        worst = worst.max(t);
    }
    block_on(vol.fsync(&fd, false)).expect("fsync");
    eprintln!(
        "link down {OUTAGE:?}: writes resumed {resumed:?} after the cut, the slowest took \
         {worst:?}; {} writes",
        done.load(Ordering::Relaxed)
    );
    assert!(
        worst < Duration::from_secs(2),
        "a write waited {worst:?} while one replica of three was cut off"
    );
    assert_eq!(
        kiln_client::conn::bricks_away() - away,
        1,
        "the cut brick is declared away once"
    );

    // The two others hold marks for what it missed; heal makes the copies one.
    assert!(!index_empty(&vol), "nothing marked for the cut brick");
    let _ = block_on(vol.close((*fd).clone()));
    let healer = Volume::from_volfile(&volfile(&bricks)).expect("healer connects");
    for pass in 1.. {
        let report = block_on(heal::run(healer.top(), &|_, _| {}));
        assert!(report.errors.is_empty(), "heal errors {:?}", report.errors);
        if index_empty(&healer) {
            break;
        }
        // A change still finishing when a pass began (its mark made after the pass read the
        // index) is healed by the next; marks that heal cannot clear stay through all three.
        assert!(pass < 3, "marks left after {pass} heals");
    }
    // Nothing the client sent on the connections it gave up may land later: once those are
    // over on both sides (this side sends no more; the brick read what it was sent), the
    // copies must still be one.
    wait_for("the cut connections to be over", 60, || {
        let here = kiln_testkit::net::tcp_sockets(None).expect("socket table");
        let there = kiln_testkit::net::tcp_sockets(Some(&cut.ns)).expect("socket table");
        old.iter().all(|local| {
            let sending = here.iter().any(|s| {
                s.local == *local
                    && s.remote == far
                    && !matches!(s.state, "TIME_WAIT")
                    && (s.tx_queue > 0 || s.state != "FIN_WAIT2")
            });
            let unread = there
                .iter()
                .any(|s| s.remote == *local && (s.rx_queue > 0 || s.state == "CLOSE_WAIT"));
            !sending && !unread
        })
    });
    let copies: Vec<Vec<u8>> = bricks.iter().map(|b| b.file(FILE)).collect();
    assert!(!copies[0].is_empty());
    if copies.iter().any(|c| *c != copies[0]) {
        panic!("the copies differ after heal: {}", differences(&copies));
    }
}

/// What tells the copies apart, for a failure to be read: each copy's size and, for each
/// pair, the 4 KiB blocks that differ (the first few, each with the writer byte each holds).
fn differences(copies: &[Vec<u8>]) -> String {
    let mut out = format!(
        "sizes {:?}",
        copies.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let block = |c: &Vec<u8>, b: usize| c.get(b * 4096..(b + 1) * 4096).map(|s| s.to_vec());
    for i in 0..copies.len() {
        for j in i + 1..copies.len() {
            let n = copies[i].len().max(copies[j].len()).div_ceil(4096);
            let differ: Vec<usize> = (0..n)
                .filter(|b| block(&copies[i], *b) != block(&copies[j], *b))
                .collect();
            let first: Vec<String> = differ
                .iter()
                .take(4)
                .map(|b| {
                    let byte = |c: &Vec<u8>| c.get(b * 4096).copied();
                    format!("#{b} {:?}/{:?}", byte(&copies[i]), byte(&copies[j]))
                })
                .collect();
            out += &format!("; bricks {i},{j}: {} blocks differ {first:?}", differ.len());
        }
    }
    out
}
