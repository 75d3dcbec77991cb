//! The server crate's integration tests, one program (one link, not one per file).

mod request_bursts;
mod socket_owner;
mod volume_distribute;
