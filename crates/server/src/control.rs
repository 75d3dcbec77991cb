//! The seam between the brick server and a management daemon.
//!
//! The server knows nothing of volumes, peers or brick processes. A server started with
//! [`crate::Server::with_mgmt`] hands every MGMT request's JSON to a [`MgmtHandler`] and sends
//! back what it returns; `kiln-mgmt` provides the handler kilnd uses.

use std::sync::Arc;

/// Who sent a MGMT request, as the connection that carried it knows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The peer's address (`IP:PORT`, or `unix`), for logs.
    pub peer: String,
    /// True when the connection proved the management secret or the key of an identity that
    /// holds the admin capability, or the server has no keys.
    pub authenticated: bool,
    /// The identity it proved (empty: the management secret, or none).
    pub identity: String,
}

/// What the connection code calls with a MGMT request's JSON; returns the reply's JSON.
///
/// On a server with a secret, MGMT is the one fop besides HELLO and AUTH that the connection
/// code lets through before authentication: the handler decides per command, knowing the
/// [`Caller`]. A plain closure `Fn(&[u8]) -> Vec<u8>` is a handler that does not look at the
/// caller: it runs only for authenticated callers, and the others get [`refusal`].
pub trait MgmtHandler: Send + Sync {
    /// Answers one request (JSON) from `caller` with the reply's JSON.
    fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8>;
}

impl<F: Fn(&[u8]) -> Vec<u8> + Send + Sync> MgmtHandler for F {
    fn handle(&self, req: &[u8], caller: &Caller) -> Vec<u8> {
        if caller.authenticated {
            self(req)
        } else {
            tracing::warn!(peer = %caller.peer, "mgmt: refused a request before authentication");
            refusal("this request").into_bytes()
        }
    }
}

/// A MGMT handler as the server holds it.
pub type Handler = Arc<dyn MgmtHandler>;

/// The reply (JSON) to an unauthenticated request for `what`: `"auth_required": true` tells
/// clients to say how to give the secret.
pub fn refusal(what: &str) -> String {
    serde_json::json!({
        "ok": false,
        "auth_required": true,
        "error": format!(
            "{what} needs the management secret, and this connection did not prove it"
        ),
    })
    .to_string()
}
