//! Every live connection's counters, rendered for `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::*;

/// Appends the counters of every live connection of this process, summed, in Prometheus text
/// format (what a mount or an NBD export adds to its `/metrics`).
pub fn render_metrics(out: &mut String) {
    use std::fmt::Write;
    let conns: Vec<Arc<Conn>> = lock(live()).iter().filter_map(|w| w.upgrade()).collect();
    let sum = |f: fn(&ConnStats) -> &AtomicU64| -> u64 {
        conns.iter().map(|c| f(&c.stats).load(Relaxed)).sum()
    };
    let rows: [(&str, &str, u64); 6] = [
        (
            "kiln_client_requests_total",
            "Requests submitted to bricks.",
            sum(|s| &s.requests),
        ),
        (
            "kiln_client_replies_total",
            "Replies received.",
            sum(|s| &s.replies),
        ),
        (
            "kiln_client_send_calls_total",
            "sendmsg calls that carried frames.",
            sum(|s| &s.send_calls),
        ),
        (
            "kiln_client_recv_calls_total",
            "Receive calls on brick sockets.",
            sum(|s| &s.recv_calls),
        ),
        (
            "kiln_client_payload_bytes_in_total",
            "Payload bytes received into callers' buffers.",
            sum(|s| &s.payload_bytes_in),
        ),
        (
            "kiln_client_copied_bytes_total",
            "Payload bytes copied in user space (0 on the read path).",
            sum(|s| &s.bytes_copied),
        ),
    ];
    let _ = writeln!(out, "# HELP kiln_client_connections Brick connections open.\n# TYPE kiln_client_connections gauge\nkiln_client_connections {}", conns.len());
    for (name, help, v) in rows {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
    }
}
