//! What Kiln's integration tests share across crates, so that no crate keeps its own copy:
//! network namespaces joined by veth pairs ([`net`]), seeded randomness that a failure can
//! be replayed from ([`rng`]), where a started kilnd listens ([`daemon`]), and waiting for a
//! condition with a deadline ([`wait_for`]), an XFS with reflink on a loop device ([`xfs`]), volfile text ([`volfile`]).
//! Each crate's `tests/it/common` keeps only what is its own (its daemons, mounts, exports).

pub mod daemon;
pub mod net;
pub mod rng;
pub mod volfile;
pub mod xfs;

use std::time::{Duration, Instant};

/// Polls `cond` every 20 ms until it holds; panics naming `what` after `secs` seconds.
/// (Many conditions start a `kiln` process: polling faster would load the CPUs the test
/// measures.)
pub fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// True when this process runs as root (namespaces, mounts and loop devices need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
