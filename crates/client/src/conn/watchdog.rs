//! Telling a brick that is away from one that is slow, without waiting for TCP.
//!
//! A brick whose host drops off the network sends nothing: no reply, no FIN, no RST. TCP keeps
//! retransmitting with growing back-off and the connection's requests wait for minutes. One
//! watchdog thread per process looks at every connection that has requests waiting:
//!
//! - **silence** is the time since the connection last received a byte, or since its oldest
//!   wait began, whichever is later. A connection silent for a third of the ping timeout `T`
//!   sends a PING (bricks answer it on the connection's own thread, before any storage call),
//!   so that something is always on its way to the brick.
//! - silent for `T`, it is **away** when its host has not acknowledged a byte for `T` either
//!   (`TCP_INFO`: data unacknowledged, last acknowledgement `T` ago) — the network between is
//!   gone; or, whatever TCP says, when it stays silent for [`STALL_FACTOR`] × `T` — the host
//!   is there but the brick does not answer (stopped, or stuck in a storage call).
//! - it is never away while bytes wait unread in its own socket: then this process is the
//!   slow one (a saturated client host), and the near miss is counted instead.
//!
//! An away connection is shut down; its requests fail as when a brick is killed (`ECONNRESET`,
//! lost in doubt), so a replicated volume goes on with the replicas it has and marks what the
//! away one missed, and the protocol-client layer reconnects in the background. `T` is
//! [`DEFAULT_PING_TIMEOUT`] unless `KILN_PING_TIMEOUT_MS` or [`set_ping_timeout`] says
//! otherwise (0: never).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::*;

/// How long a brick may leave a waiting connection without a byte, its host acknowledging
/// nothing either, before it is away: a write then waits at most about this plus one look
/// ([`tick`]) for a replica that dropped off the network.
pub const DEFAULT_PING_TIMEOUT: Duration = Duration::from_millis(1200);
/// Silent this many ping timeouts while its host still acknowledges, a brick is away anyway
/// (stopped, or stuck in a storage call): long, because a brick busy in one long storage
/// call on a connection answers nothing else on it meanwhile.
pub const STALL_FACTOR: u64 = 8;

/// The ping timeout in milliseconds (0: off); `u64::MAX` until first read.
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(u64::MAX);
/// Connections this process declared away.
pub(super) static AWAY: AtomicU64 = AtomicU64::new(0);
/// Checks that found a connection silent past the timeout but did not declare it away (its
/// replies waited unread here, or its host still acknowledged): the margin against false
/// alarms, for `/metrics`.
pub(super) static NEAR_MISSES: AtomicU64 = AtomicU64::new(0);
/// Pings sent.
pub(super) static PINGS: AtomicU64 = AtomicU64::new(0);

/// The ping timeout of this process's brick connections (`None`: off).
pub fn ping_timeout() -> Option<Duration> {
    let mut ms = TIMEOUT_MS.load(Relaxed);
    if ms == u64::MAX {
        ms = std::env::var("KILN_PING_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(DEFAULT_PING_TIMEOUT.as_millis() as u64);
        TIMEOUT_MS.store(ms, Relaxed);
    }
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// Sets the ping timeout of this process's brick connections (`None`: never away).
pub fn set_ping_timeout(t: Option<Duration>) {
    let ms = t.map_or(0, |t| (t.as_millis() as u64).clamp(1, u64::MAX - 1));
    TIMEOUT_MS.store(ms, Relaxed);
}

/// Brick connections this process found away so far.
pub fn bricks_away() -> u64 {
    AWAY.load(Relaxed)
}

/// Looks so far that found a connection silent past the ping timeout but not away.
pub fn near_misses() -> u64 {
    NEAR_MISSES.load(Relaxed)
}

/// Milliseconds on this process's monotonic clock.
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    // Starts at 1: 0 means "never" in the fields below.
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// What the watchdog knows of one connection.
#[derive(Default)]
pub(super) struct Health {
    /// When a byte last arrived.
    last_rx: AtomicU64,
    /// When the table last went from no request waiting to one.
    waiting_since: AtomicU64,
    /// When the PING in flight left (0: none in flight).
    ping_sent: AtomicU64,
    /// The brick answers PING.
    pings: AtomicBool,
    /// Watched (set once the handshake is done).
    armed: AtomicBool,
    /// Why the watchdog ended the connection.
    away: OnceLock<String>,
}

impl Health {
    /// A byte arrived.
    pub(super) fn heard(&self) {
        self.last_rx.store(now_ms(), Relaxed);
    }

    /// A request began waiting with none waiting before it.
    pub(super) fn waiting(&self) {
        self.waiting_since.store(now_ms(), Relaxed);
    }
}

impl Conn {
    /// Watches the connection from now on (call once its handshake is done); `pings`: the
    /// brick answers PING.
    pub fn arm(&self, pings: bool) {
        self.health.pings.store(pings, Relaxed);
        self.health.heard();
        self.health.armed.store(true, Relaxed);
        start();
    }

    /// True when the brick said it answers PING (and so knows BYE).
    pub fn pings(&self) -> bool {
        self.health.pings.load(Relaxed)
    }

    /// Why the watchdog ended this connection, if it did.
    pub fn away(&self) -> Option<&str> {
        self.health.away.get().map(String::as_str)
    }

    /// One look at the connection, at `now` with timeout `t` (ms).
    fn check(self: &Arc<Self>, now: u64, t: u64) {
        let h = &self.health;
        if !h.armed.load(Relaxed) || self.is_dead() || self.idle() {
            return;
        }
        let since = h.last_rx.load(Relaxed).max(h.waiting_since.load(Relaxed));
        let silence = now.saturating_sub(since);
        if silence >= t / 3 && h.pings.load(Relaxed) && h.ping_sent.load(Relaxed) == 0 {
            self.ping(now);
        }
        if silence < t {
            return;
        }
        if self.unread() > 0 {
            NEAR_MISSES.fetch_add(1, Relaxed);
            return;
        }
        let why = match self.unacknowledged_for() {
            Some(ack) if ack >= t => format!(
                "no answer for {:.1} s, and nothing acknowledged by its host for {:.1} s",
                silence as f64 / 1e3,
                ack as f64 / 1e3
            ),
            // Without pings a brick may be silent only because every request waits (a lock,
            // a lease): nothing tells a stopped brick from that, so only TCP decides.
            _ if h.pings.load(Relaxed) && silence >= STALL_FACTOR * t => format!(
                "its host is there but the brick has not answered for {:.1} s",
                silence as f64 / 1e3
            ),
            _ => {
                NEAR_MISSES.fetch_add(1, Relaxed);
                return;
            }
        };
        if h.away.set(why).is_ok() {
            AWAY.fetch_add(1, Relaxed);
            tracing::warn!(
                brick = %self.peer(),
                "brick away: {}; going on without it",
                self.away().unwrap_or_default()
            );
        }
        self.shutdown();
    }

    /// Sends a PING without ever blocking the watchdog (a full socket keeps it queued).
    fn ping(self: &Arc<Self>, now: u64) {
        self.health.ping_sent.store(now, Relaxed);
        let weak = Arc::downgrade(self);
        let done = Done::Callback(Box::new(move |_| {
            if let Some(c) = weak.upgrade() {
                c.health.ping_sent.store(0, Relaxed);
            }
        }));
        let me = Arc::as_ptr(self) as usize;
        let outer = CORKED.with(|c| c.replace(me));
        // SAFETY: no payload and no sink: nothing the connection could touch after completion.
        let sent = unsafe { self.submit(Op::Ping, 0, &[], &[], Vec::new(), None, done, None) };
        CORKED.with(|c| c.set(outer));
        match sent {
            Ok(_) => {
                PINGS.fetch_add(1, Relaxed);
                let _ = self.flush(false);
            }
            Err(_) => self.health.ping_sent.store(0, Relaxed),
        }
    }

    /// The socket replies come from (over TLS the TCP socket itself: requests go through a
    /// tunnel thread).
    fn rx_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.rx_sock.as_ref().unwrap_or(&self.sock).as_fd()
    }

    /// Bytes received by the kernel and not yet read by the receive thread.
    fn unread(&self) -> usize {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int through a valid pointer.
        let r = unsafe { libc::ioctl(self.rx_fd().as_raw_fd(), libc::FIONREAD, &mut n) };
        if r == 0 {
            n.max(0) as usize
        } else {
            0
        }
    }

    /// For TCP with data unacknowledged and retransmitted (a fresh send awaiting its delayed
    /// ACK is no sign of anything): how long ago the host last acknowledged anything (ms).
    fn unacknowledged_for(&self) -> Option<u64> {
        if self.unix {
            return None;
        }
        // SAFETY: tcp_info is plain data; all zeroes is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `info` and updates `len`.
        let r = unsafe {
            libc::getsockopt(
                self.rx_fd().as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        let resent = info.tcpi_retransmits > 0 || info.tcpi_backoff > 0;
        (r == 0 && info.tcpi_unacked > 0 && resent).then_some(u64::from(info.tcpi_last_ack_recv))
    }

    /// The brick's address, for the log.
    fn peer(&self) -> String {
        match rustix::net::getpeername(self.rx_fd()) {
            Ok(Some(a)) => match std::net::SocketAddr::try_from(a) {
                Ok(sa) => sa.to_string(),
                Err(_) => "a local brick".into(),
            },
            _ => "a brick".into(),
        }
    }
}

/// How often the watchdog looks, for a ping timeout of `t` ms.
fn tick(t: u64) -> Duration {
    Duration::from_millis((t / 10).clamp(50, 250))
}

/// Starts the watchdog thread, once per process.
fn start() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let r = std::thread::Builder::new()
            .name("kiln-watchdog".into())
            .spawn(|| loop {
                let t = ping_timeout().map_or(0, |d| d.as_millis() as u64);
                let tick = tick(t);
                // The watchdog's own period: it looks, it does not wait for anything.
                std::thread::sleep(tick);
                if t == 0 {
                    continue;
                }
                let now = now_ms();
                let conns: Vec<Arc<Conn>> =
                    live().locked().iter().filter_map(|w| w.upgrade()).collect();
                for c in conns {
                    c.check(now, t);
                }
            });
        if let Err(e) = r {
            tracing::warn!("cannot start the connection watchdog: {e}");
        }
    });
}
