//! How the pool reaches other members: an authenticated channel to a management port, given
//! by the daemon (the pool knows nothing of its connections or requests but this).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Opens channels to other members' management ports.
pub trait Link: Send + Sync + 'static {
    /// An authenticated channel to the kilnd at `addr` (both ends proved the management
    /// secret); an error means it could not be reached, and nothing was sent.
    fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Channel>, String>;
}

/// One open channel: requests and their replies, in turn.
pub trait Channel: Send {
    /// Sends one management request (JSON, as `kiln volume` sends them) and returns the reply's
    /// fields. `timeout` bounds the wait for the reply (`None`: the channel's default).
    fn call(
        &mut self,
        req: &serde_json::Value,
        timeout: Option<Duration>,
    ) -> Result<serde_json::Value, CallError>;

    /// This end's address as the other member sees it.
    fn local_ip(&self) -> Result<IpAddr, String>;
}

/// Why a call on a [`Channel`] failed.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The other kilnd answered, and said no: its sentence. Nothing was done.
    Refused(String),
    /// The exchange broke before the answer: the request may or may not have been carried out.
    Broken(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Refused(e) | CallError::Broken(e) => f.write_str(e),
        }
    }
}

impl From<CallError> for String {
    fn from(e: CallError) -> String {
        e.to_string()
    }
}
