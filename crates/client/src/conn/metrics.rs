//! Every live connection's counters, rendered for `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::*;

/// Adds the counters of every live connection of this process, summed, to a `/metrics`
/// scrape (what a mount or an NBD export adds).
pub fn render_metrics(out: &mut kiln_layer::metrics::Scrape) {
    let conns: Vec<Arc<Conn>> = live().locked().iter().filter_map(|w| w.upgrade()).collect();
    let sum = |f: fn(&ConnStats) -> &AtomicU64| -> u64 {
        conns.iter().map(|c| f(&c.stats).load(Relaxed)).sum()
    };
    let rows: [(&str, &str, u64); 8] = [
        (
            "kiln_client_requests",
            "Requests submitted to bricks.",
            sum(|s| &s.requests),
        ),
        (
            "kiln_client_replies",
            "Replies received.",
            sum(|s| &s.replies),
        ),
        (
            "kiln_client_send_calls",
            "sendmsg calls that carried frames.",
            sum(|s| &s.send_calls),
        ),
        (
            "kiln_client_recv_calls",
            "Receive calls on brick sockets.",
            sum(|s| &s.recv_calls),
        ),
        (
            "kiln_client_payload_bytes_in",
            "Payload bytes received into callers' buffers.",
            sum(|s| &s.payload_bytes_in),
        ),
        (
            "kiln_client_copied_bytes",
            "Payload bytes copied in user space (0 on the read path).",
            sum(|s| &s.bytes_copied),
        ),
        (
            "kiln_client_spliced_bytes",
            "Payload bytes moved from brick sockets on to a FUSE device by splice.",
            sum(|s| &s.bytes_spliced),
        ),
        (
            "kiln_client_splice_fallbacks",
            "Replies whose splice was tried and that were received the ordinary way, or failed.",
            sum(|s| &s.splice_fallbacks),
        ),
    ];
    out.gauge("kiln_client_connections", "Brick connections open.")
        .set(&[], conns.len() as f64);
    for (name, help, v) in [
        (
            "kiln_client_bricks_away",
            "Brick connections the watchdog found away (no answer within the ping timeout).",
            &watchdog::AWAY,
        ),
        (
            "kiln_client_away_near_misses",
            "Looks at a connection silent past the ping timeout that did not find it away (its \
             replies waited unread here, or its host still acknowledged).",
            &watchdog::NEAR_MISSES,
        ),
        (
            "kiln_client_pings",
            "Pings sent to bricks that had been silent with requests waiting.",
            &watchdog::PINGS,
        ),
    ] {
        out.counter(name, help).count(&[], v.load(Relaxed));
    }
    for (name, help, v) in rows {
        out.counter(name, help).count(&[], v);
    }
}
