//! What a server and each of its connections may hold.

/// What one connection, and the server as a whole, may hold: a slow or stalled client cannot
/// make the server's memory grow without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Clients (connections that finished the handshake) served at once; one more is closed
    /// when it finishes its handshake, with a log line. See [`crate::door`].
    pub max_connections: usize,
    /// Connections that have not finished the handshake, in all; a new one pushes out the
    /// oldest.
    pub max_strangers: usize,
    /// The same from one address (Unix-socket peers count as one).
    pub max_strangers_per_address: usize,
    /// A connection that has not finished the handshake by then is closed.
    pub handshake_timeout: std::time::Duration,
    /// Requests of one connection received but not yet answered; past it the server stops
    /// reading that connection until replies have gone out.
    pub max_inflight: usize,
    /// A connection with nothing in flight that sends nothing for this long is closed; zero
    /// never closes one. Off by default: clients do not reconnect by themselves yet, so a
    /// mount left alone would break; `max_connections` bounds what idle clients can hold.
    pub idle_timeout: std::time::Duration,
    /// Handles one connection may hold open; one more open fails with `EMFILE` for that
    /// client alone (the brick's own descriptors are shared by every client).
    pub max_handles: usize,
}

/// The largest frame (arguments and payload) a connection may send before it has proved a
/// key: HELLO and AUTH are a few dozen bytes, so a stranger cannot make the server hold more.
pub const MAX_STRANGER_FRAME: usize = 4096;

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 1024,
            max_strangers: 256,
            max_strangers_per_address: 64,
            handshake_timeout: std::time::Duration::from_secs(5),
            max_inflight: 1024,
            idle_timeout: std::time::Duration::ZERO,
            max_handles: 4096,
        }
    }
}
