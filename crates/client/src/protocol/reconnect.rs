//! The reconnect thread of a protocol-client layer: it tries until the brick takes it again,
//! and says after every attempt how it went (see [`super::Link`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{local, watch, Link};
use crate::shortcut::Shortcut;
use kiln_proto::sync::RwLockExt as _;

/// The reconnect thread's loop: tries until it connects (backing off from 20 ms to 1 s) or the
/// layer is gone, and tells waiters after every attempt.
pub(super) fn reconnect_loop(weak: Weak<Link>, name: String, shortcut: Arc<Shortcut>) {
    let mut wait = Duration::from_millis(20);
    loop {
        let Some(link) = weak.upgrade() else { return };
        let old = link.cur.read_locked().0.clone();
        match old.reconnect() {
            Ok(c) => {
                let c = Arc::new(c);
                let gen = link.cur.read_locked().1 + 1;
                // Pinned handles are pinned again before anyone can use the connection.
                let repinned = local::repin(&link, &name, &c, gen, &shortcut);
                {
                    let mut g = link.cur.write_locked();
                    g.1 = gen;
                    g.0 = c.clone();
                    tracing::info!(layer = name, gen, "reconnected to {}", old.server());
                }
                local::adopt(repinned, &c, gen);
                watch::rewatch(&link, &name, &c);
                link.denied.store(false, Ordering::Release);
                link.reconnecting.store(false, Ordering::Release);
                link.attempts.notify();
                return;
            }
            Err(e) => {
                let denied = e.kind() == std::io::ErrorKind::PermissionDenied;
                if denied && !link.denied.swap(true, Ordering::AcqRel) {
                    tracing::warn!(layer = name, "the brick refuses this client now: {e}");
                }
                tracing::debug!(layer = name, "reconnect failed: {e}");
            }
        }
        link.attempts.notify();
        drop((link, old));
        // Back-off of a background retry loop, not synchronisation.
        std::thread::sleep(wait);
        wait = (wait * 2).min(Duration::from_secs(1));
    }
}
