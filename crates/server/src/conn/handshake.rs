//! The connection's handshake: HELLO, then AUTH proving the key of the compatibility identity
//! (the server's shared secret) or of a named identity (see [`crate::identity`]); the
//! capabilities that the connection then works with; and closing it when its identity is
//! removed or its key rotated.

use kiln_proto::ops::{AuthReply, AuthReq, HelloReply, HelloReq};
use kiln_proto::sync::MutexExt as _;

use crate::identity::{Caps, Identities, Identity};

use super::*;

/// Who a connection speaks for: what it must prove, and what it proved.
pub(super) struct Who {
    /// The compatibility identity's key (the server's shared secret), if it has one.
    pub(super) secret: Option<Arc<[u8]>>,
    /// Named identities, on a server that admits them.
    pub(super) identities: Option<Arc<Identities>>,
    /// The compatibility identity's capabilities (also a server's without any key).
    pub(super) compat: Arc<Caps>,
    /// The nonce sent in HELLO (all zero before HELLO).
    pub(super) nonce: [u8; kiln_proto::auth::NONCE_LEN],
    pub(super) hello_done: bool,
    /// The handshake is done (AUTH proved a key, or none was asked for).
    pub(super) authed: bool,
    /// The metrics endpoint HELLO announced, registered once the handshake is done.
    pub(super) metrics: String,
    /// The named identity AUTH proved, and the reloads of the table it came from.
    pub(super) identity: Option<Arc<Identity>>,
    pub(super) reloads: Option<tokio::sync::watch::Receiver<u64>>,
    /// Over TLS: the common name of the client's certificate, which the CA vouched for; an
    /// identity of that name is the connection's without a key.
    pub(super) certificate: Option<String>,
    /// The client's address (None: a Unix socket, on this host).
    pub(super) from: Option<std::net::IpAddr>,
}

impl Who {
    pub(super) fn new(served: &Served, from: Option<std::net::IpAddr>) -> Who {
        Who {
            from,
            secret: served.secret.clone(),
            identities: served.identities.clone(),
            compat: served.compat.clone(),
            nonce: [0; kiln_proto::auth::NONCE_LEN],
            hello_done: false,
            authed: false,
            metrics: String::new(),
            identity: None,
            reloads: None,
            certificate: None,
        }
    }

    /// True when a client must prove a key before anything but HELLO and AUTH.
    pub(super) fn required(&self) -> bool {
        self.secret.is_some() || self.identities.is_some()
    }
}

impl Conn {
    /// The name of the identity this connection proved (empty: the compatibility identity).
    pub(super) fn identity_name(&self) -> &str {
        self.who.identity.as_deref().map_or("", |i| i.name.as_str())
    }

    /// HELLO: the client's name and metrics endpoint; the server's limits and, when a key is
    /// required, the nonce AUTH must prove it over.
    pub(super) fn hello(&mut self, args: &[u8]) -> Result<Step, Fail> {
        let req = HelloReq::from_wire(args)?;
        tracing::debug!(client = %req.client, version = req.version, "hello");
        // Kept until the handshake is done: a stranger registers nothing.
        self.who.metrics = req.metrics;
        let by_certificate = self.certified();
        let required = self.who.required() && by_certificate.is_none();
        if required {
            fill_random(&mut self.who.nonce)?;
        }
        self.who.hello_done = true;
        if let Some(i) = by_certificate {
            tracing::info!(peer = %self.peer, identity = i.name, "authenticated by its certificate");
            self.who.reloads = self.who.identities.as_ref().map(|t| t.watch());
            self.who.identity = Some(i);
        }
        if !required {
            // Without a key (or with a certificate that names an identity), HELLO is the
            // whole handshake.
            self.who.authed = true;
            self.admit()?;
        }
        let r = HelloReply {
            version: kiln_proto::frame::VERSION as u32,
            server: format!("kilnd {}", env!("CARGO_PKG_VERSION")),
            max_payload: kiln_proto::MAX_PAYLOAD_LEN,
            auth_required: required,
            nonce: if required {
                self.who.nonce.to_vec()
            } else {
                Vec::new()
            },
            flags: kiln_proto::ops::HELLO_PING
                | kiln_proto::ops::HELLO_SUMS
                | if self.stack.joining() {
                    kiln_proto::ops::HELLO_NEW_BRICK
                } else {
                    0
                },
        };
        Ok(Step::Now(r.to_wire(), Body::None))
    }

    /// The identity the client's TLS certificate names, if the server admits one of that name.
    fn certified(&self) -> Option<Arc<Identity>> {
        let name = self.who.certificate.as_deref()?;
        let i = self.who.identities.as_ref()?.get(name)?;
        if !i.caps.admits_from(self.who.from) {
            tracing::warn!(peer = %self.peer, identity = i.name, "a certificate's identity may not connect from this address");
            return None;
        }
        Some(i)
    }

    /// The handshake is done: the connection takes a client's place (or is refused, EBUSY,
    /// then closed, when the server serves `max_connections` clients) with its capabilities.
    fn admit(&mut self) -> Result<(), Fail> {
        if !self.ticket.promote(&self.peer) {
            self.closing = true;
            return Err(Fail::Errno(errno::EBUSY));
        }
        let caps = match &self.who.identity {
            Some(i) => Arc::new(i.caps.clone()),
            None => self.who.compat.clone(),
        };
        self.set_caps(caps);
        if !self.who.metrics.is_empty() {
            let m = std::mem::take(&mut self.who.metrics);
            self.clients.locked().insert(self.conn_id, m);
        }
        Ok(())
    }

    pub(super) fn set_caps(&mut self, caps: Arc<Caps>) {
        self.unrestricted = caps::unrestricted(&caps);
        self.subtree = (!caps.subtree.is_empty()).then(|| Arc::from(caps.subtree.as_str()));
        self.caps = caps;
    }

    /// AUTH: checks the client's proof of its identity's key and proves it back.
    pub(super) fn auth(&mut self, args: &[u8]) -> Result<Step, Fail> {
        let req = AuthReq::from_wire(args)?;
        if !self.who.required() {
            // Nothing to prove to a server without keys.
            return Ok(Step::Now(
                AuthReply { proof: Vec::new() }.to_wire(),
                Body::None,
            ));
        }
        let (key, identity): (Option<Vec<u8>>, _) = if req.identity.is_empty() {
            (self.who.secret.as_deref().map(<[u8]>::to_vec), None)
        } else {
            match self
                .who
                .identities
                .as_ref()
                .and_then(|t| t.get(&req.identity))
            {
                Some(i) => (Some(i.key.trim().as_bytes().to_vec()), Some(i)),
                None => (None, None),
            }
        };
        let placed = identity
            .as_ref()
            .is_none_or(|i| i.caps.admits_from(self.who.from));
        let ok = self.who.hello_done
            && !self.who.authed
            && placed
            && key
                .as_deref()
                .is_some_and(|k| kiln_proto::auth::client_proved(k, &self.who.nonce, &req));
        if !ok {
            let why = match (&key, req.identity.as_str()) {
                (None, "") => "no shared secret here",
                (None, _) => "no such identity here",
                _ if !placed => "not an address it may connect from",
                _ => "wrong key",
            };
            tracing::warn!(peer = %self.peer, identity = req.identity, "a client failed authentication ({why}); closing");
            self.stats
                .refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.closing = true;
            return Err(Fail::Errno(errno::EACCES));
        }
        let key = key.expect("checked above");
        self.who.authed = true;
        if let Some(i) = identity {
            tracing::info!(peer = %self.peer, identity = i.name, "authenticated");
            self.who.reloads = self.who.identities.as_ref().map(|t| t.watch());
            self.who.identity = Some(i);
        }
        self.admit()?;
        let proof = kiln_proto::auth::server_proof(&key, &self.who.nonce, &req);
        Ok(Step::Now(AuthReply { proof }.to_wire(), Body::None))
    }

    /// The identity table was read again: false when this connection's identity is gone, its
    /// key changed or its address is no longer admitted (the connection closes); new
    /// capabilities apply from the next request.
    pub(super) fn identity_still_good(&mut self) -> bool {
        let (Some(mine), Some(table)) = (&self.who.identity, &self.who.identities) else {
            return true;
        };
        match table.get(&mine.name) {
            Some(now) if now.key == mine.key && !now.caps.admits_from(self.who.from) => {
                tracing::info!(peer = %self.peer, identity = now.name, "closing: the identity may no longer connect from this address");
                false
            }
            Some(now) if now.key == mine.key => {
                if now.caps != mine.caps {
                    tracing::info!(peer = %self.peer, identity = now.name, "capabilities changed");
                    self.set_caps(Arc::new(now.caps.clone()));
                    self.who.identity = Some(now);
                }
                true
            }
            Some(_) => {
                tracing::info!(peer = %self.peer, identity = mine.name, "closing: the identity's key was rotated");
                false
            }
            None => {
                tracing::info!(peer = %self.peer, identity = mine.name, "closing: the identity was removed");
                false
            }
        }
    }
}

/// Waits for the next reload of the identity table (forever without one).
pub(super) async fn reloaded(r: Option<&mut tokio::sync::watch::Receiver<u64>>) {
    match r {
        Some(r) => {
            if r.changed().await.is_err() {
                std::future::pending::<()>().await
            }
        }
        None => std::future::pending().await,
    }
}
