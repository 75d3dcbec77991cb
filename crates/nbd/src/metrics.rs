//! Per-connection counters: requests, bytes and errors per command, how replies were batched,
//! and payload bytes copied in user space. Logged as one summary line when a client leaves.
//!
//! Relaxed atomics: every counter is an independent event count, written from the reader task,
//! the brick connection's receive thread and the reply writer, and read only for display.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use crate::proto::cmd;

/// Commands counted separately; everything else lands in "other".
const NAMES: [&str; 7] = [
    "read",
    "write",
    "flush",
    "trim",
    "write_zeroes",
    "block_status",
    "other",
];

fn slot(c: u16) -> usize {
    match c {
        cmd::READ => 0,
        cmd::WRITE => 1,
        cmd::FLUSH => 2,
        cmd::TRIM => 3,
        cmd::WRITE_ZEROES => 4,
        cmd::BLOCK_STATUS => 5,
        _ => 6,
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
}

/// Counters of one NBD client connection.
pub struct Metrics {
    started: Instant,
    per_cmd: [Counters; NAMES.len()],
    /// Replies sent.
    pub replies: AtomicU64,
    /// Vectored writes that carried them (replies / this = replies per system call).
    pub write_calls: AtomicU64,
    /// Requests in flight now, and the most seen at once.
    pub in_flight: AtomicU64,
    /// The most requests in flight at once.
    pub max_in_flight: AtomicU64,
    /// Requests refused as malformed (bad range, size, flags or command).
    pub bad_requests: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            started: Instant::now(),
            per_cmd: Default::default(),
            replies: AtomicU64::new(0),
            write_calls: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// Counts a request of command `c` for `bytes` bytes, now in flight.
    pub fn start(&self, c: u16, bytes: u64) {
        let s = &self.per_cmd[slot(c)];
        s.requests.fetch_add(1, Relaxed);
        s.bytes.fetch_add(bytes, Relaxed);
        let now = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.max_in_flight.fetch_max(now, Relaxed);
    }

    /// Counts the end of a request of command `c`, failed or not.
    pub fn finish(&self, c: u16, ok: bool) {
        self.in_flight.fetch_sub(1, Relaxed);
        if !ok {
            self.per_cmd[slot(c)].errors.fetch_add(1, Relaxed);
        }
    }

    /// Requests of command `c` so far.
    pub fn requests(&self, c: u16) -> u64 {
        self.per_cmd[slot(c)].requests.load(Relaxed)
    }

    /// Bytes requested by command `c` so far.
    pub fn bytes(&self, c: u16) -> u64 {
        self.per_cmd[slot(c)].bytes.load(Relaxed)
    }

    /// One line: what this connection did.
    pub fn summary(&self, copied: u64) -> String {
        let secs = self.started.elapsed().as_secs_f64();
        let mut s = format!("{secs:.1}s;");
        for (i, name) in NAMES.iter().enumerate() {
            let c = &self.per_cmd[i];
            let n = c.requests.load(Relaxed);
            if n == 0 {
                continue;
            }
            let b = c.bytes.load(Relaxed);
            let e = c.errors.load(Relaxed);
            let _ = write!(s, " {name} {n} req {:.1} MiB", b as f64 / 1048576.0);
            if e > 0 {
                let _ = write!(s, " ({e} failed)");
            }
            s.push(';');
        }
        let replies = self.replies.load(Relaxed);
        let calls = self.write_calls.load(Relaxed).max(1);
        let _ = write!(
            s,
            " {replies} replies in {calls} writes ({:.1}/write); max {} in flight; {} refused; {copied} payload bytes copied",
            replies as f64 / calls as f64,
            self.max_in_flight.load(Relaxed),
            self.bad_requests.load(Relaxed),
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_summarises() {
        let m = Metrics::default();
        m.start(cmd::READ, 4096);
        m.start(cmd::READ, 4096);
        m.finish(cmd::READ, true);
        m.finish(cmd::READ, false);
        m.start(77, 0);
        m.finish(77, false);
        assert_eq!(m.requests(cmd::READ), 2);
        assert_eq!(m.bytes(cmd::READ), 8192);
        assert_eq!(m.max_in_flight.load(Relaxed), 2);
        assert_eq!(m.in_flight.load(Relaxed), 0);
        let s = m.summary(0);
        assert!(
            s.contains("read 2 req") && s.contains("(1 failed)") && s.contains("other 1 req"),
            "{s}"
        );
        assert!(!s.contains("write 0"), "{s}");
    }
}
