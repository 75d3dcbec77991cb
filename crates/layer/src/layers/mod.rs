//! Every layer of a volume graph but the two ends of the wire, in one tree that reads as the
//! graph does, top to bottom:
//!
//! ```text
//! client:  iostats → shard (big files in pieces) → distribute → replicate (heal, marks: what replicas missed) → [protocol-client]
//! brick:   [protocol-server] → iostats → marks (heal's records, locks, sessions) → posix
//! anywhere: faults (error-gen, delay-gen)
//! ```
//!
//! The protocol client is `kiln_client::protocol` (it needs the connection) and the protocol
//! server is `kiln_server::conn`: they are where the wire is, not layers of this tree.

pub mod distribute;
pub mod faults;
pub mod iostats;
pub mod marks;
pub mod posix;
pub mod replicate;
pub mod shard;
