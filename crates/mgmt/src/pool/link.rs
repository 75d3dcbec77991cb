//! How the pool reaches other members: an authenticated channel to a management port, given
//! by the daemon (the pool knows nothing of its connections or requests but this).

use kiln_proto::Error;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Opens channels to other members' management ports.
pub trait Link: Send + Sync + 'static {
    /// An authenticated channel to the kilnd at `addr` (both ends proved the management
    /// secret); an error means it could not be reached, and nothing was sent.
    fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Channel>, Error>;
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
    fn local_ip(&self) -> Result<IpAddr, Error>;
}

/// Why a call on a [`Channel`] failed.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The other kilnd answered, and said no: its error. Nothing was done.
    Refused(Error),
    /// The exchange broke before the answer: the request may or may not have been carried out.
    Broken(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Refused(e) => write!(f, "{e}"),
            CallError::Broken(e) => f.write_str(e),
        }
    }
}

impl From<CallError> for Error {
    /// A refusal keeps the other kilnd's kind; a broken exchange may work when tried again.
    fn from(e: CallError) -> Error {
        match e {
            CallError::Refused(e) => e,
            CallError::Broken(e) => Error::unavailable(e),
        }
    }
}
