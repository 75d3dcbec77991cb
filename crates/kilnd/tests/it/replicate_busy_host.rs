//! A busy host loses no brick: replica 3 with four writers while two processes keep both CPUs
//! saturated, and no fault at all. The connection watchdog must declare nothing away: a brick
//! that is slow because its host is busy still has its host acknowledge, and replies that wait
//! unread in the client's own socket are the client's slowness, not the brick's. Runs
//! `KILN_SOAK_SECS` seconds (default 60; the acceptance run is 300) and prints the near
//! misses (looks that found a connection silent past the timeout but not away).

use crate::replica;

use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use replica::{volfile, wait_for, writers, Brick};

/// A process spinning on a CPU until dropped.
struct Hog(Child);

impl Hog {
    fn start() -> Hog {
        Hog(Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh"))
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn saturated_cpus_declare_no_brick_away() {
    let secs: u64 = std::env::var("KILN_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let root = tempfile::tempdir().unwrap();
    let bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let vol = Arc::new(Volume::from_volfile(&volfile(&bricks)).expect("connect"));
    let (fd, _) = block_on(vol.create("disk", libc::O_RDWR, 0o644)).expect("create");
    let fd = Arc::new(fd);
    let away = kiln_client::conn::bricks_away();
    let _hogs = [Hog::start(), Hog::start()];

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let writers = writers(&vol, &fd, 16 << 20, &stop, &done);
    let d = done.clone();
    wait_for("writes under load", 60, move || {
        d.load(Ordering::Relaxed) > 100
    });
    // The soak's length is what is tested: no fault comes, whatever the load does.
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    let mut worst = Duration::ZERO;
    for w in writers {
        let (t, errors) = w.join().expect("writer");
        assert!(errors.is_empty(), "writes failed under load: {errors:?}");
        worst = worst.max(t);
    }
    eprintln!(
        "{secs} s on saturated CPUs: {} writes, the slowest {worst:?}; {} away, {} near \
         misses",
        done.load(Ordering::Relaxed),
        kiln_client::conn::bricks_away() - away,
        kiln_client::conn::near_misses()
    );
    assert_eq!(
        kiln_client::conn::bricks_away() - away,
        0,
        "a brick was declared away on a busy host"
    );
}
