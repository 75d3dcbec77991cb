//! Kiln's native client: an asynchronous, vectored, zero-copy API to a volume.
//!
//! [`Volume`] is the API: it runs a volume's client stack (distribute, replicate, io-stats,
//! protocol-client) built from its graph. [`Client`] is one connection to one brick, what a
//! protocol-client layer sends through.
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! use kiln_client::{block_on, Volume};
//! let v = Volume::connect("tcp:127.0.0.1:24100")?;
//! let (fd, _) = block_on(v.create("hello", libc::O_RDWR, 0o644))?;
//! let (n, _) = block_on(v.pwritev(&fd, vec![b"hello".to_vec()], 0));
//! assert_eq!(n?, 5);
//! # Ok(()) }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod client;
pub mod conn;
pub mod graph;
pub mod mgmt;
pub mod pagebuf;
pub mod protocol;
pub mod replay;
pub mod shortcut;
pub mod volume;

pub use client::{errno_error, wire_path, Client, Fh};
pub use conn::{ConnStats, Errno};
pub use kiln_layer::{Fd, Opened, SpliceOut};
pub use kiln_proto::iov::RawIov;
pub use kiln_proto::ops::{Attr, DirEntry, Extent, LeaseState, SetAttrs, StatfsReply, Time};
pub use pagebuf::PageBuf;
pub use volume::Volume;

use std::future::Future;

/// `block_on` runs a future to completion on the calling thread (for tools and tests without a
/// runtime); `spawn` starts one that is polled from then on by whoever wakes it.
pub use kiln_layer::exec::{block_on, block_on_noting, spawn};

/// Runs several futures concurrently on the calling thread and returns their outputs in order:
/// the way to keep many requests in flight without an async runtime.
pub fn join_all<F: Future>(futs: Vec<F>) -> Vec<F::Output> {
    let futs = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    block_on(kiln_layer::exec::join_all(futs))
        .into_iter()
        .map(|o| o.expect("every future completed"))
        .collect()
}

/// Starts this process's `/metrics` endpoint (before connecting, so HELLO announces it).
pub fn start_metrics(addr: &str, process: &str) -> Result<(), kiln_proto::Error> {
    if addr == "off" {
        return Ok(());
    }
    let extra: kiln_metrics::Extra = std::sync::Arc::new(crate::conn::render_metrics);
    let ep = kiln_metrics::serve(addr, process, Some(extra))
        .map_err(|e| kiln_proto::Error::io(format_args!("cannot serve metrics on {addr}"), &e))?;
    tracing::info!("metrics on http://{}/metrics", ep.addr);
    Ok(())
}
