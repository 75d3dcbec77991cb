//! Counters a brick server keeps: calls per fop, bytes moved, malformed frames.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use kiln_proto::Op;

/// Server-wide counters. Relaxed atomics: each counter is independent and only ever summed for
/// display, so no ordering with other memory is needed.
#[derive(Debug)]
pub struct Stats {
    calls: [AtomicU64; 64],
    /// Payload bytes sent in READ replies.
    pub bytes_read: AtomicU64,
    /// Payload bytes written by WRITE requests.
    pub bytes_written: AtomicU64,
    /// WRITE payload bytes copied in user space: only those that arrive in the stage read
    /// with a frame's header (at most 64 per frame, or 4 KiB for the first WRITE after a run
    /// of small frames); the rest lands in place.
    pub bytes_copied: AtomicU64,
    /// `readv` calls on connection sockets (a burst of small requests takes a few, not one
    /// each).
    pub recv_calls: AtomicU64,
    /// Frames refused as malformed (bad header, bad arguments, unknown opcode).
    pub bad_frames: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections refused (max_connections, allow-list).
    pub refused: AtomicU64,
}

const _: () = assert!(Op::ALL.len() < 64);

impl Default for Stats {
    fn default() -> Stats {
        Stats {
            calls: [const { AtomicU64::new(0) }; 64],
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            bytes_copied: AtomicU64::new(0),
            recv_calls: AtomicU64::new(0),
            bad_frames: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }
}

impl Stats {
    /// Counts one call of `op`.
    pub fn count(&self, op: Op) {
        self.calls[op as usize].fetch_add(1, Relaxed);
    }

    /// Calls of `op` so far.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op as usize].load(Relaxed)
    }

    pub(crate) fn add_read(&self, n: usize) {
        self.bytes_read.fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn add_copied(&self, n: usize) {
        if n > 0 {
            self.bytes_copied.fetch_add(n as u64, Relaxed);
        }
    }

    pub(crate) fn add_written(&self, n: usize) {
        self.bytes_written.fetch_add(n as u64, Relaxed);
    }
}

impl Stats {
    /// Adds the server-wide counters to a `/metrics` scrape.
    pub fn render(&self, out: &mut kiln_layer::metrics::Scrape) {
        let rows: [(&str, &str, &AtomicU64); 6] = [
            (
                "kiln_brick_read_bytes",
                "Payload bytes sent in READ replies.",
                &self.bytes_read,
            ),
            (
                "kiln_brick_written_bytes",
                "Payload bytes written by WRITE requests.",
                &self.bytes_written,
            ),
            (
                "kiln_brick_copied_bytes",
                "WRITE payload bytes copied in user space.",
                &self.bytes_copied,
            ),
            (
                "kiln_brick_bad_frames",
                "Frames refused as malformed.",
                &self.bad_frames,
            ),
            (
                "kiln_brick_connections",
                "Connections accepted.",
                &self.connections,
            ),
            (
                "kiln_brick_refused",
                "Connections or clients refused.",
                &self.refused,
            ),
        ];
        for (name, help, v) in rows {
            out.counter(name, help).count(&[], v.load(Relaxed));
        }
    }
}
