//! Who may hold a connection. A connection is a *stranger* until it finishes the handshake
//! (AUTH with the secret, or HELLO on a brick without one), then a *client*. The two are
//! counted apart, so strangers can never take the places of clients that hold the secret:
//!
//! - clients: at most `max_connections`; one more is refused when it finishes its handshake;
//! - strangers: at most `max_strangers` in all and `max_strangers_per_address` from one
//!   address (Unix-socket peers count as one address). A new stranger over either cap evicts
//!   the oldest stranger of its address (or the oldest of all): a real client finishes its
//!   handshake in a few round trips, so only connections that dawdle are pushed out, and a
//!   flood of idle connections cannot keep a client from connecting;
//! - every stranger has `handshake_timeout` to finish the handshake, then it is closed.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_proto::sync::MutexExt as _;
use tokio::sync::Notify;

use crate::limits::Limits;
use crate::stats::Stats;

/// Where a connection comes from: an IP address, or None for a Unix-socket peer.
pub type Address = Option<IpAddr>;

/// The door of one server.
pub struct Door {
    limits: Limits,
    stats: Arc<Stats>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Strangers by arrival (the first is the oldest).
    strangers: BTreeMap<u64, Stranger>,
    per_address: HashMap<Address, usize>,
    clients: usize,
}

struct Stranger {
    from: Address,
    evict: Arc<Notify>,
}

/// One connection's place: a stranger's until [`Ticket::promote`], then a client's. Dropping
/// it gives the place back.
pub struct Ticket {
    door: Arc<Door>,
    /// When a stranger's handshake time is up.
    deadline: tokio::time::Instant,
    /// The stranger's number; 0 once it is no stranger (a client, or refused).
    id: u64,
    evict: Arc<Notify>,
    client: bool,
}

impl Door {
    /// A door that keeps `limits` and counts refusals in `stats`.
    pub fn new(limits: Limits, stats: Arc<Stats>) -> Arc<Door> {
        Arc::new(Door {
            limits,
            stats,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    /// Lets a new connection from `from` in as a stranger, evicting the oldest stranger of
    /// the same address, or of all, when a cap is reached.
    pub fn knock(self: &Arc<Self>, from: Address, peer: &str) -> Ticket {
        let mut st = self.state();
        let here = st.per_address.get(&from).copied().unwrap_or(0);
        let victim = if here >= self.limits.max_strangers_per_address.max(1) {
            st.strangers
                .iter()
                .find(|(_, s)| s.from == from)
                .map(|(id, _)| *id)
        } else if st.strangers.len() >= self.limits.max_strangers.max(1) {
            st.strangers.keys().next().copied()
        } else {
            None
        };
        if let Some(v) = victim {
            if let Some(s) = st.remove_stranger(v) {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    %peer,
                    "a new connection pushes out the oldest one that has not finished its \
                     handshake (too many strangers)"
                );
                s.evict.notify_one();
            }
        }
        st.next += 1;
        let id = st.next;
        let evict = Arc::new(Notify::new());
        st.strangers.insert(
            id,
            Stranger {
                from,
                evict: evict.clone(),
            },
        );
        *st.per_address.entry(from).or_default() += 1;
        Ticket {
            door: self.clone(),
            deadline: tokio::time::Instant::now() + self.limits.handshake_timeout,
            id,
            evict,
            client: false,
        }
    }

    /// Strangers and clients now (for tests and status).
    pub fn counts(&self) -> (usize, usize) {
        let st = self.state();
        (st.strangers.len(), st.clients)
    }
}

impl State {
    fn remove_stranger(&mut self, id: u64) -> Option<Stranger> {
        let s = self.strangers.remove(&id)?;
        if let Some(n) = self.per_address.get_mut(&s.from) {
            *n -= 1;
            if *n == 0 {
                self.per_address.remove(&s.from);
            }
        }
        Some(s)
    }
}

impl Ticket {
    /// True once the connection finished its handshake.
    pub fn is_client(&self) -> bool {
        self.client
    }

    /// Resolves when the door pushed this stranger out to make room.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }

    /// Resolves, saying why, when a stranger is to be closed: pushed out, or out of time.
    pub async fn closing(&self) -> &'static str {
        tokio::select! {
            () = self.evicted() => {
                "closing a connection pushed out by newer ones that have not finished their \
                 handshake either"
            }
            () = tokio::time::sleep_until(self.deadline) => {
                "closing a connection that did not finish its handshake in time"
            }
        }
    }

    /// The connection finished its handshake: it takes a client's place, or gets false when
    /// `max_connections` clients are in (then it is to be closed).
    pub fn promote(&mut self, peer: &str) -> bool {
        if self.client {
            return true;
        }
        let mut st = self.door.state();
        if st.remove_stranger(self.id).is_none() {
            return false; // pushed out meanwhile
        }
        if st.clients >= self.door.limits.max_connections {
            drop(st);
            self.door.stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, "refusing a client: max_connections reached");
            self.id = 0;
            return false;
        }
        st.clients += 1;
        self.client = true;
        self.id = 0;
        self.door.stats.connections.fetch_add(1, Ordering::Relaxed);
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut st = self.door.state();
        if self.client {
            st.clients -= 1;
        } else if self.id != 0 {
            st.remove_stranger(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn door(max_connections: usize, max_strangers: usize, per_address: usize) -> Arc<Door> {
        let limits = Limits {
            max_connections,
            max_strangers,
            max_strangers_per_address: per_address,
            ..Limits::default()
        };
        Door::new(limits, Arc::new(Stats::default()))
    }

    fn ip(last: u8) -> Address {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    #[tokio::test]
    async fn strangers_cannot_take_clients_places() {
        let d = door(2, 4, 3);
        // Three idle strangers from one address fill its share; a fourth pushes out the
        // oldest, which is told so.
        let idle: Vec<Ticket> = (0..3).map(|_| d.knock(ip(1), "x")).collect();
        let mut client = d.knock(ip(1), "client");
        tokio::time::timeout(std::time::Duration::from_secs(1), idle[0].evicted())
            .await
            .expect("the oldest stranger is pushed out");
        assert_eq!(d.counts(), (3, 0));
        assert!(
            client.promote("client"),
            "the newcomer finishes its handshake"
        );
        assert_eq!(d.counts(), (2, 1));
        // Another address: the global cap of 4 strangers pushes out the oldest of all.
        let others: Vec<Ticket> = (0..3).map(|_| d.knock(ip(2), "y")).collect();
        assert_eq!(d.counts(), (4, 1));
        let mut second = d.knock(ip(3), "client 2");
        assert!(second.promote("client 2"));
        // max_connections = 2 clients: a third is refused at its handshake.
        let mut third = d.knock(ip(4), "client 3");
        assert!(!third.promote("client 3"));
        drop(third);
        drop(client);
        let mut fourth = d.knock(ip(5), "client 4");
        assert!(
            fourth.promote("client 4"),
            "a place freed by a client that left"
        );
        drop((idle, others, second, fourth));
        assert_eq!(d.counts(), (0, 0), "every place given back");
    }

    #[tokio::test]
    async fn a_stranger_pushed_out_cannot_become_a_client() {
        let d = door(8, 1, 8);
        let mut old = d.knock(None, "unix");
        let _new = d.knock(None, "unix");
        assert!(!old.promote("unix"));
        drop(old);
        assert_eq!(d.counts(), (1, 0));
    }
}
