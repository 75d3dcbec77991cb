//! One multiplexed connection to a brick: many requests in flight, replies matched by id, and
//! READ payload received from the socket straight into the caller's buffers.
//!
//! # Threads
//! A dedicated receive thread per connection blocks in `readv` on the socket. Senders write their
//! own frames (no hand-off, so a lone request pays no thread wake-up): a sender queues its frame
//! and, if no other thread is sending, gathers every queued frame into one `sendmsg`. Frames
//! submitted from completion callbacks (which run on the receive thread) are held back until the
//! socket has no more replies ready, then leave together in one `sendmsg`.
//!
//! # Zero copy
//! When a reply header arrives, the receive thread looks up the waiting request and points the
//! next `readv` at: the reply's arguments, the request's own iovecs for the payload, and the next
//! reply's header. No payload byte passes through an intermediate buffer; `bytes_copied` counts
//! any that ever would.
//!
//! # Buffer lifetime contract
//! A request's payload and sink vectors must stay valid until its completion has been delivered.
//! The connection guarantees it never touches them after that: on connection failure, frames still
//! queued are dropped while holding the send lock (so no `sendmsg` is using them) before any
//! completion runs, and a reply for a request whose frame has not been fully sent is treated as a
//! protocol violation that fails the connection the same way.

use std::any::Any;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kiln_layer::trace::{Trace, REPLY_HEADER, SENT};
use kiln_proto::codec::Wire;
use kiln_proto::frame::{Header, HEADER_LEN, KIND_REPLY};
use kiln_proto::iov::{IovCursor, RawIov, IOV_MAX};
use kiln_proto::sync::{MutexExt as _, RwLockExt as _};
use kiln_proto::{errno, Op};

mod completion;
mod inreply;
mod metrics;
mod splice;
mod watchdog;

use completion::deliver;
pub use completion::{Callback, Completion, Done, Lost, Refused, ReplyData, Slot};
use inreply::{gather, scatter, InReply};
use kiln_layer::SpliceOut;
use splice::Pipe;

pub use metrics::render_metrics;
pub use watchdog::{
    bricks_away, near_misses, ping_timeout, set_ping_timeout, DEFAULT_PING_TIMEOUT,
};

pub use kiln_proto::Errno;

/// Counters of one connection. Relaxed: independent event counts, read only for display.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// Requests submitted.
    pub requests: AtomicU64,
    /// Replies received.
    pub replies: AtomicU64,
    /// `sendmsg` calls that carried frames (requests / this = frames per batch).
    pub send_calls: AtomicU64,
    /// `readv` calls on the socket.
    pub recv_calls: AtomicU64,
    /// Payload bytes received into callers' buffers.
    pub payload_bytes_in: AtomicU64,
    /// Payload bytes copied in user space by the client. The read path leaves it at zero.
    pub bytes_copied: AtomicU64,
    /// Payload bytes moved from the socket on to a descriptor, never in user memory (see
    /// [`Sink`]).
    pub bytes_spliced: AtomicU64,
    /// Replies whose splice was tried and that came back the ordinary way, or failed.
    pub splice_fallbacks: AtomicU64,
}

/// Where a reply's payload goes: into the request's memory, or on to a descriptor when `out`
/// says so and the connection can (plain TCP; see [`SpliceOut`]), into the memory otherwise.
pub struct Sink {
    /// The request's memory for the payload.
    pub iov: Vec<RawIov>,
    /// The payload's other way out.
    pub out: Option<Arc<SpliceOut>>,
}

impl From<Vec<RawIov>> for Sink {
    fn from(iov: Vec<RawIov>) -> Sink {
        Sink { iov, out: None }
    }
}

struct Pending {
    sink: Vec<RawIov>,
    out: Option<Arc<SpliceOut>>,
    done: Done,
    keep: Option<Box<dyn Any + Send>>,
    /// A sampled request's trace: stamped when its frame leaves and its reply arrives, and
    /// given the brick's stamps from the reply.
    trace: Option<Arc<Trace>>,
    /// Set once the request's frame has fully left; a reply before that is a protocol violation.
    sent: bool,
    /// Its reply brings arguments before the payload (block sums, `FLAG_SUMS`): the payload
    /// cannot be received in the same call as the header straight into the sink.
    args_first: bool,
}

struct Table {
    pending: HashMap<u64, Pending>,
    /// Traces of completed requests whose brick stamps are still to come (in a trace frame).
    traces: HashMap<u64, Arc<Trace>>,
    /// Why the connection is dead, once it is.
    dead: Option<Errno>,
}

struct OutFrame {
    id: u64,
    /// A sampled request's trace, stamped when the frame is first handed to `sendmsg`.
    trace: Option<Arc<Trace>>,
    /// Header and encoded arguments; the cursor points into this allocation.
    _head: Vec<u8>,
    cur: IovCursor,
}

/// A connection's shared state.
pub struct Conn {
    /// The socket requests are sent on (and, without `rx_sock`, replies received from).
    sock: OwnedFd,
    /// Over TLS: the TCP socket replies are received from, through a record reader, while
    /// `sock` leads to the tunnel thread that seals requests (see [`kiln_tls::Split`]).
    rx_sock: Option<OwnedFd>,
    next_id: AtomicU64,
    table: Mutex<Table>,
    sendq: Mutex<VecDeque<OutFrame>>,
    /// Held while a `sendmsg` is using queued frames' memory.
    writer: Mutex<()>,
    /// A Unix socket: replies may carry descriptors, received with every read.
    unix: bool,
    /// Descriptor batches received and not yet claimed by their reply, in stream order.
    fds: Mutex<VecDeque<Vec<OwnedFd>>>,
    /// Set once the connection failed (what [`Conn::is_dead`] reads without a lock).
    ended: std::sync::atomic::AtomicBool,
    /// Counters.
    pub stats: ConnStats,
    /// Where the brick's push frames go ([`kiln_proto::frame::FLAG_PUSH`]): called on the
    /// receiving thread with the frame's arguments, so it must not block.
    push: std::sync::RwLock<Option<PushSink>>,
    /// What the watchdog knows of the connection ([`watchdog`]).
    health: watchdog::Health,
}

/// A receiver of push frames' arguments (see [`Conn::set_push`]).
pub type PushSink = Arc<dyn Fn(&[u8]) + Send + Sync>;

thread_local! {
    /// The connection whose receive thread this is (its address), or 0.
    static RECEIVER_OF: Cell<usize> = const { Cell::new(0) };
    /// The connection this thread is batching submissions for (its address), or 0.
    static CORKED: Cell<usize> = const { Cell::new(0) };
}

/// Every connection alive in this process, for `/metrics`.
fn live() -> &'static Mutex<Vec<std::sync::Weak<Conn>>> {
    static LIVE: std::sync::OnceLock<Mutex<Vec<std::sync::Weak<Conn>>>> =
        std::sync::OnceLock::new();
    LIVE.get_or_init(Mutex::default)
}

impl Conn {
    /// Sends the brick's push frames' arguments to `sink` from now on; when the connection
    /// fails, `sink` is called once with nothing (pushes stopped).
    pub fn set_push(&self, sink: Option<PushSink>) {
        *self.push.write_locked() = sink;
    }

    /// Wraps a connected, blocking stream socket and starts its receive thread.
    pub fn start(sock: OwnedFd) -> io::Result<Arc<Conn>> {
        Conn::start_with(sock, None)
    }

    /// Starts a connection over TLS: requests go to the tunnel thread, replies are opened by
    /// the receive thread itself, straight into the requests' buffers (one copy, no hand-off).
    pub fn start_tls(split: kiln_tls::Split) -> io::Result<Arc<Conn>> {
        Conn::start_with(split.send, Some((split.recv, split.reader)))
    }

    fn start_with(
        sock: OwnedFd,
        tls: Option<(OwnedFd, kiln_tls::RecordReader)>,
    ) -> io::Result<Arc<Conn>> {
        let (rx_sock, reader) = match tls {
            Some((fd, r)) => (Some(fd), Some(r)),
            None => (None, None),
        };
        let unix = rx_sock.is_none()
            && rustix::net::getsockname(&sock)
                .is_ok_and(|a| a.address_family() == rustix::net::AddressFamily::UNIX);
        let conn = Arc::new(Conn {
            sock,
            rx_sock,
            next_id: AtomicU64::new(1),
            table: Mutex::new(Table {
                pending: HashMap::new(),
                traces: HashMap::new(),
                dead: None,
            }),
            sendq: Mutex::new(VecDeque::new()),
            writer: Mutex::new(()),
            unix,
            fds: Mutex::new(VecDeque::new()),
            ended: Default::default(),
            stats: ConnStats::default(),
            push: Default::default(),
            health: Default::default(),
        });
        {
            let mut r = live().locked();
            r.retain(|w| w.strong_count() > 0);
            r.push(Arc::downgrade(&conn));
        }
        let c = conn.clone();
        std::thread::Builder::new()
            .name("kiln-recv".into())
            .spawn(move || c.receive_loop(reader))?;
        Ok(conn)
    }

    /// True once the connection has failed or been shut down.
    pub fn is_dead(&self) -> bool {
        self.ended.load(std::sync::atomic::Ordering::Acquire)
    }

    /// True when no request waits for its reply.
    pub fn idle(&self) -> bool {
        self.table.locked().pending.is_empty()
    }

    /// Ends the connection at once; in-flight requests fail with `ECONNRESET`.
    ///
    /// What the kernel still holds to send is thrown away, not sent later: a request this
    /// side gave up on (the brick away, its miss marked on the replicas that took it) must
    /// never reach the brick after newer changes did — a write retransmitted once a cut link
    /// is back would overwrite newer bytes with nothing marking it. A TCP socket is
    /// disconnected (`connect` to `AF_UNSPEC`: the kernel drops its send queue and resets
    /// the peer), then shut down, which wakes every thread waiting on it.
    pub fn shutdown(&self) {
        for s in std::iter::once(&self.sock).chain(&self.rx_sock) {
            // Fails harmlessly on a Unix socket (nothing is ever retransmitted on one).
            let _ = rustix::net::connect_unspec(s);
        }
        self.close();
    }

    /// Ends the connection in order: what is queued is still sent, then the brick reads the
    /// end of it (a client done with a brick, after its BYE). Not for a connection whose
    /// requests are given up: [`Conn::shutdown`].
    pub fn close(&self) {
        for s in std::iter::once(&self.sock).chain(&self.rx_sock) {
            let _ = rustix::net::shutdown(s, rustix::net::Shutdown::Both);
        }
    }

    /// Waits until a reply can be received or a request sent.
    fn wait_in_or_out(&self) -> io::Result<()> {
        match &self.rx_sock {
            None => poll_fd(self.sock.as_raw_fd(), libc::POLLIN | libc::POLLOUT),
            Some(rx) => {
                let mut p = [
                    libc::pollfd {
                        fd: rx.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: self.sock.as_raw_fd(),
                        events: libc::POLLOUT,
                        revents: 0,
                    },
                ];
                // SAFETY: two valid pollfds.
                if unsafe { libc::poll(p.as_mut_ptr(), 2, -1) } < 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
                Ok(())
            }
        }
    }

    /// Sends a request.
    ///
    /// `flags` say what `args` start with: the caller's credentials (`FLAG_CRED`), then a
    /// change's stamp (`FLAG_STAMP`). `payload` is
    /// gathered after the arguments; `sink` receives a reply payload (at most its total length). `keep` is held until completion and handed back in it. With `trace`, the
    /// request asks the brick for its stamps and the connection stamps its own stages.
    ///
    /// # Safety
    /// Every vector in `payload` and `sink` must stay valid (and `sink` unaliased) until `done`
    /// has been delivered. A request not queued (too big, or the connection is dead) is returned
    /// as [`Refused`] with its `keep`, not delivered.
    // Each argument is a distinct part of the request; a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn submit(
        self: &Arc<Self>,
        op: Op,
        flags: u32,
        args: &[u8],
        payload: &[RawIov],
        sink: impl Into<Sink>,
        keep: Option<Box<dyn Any + Send>>,
        done: Done,
        trace: Option<Arc<Trace>>,
    ) -> Result<u64, Refused> {
        let Sink { iov: sink, out } = sink.into();
        let payload_len: usize = payload.iter().map(|v| v.len).sum();
        if args.len() > kiln_proto::MAX_ARGS_LEN as usize
            || payload_len > kiln_proto::MAX_PAYLOAD_LEN as usize
        {
            return Err(Refused {
                errno: errno::EMSGSIZE,
                keep,
            });
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        let mut hdr = Header::request(op as u16, id, args.len() as u32, payload_len as u32);
        if flags != 0 {
            hdr = hdr.with_flags(flags);
        }
        if let Some(t) = &trace {
            hdr = hdr.with_trace();
            t.expect_part();
            t.stamp("send queued");
        }
        let trace_out = trace.clone();
        let mut head = Vec::with_capacity(HEADER_LEN + args.len());
        head.extend_from_slice(&hdr.to_bytes());
        head.extend_from_slice(args);
        let head_iov = RawIov {
            base: head.as_ptr() as usize,
            len: head.len(),
        };
        let cur = IovCursor::new(
            std::iter::once(head_iov).chain(payload.iter().copied()),
            head.len() + payload_len,
        );
        {
            let mut t = self.table.locked();
            if let Some(e) = t.dead {
                return Err(Refused { errno: e, keep });
            }
            if t.pending.is_empty() {
                self.health.waiting();
            }
            t.pending.insert(
                id,
                Pending {
                    sink,
                    out,
                    done,
                    keep,
                    trace,
                    sent: false,
                    args_first: flags & kiln_proto::frame::FLAG_SUMS != 0,
                },
            );
        }
        self.sendq.locked().push_back(OutFrame {
            id,
            trace: trace_out,
            _head: head,
            cur,
        });
        self.stats.requests.fetch_add(1, Relaxed);
        let me = Arc::as_ptr(self) as usize;
        let deferred = RECEIVER_OF.with(|r| r.get()) == me || CORKED.with(|c| c.get()) == me;
        if !deferred {
            // Send from the caller's thread; errors surface through the receive thread, which
            // sees the socket fail and fails every request.
            let _ = self.flush(true);
        }
        Ok(id)
    }

    /// Runs `f`, holding back the frames this thread submits to this connection meanwhile, then
    /// sends them together (one `sendmsg` where they fit).
    pub fn batch<R>(self: &Arc<Self>, f: impl FnOnce() -> R) -> R {
        let me = Arc::as_ptr(self) as usize;
        let outer = CORKED.with(|c| c.replace(me));
        let r = f();
        CORKED.with(|c| c.set(outer));
        if outer != me {
            let _ = self.flush(true);
        }
        r
    }

    /// Sends queued frames without ever blocking in `sendmsg` while holding the writer lock.
    ///
    /// Returns true when the queue is empty or another thread holds the writer lock (it
    /// re-checks the queue after releasing it). With `wait`, a full socket is waited out with
    /// `poll` (no lock held); without, returns false and leaves the rest for later.
    fn flush(&self, wait: bool) -> io::Result<bool> {
        loop {
            let Ok(w) = self.writer.try_lock() else {
                return Ok(true);
            };
            let r = self.send_queued();
            drop(w);
            match r {
                Ok(true) if self.sendq.locked().is_empty() => return Ok(true),
                Ok(true) => continue, // frames queued while we were releasing the lock
                Ok(false) if wait => poll_fd(self.sock.as_raw_fd(), libc::POLLOUT)?,
                other => return other,
            }
        }
    }

    /// With the writer lock held: non-blocking `sendmsg` until the queue is empty (true) or the
    /// socket is full (false).
    fn send_queued(&self) -> io::Result<bool> {
        let mut iov: Vec<RawIov> = Vec::with_capacity(64);
        loop {
            iov.clear();
            {
                let mut q = self.sendq.locked();
                if q.is_empty() {
                    return Ok(true);
                }
                for f in q.iter_mut() {
                    let room = IOV_MAX - iov.len();
                    if room == 0 {
                        break;
                    }
                    // Stamp before the call: a send on loopback can wake the brick on this CPU,
                    // which then runs before this thread could stamp after it.
                    if let Some(t) = f.trace.take() {
                        t.stamp(SENT);
                    }
                    iov.extend_from_slice(f.cur.pending(room));
                }
            }
            let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
            // SAFETY: the vectors point at queued frames' heads and payloads, kept valid by the
            // submit contract; no frame leaves the queue while we hold the writer lock, except by
            // this function. A zeroed msghdr is valid (no name, no control data).
            let n = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
                msg.msg_iovlen = iov.len();
                libc::sendmsg(self.sock.as_raw_fd(), &msg, flags)
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => return Ok(false),
                    _ => return Err(e),
                }
            }
            self.stats.send_calls.fetch_add(1, Relaxed);
            let mut left = n as usize;
            let mut finished = Vec::new();
            {
                let mut q = self.sendq.locked();
                while left > 0 {
                    let f = q.front_mut().expect("sent bytes belong to queued frames");
                    left -= f.cur.advance(left);
                    if f.cur.is_done() {
                        finished.push(q.pop_front().expect("front").id);
                    } else {
                        break;
                    }
                }
            }
            if !finished.is_empty() {
                let mut t = self.table.locked();
                for id in finished {
                    if let Some(p) = t.pending.get_mut(&id) {
                        p.sent = true;
                    }
                }
            }
        }
    }

    /// Fails the connection: drops unsent frames under the writer lock, then fails every request,
    /// including `receiving`, the one whose reply was arriving.
    fn fail(&self, why: Errno, receiving: Option<Pending>) {
        self.shutdown();
        let drained = {
            let _w = self.writer.locked();
            self.sendq.locked().clear();
            let mut t = self.table.locked();
            t.dead.get_or_insert(why);
            self.ended.store(true, std::sync::atomic::Ordering::Release);
            std::mem::take(&mut t.pending)
        };
        // Pushes stop with the connection: an empty push says so (see `set_push`).
        let sink = self.push.write_locked().take();
        if let Some(sink) = sink {
            sink(&[]);
        }
        for p in receiving.into_iter().chain(drained.into_values()) {
            let lost = if p.sent { Lost::InDoubt } else { Lost::Unsent };
            deliver(
                p.done,
                Completion {
                    result: Err(why),
                    keep: p.keep,
                    lost: Some(lost),
                },
            );
        }
    }

    fn receive_loop(self: Arc<Self>, mut tls: Option<kiln_tls::RecordReader>) {
        RECEIVER_OF.with(|r| r.set(Arc::as_ptr(&self) as usize));
        let mut cur: Option<InReply> = None;
        let why = match self.receive(&mut cur, tls.as_mut()) {
            Ok(()) => errno::ECONNRESET,
            Err(e) => {
                tracing::debug!("connection failed: {e}");
                match e.raw_os_error() {
                    Some(c) if c as u32 == errno::EPROTO => errno::EPROTO,
                    _ => errno::ECONNRESET,
                }
            }
        };
        self.fail(why, cur.and_then(|r| r.pending));
    }

    /// Receives replies until the connection ends. `cur` is the reply being received, left in
    /// place on return so that its request can be failed too.
    fn receive(
        &self,
        cur: &mut Option<InReply>,
        mut tls: Option<&mut kiln_tls::RecordReader>,
    ) -> io::Result<()> {
        let fd = self.rx_sock.as_ref().unwrap_or(&self.sock).as_raw_fd();
        let mut next_hdr = [0u8; HEADER_LEN];
        let mut hdr_got = 0usize;
        let mut scratch = vec![0u8; 64 * 1024];
        let mut iov: Vec<RawIov> = Vec::with_capacity(8);
        let mut drained = false;
        // Stream bytes that a speculative receive put in the wrong place, to be received first.
        let mut carry: Vec<u8> = Vec::new();
        let mut carry_at = 0usize;
        // Replies moved on to a descriptor go through this pipe (see `splice`).
        let mut pipe: Option<Pipe> = None;
        let can_splice = tls.is_none() && !self.unix;
        loop {
            // Frames queued by callbacks: send them once no reply is ready — known when the
            // last receive came up short, or when a non-blocking one would block.
            let mut deferred = !self.sendq.locked().is_empty();
            if deferred && drained {
                if !self.flush(false)? {
                    self.wait_in_or_out()?;
                }
                deferred = !self.sendq.locked().is_empty();
            }
            if can_splice && carry.is_empty() && self.splice_current(fd, cur, &mut pipe)? {
                continue;
            }
            iov.clear();
            let whole = match cur.as_mut() {
                Some(r) => r.vectors(&mut iov, &mut scratch),
                None => true,
            };
            if whole {
                iov.push(RawIov {
                    base: next_hdr[hdr_got..].as_mut_ptr() as usize,
                    len: HEADER_LEN - hdr_got,
                });
            }
            // With one request in flight, its reply is the only one that can come: receive its
            // payload into its sink in the same call as the header (one system call, not two).
            let mut speculating = None;
            if cur.is_none() && hdr_got == 0 && carry.is_empty() {
                speculating = self.speculate(&mut iov);
            }
            if !carry.is_empty() {
                let n = scatter(&carry[carry_at..], &iov);
                carry_at += n;
                if carry_at == carry.len() {
                    carry.clear();
                    carry_at = 0;
                }
                self.account(n, cur, &mut hdr_got, &next_hdr)?;
                continue;
            }
            let got = match tls.as_deref_mut() {
                // SAFETY: as below.
                Some(r) => unsafe {
                    r.recv(std::os::fd::BorrowedFd::borrow_raw(fd), &iov, deferred)
                },
                None => self.recv_plain(fd, &mut iov, deferred),
            };
            let n = match got {
                Ok(n) => n,
                Err(e) => match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    io::ErrorKind::WouldBlock => {
                        if !self.flush(false)? {
                            self.wait_in_or_out()?;
                        }
                        continue;
                    }
                    _ => return Err(e),
                },
            };
            if n == 0 {
                return Ok(());
            }
            self.stats.recv_calls.fetch_add(1, Relaxed);
            self.health.heard();
            drained = n < iov.iter().map(|v| v.len).sum::<usize>();
            let left = n;
            if let (Some(id), true) = (speculating, left > HEADER_LEN) {
                let r =
                    self.begin_speculated(id, &next_hdr, left - HEADER_LEN, &iov[1..], &mut carry)?;
                hdr_got = 0;
                if r.is_complete() {
                    self.complete(r);
                } else {
                    *cur = Some(r);
                }
                continue;
            }
            self.account(left, cur, &mut hdr_got, &next_hdr)?;
        }
    }

    /// With one request in flight and no trace frame on its way (it would land in the sink),
    /// its reply is the only one that can come: appends its sink to `iov` and returns its id.
    fn speculate(&self, iov: &mut Vec<RawIov>) -> Option<u64> {
        let t = self.table.locked();
        if t.pending.len() != 1 || !t.traces.is_empty() {
            return None;
        }
        let (&id, p) = t.pending.iter().next()?;
        if p.sink.is_empty() || p.out.is_some() || p.args_first {
            return None;
        }
        iov.extend(p.sink.iter().take(IOV_MAX - 1));
        Some(id)
    }

    /// One `recvmsg` into `iov`; on a Unix socket with room for descriptors, which are queued
    /// for the reply they came with.
    fn recv_plain(&self, fd: i32, iov: &mut [RawIov], deferred: bool) -> io::Result<usize> {
        let flags = libc::MSG_CMSG_CLOEXEC | if deferred { libc::MSG_DONTWAIT } else { 0 };
        // u64s: aligned for `cmsghdr`; room for a few descriptors (a frame carries at most 4).
        let mut control = [0u64; 8];
        // SAFETY: a zeroed msghdr is valid; the vectors point at this thread's header and
        // scratch buffers and at the current request's sink, which its submitter keeps valid
        // until completion; the control buffer lives on this stack for the call.
        let (n, msg) = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
            msg.msg_iovlen = iov.len();
            if self.unix {
                msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
                msg.msg_controllen = std::mem::size_of_val(&control);
            }
            (libc::recvmsg(fd, &mut msg, flags), msg)
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if self.unix && msg.msg_controllen > 0 {
            self.take_fds(&msg);
        }
        Ok(n as usize)
    }

    /// Queues the descriptors of a received message as one batch.
    fn take_fds(&self, msg: &libc::msghdr) {
        let mut batch = Vec::new();
        let mut rights = false;
        // SAFETY: walking the control messages the kernel wrote into `msg`'s buffer, within
        // `msg_controllen`; each SCM_RIGHTS payload is an array of descriptors now ours.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    rights = true;
                    let data = libc::CMSG_DATA(c) as *const i32;
                    let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for i in 0..len / std::mem::size_of::<i32>() {
                        let raw = std::ptr::read_unaligned(data.add(i));
                        batch.push(<OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw));
                    }
                }
                c = libc::CMSG_NXTHDR(msg, c);
            }
        }
        let truncated = msg.msg_flags & libc::MSG_CTRUNC != 0;
        if truncated {
            // The kernel closed what did not fit: the reply gets fewer than it says.
            tracing::warn!("descriptors truncated on receive");
        }
        // One batch per frame that carried descriptors, even an emptied one, so that batches
        // and frames stay paired.
        if rights || truncated {
            self.fds.locked().push_back(batch);
        }
    }

    /// Accounts `left` bytes received into the vectors built for `cur` and the next header:
    /// completes replies and starts the ones whose headers are now whole.
    fn account(
        &self,
        mut left: usize,
        cur: &mut Option<InReply>,
        hdr_got: &mut usize,
        next_hdr: &[u8; HEADER_LEN],
    ) -> io::Result<()> {
        if let Some(r) = cur.as_mut() {
            left = r.advance(left);
            if r.is_complete() {
                let r = cur.take().expect("current reply");
                self.complete(r);
            }
        }
        *hdr_got += left;
        while cur.is_none() && *hdr_got == HEADER_LEN {
            *hdr_got = 0;
            let hdr = Header::parse(next_hdr).map_err(|e| {
                tracing::warn!("bad reply header: {e}");
                io::Error::from_raw_os_error(errno::EPROTO as i32)
            })?;
            if hdr.kind != KIND_REPLY {
                tracing::warn!("server sent a request frame");
                return Err(io::Error::from_raw_os_error(errno::EPROTO as i32));
            }
            let r = self.begin(hdr)?;
            if r.is_complete() {
                self.complete(r);
            } else {
                *cur = Some(r);
            }
        }
        Ok(())
    }

    /// A header arrived together with `spilled` bytes that went straight into the sink of
    /// request `id`, the only one in flight when the receive began (`after` are the vectors
    /// that followed the header). When the header is that request's data reply, its payload is
    /// already in place; whatever landed beyond it (another reply: a request may have been
    /// submitted meanwhile) or all of it (the header is for another request, or carries
    /// arguments or an error) is the stream's continuation and is moved to `carry`, to be
    /// received from there before the socket is read again.
    fn begin_speculated(
        &self,
        id: u64,
        hdr: &[u8; HEADER_LEN],
        spilled: usize,
        after: &[RawIov],
        carry: &mut Vec<u8>,
    ) -> io::Result<InReply> {
        let hdr = Header::parse(hdr).map_err(|e| {
            tracing::warn!("bad reply header: {e}");
            io::Error::from_raw_os_error(errno::EPROTO as i32)
        })?;
        let fits = hdr.kind == KIND_REPLY
            && hdr.request_id.get() == id
            && !hdr.traced()
            && hdr.status.get() == 0
            && hdr.args_len.get() == 0;
        let keep = if fits {
            spilled.min(hdr.payload_len.get() as usize)
        } else {
            0
        };
        if keep < spilled {
            self.stats
                .bytes_copied
                .fetch_add((spilled - keep) as u64, Relaxed);
            gather(after, keep, spilled - keep, carry);
        }
        if hdr.kind != KIND_REPLY {
            tracing::warn!("server sent a request frame");
            return Err(io::Error::from_raw_os_error(errno::EPROTO as i32));
        }
        let mut r = self.begin(hdr)?;
        let rest = r.advance(keep);
        debug_assert_eq!(rest, 0, "kept bytes fit the payload");
        Ok(r)
    }

    /// A reply header arrived: find its request and prepare to receive into its sink.
    fn begin(&self, hdr: Header) -> io::Result<InReply> {
        let id = hdr.request_id.get();
        if hdr.is_push() && (hdr.payload_len.get() != 0 || hdr.has_fds()) {
            tracing::warn!("push frame with a payload");
            return Err(io::Error::from_raw_os_error(errno::EPROTO as i32));
        }
        if hdr.traced() || hdr.is_push() {
            // The brick's stamps for a request that has completed.
            let trace = self.table.locked().traces.remove(&id);
            if hdr.payload_len.get() != 0 {
                tracing::warn!(id, "trace frame with a payload");
                return Err(io::Error::from_raw_os_error(errno::EPROTO as i32));
            }
            return Ok(InReply {
                id,
                trace_frame: true,
                push: hdr.is_push(),
                trace,
                status: hdr.status.get(),
                args: vec![0u8; hdr.args_len.get() as usize],
                args_got: 0,
                sink: IovCursor::default(),
                payload_len: 0,
                discard: 0,
                discard_got: 0,
                pending: None,
                fds: Vec::new(),
                splice: false,
            });
        }
        let pending = self.table.locked().pending.remove(&id);
        let payload_len = hdr.payload_len.get() as usize;
        let pending = match pending {
            Some(p) if !p.sent => {
                // The sender may not have recorded the end of its `sendmsg` yet: wait for it
                // (bounded: sends never block under the writer lock), then look again.
                drop(self.writer.locked());
                if !self.sendq.locked().iter().any(|f| f.id == id) {
                    Some(p)
                } else {
                    tracing::warn!(id, "reply arrived before its request was sent");
                    self.table.locked().pending.insert(id, p);
                    return Err(io::Error::from_raw_os_error(errno::EPROTO as i32));
                }
            }
            other => other,
        };
        if let Some(t) = pending.as_ref().and_then(|p| p.trace.as_ref()) {
            t.stamp(REPLY_HEADER);
        }
        let (sink, pending) = match pending {
            Some(mut p) => (
                IovCursor::new(std::mem::take(&mut p.sink), payload_len),
                Some(p),
            ),
            None => {
                // Server-side errors for frames it could not parse carry id 0.
                if id != 0 {
                    tracing::debug!(id, "reply for an unknown request");
                }
                (IovCursor::default(), None)
            }
        };
        let discard = payload_len - sink.remaining();
        let fds = match hdr.has_fds() {
            false => Vec::new(),
            true => self.fds.locked().pop_front().ok_or_else(|| {
                tracing::warn!(id, "reply says it carries descriptors, but none came");
                io::Error::from_raw_os_error(errno::EPROTO as i32)
            })?,
        };
        Ok(InReply {
            id,
            trace_frame: false,
            push: false,
            trace: None,
            status: hdr.status.get(),
            args: vec![0u8; hdr.args_len.get() as usize],
            args_got: 0,
            sink,
            payload_len,
            discard,
            discard_got: 0,
            splice: hdr.status.get() == 0
                && hdr.args_len.get() == 0
                && discard == 0
                && payload_len > 0
                && pending.as_ref().is_some_and(|p| p.out.is_some()),
            pending,
            fds,
        })
    }

    fn complete(&self, r: InReply) {
        if r.push {
            let sink = self.push.read_locked().clone();
            if let Some(sink) = sink {
                sink(&r.args);
            }
            return;
        }
        if r.trace_frame {
            if let Some(t) = r.trace {
                match kiln_proto::ops::TraceBlock::from_wire(&r.args) {
                    Ok(block) => t.merge_remote(&block),
                    Err(e) => tracing::warn!("malformed trace frame ignored: {e}"),
                }
                t.part_done();
            }
            return;
        }
        self.stats.replies.fetch_add(1, Relaxed);
        let landed = r.payload_len - r.discard;
        debug_assert!(r.sink.is_done());
        self.stats
            .payload_bytes_in
            .fetch_add(landed as u64, Relaxed);
        let Some(p) = r.pending else {
            if r.status != 0 && r.args.is_empty() && r.payload_len == 0 {
                tracing::warn!(status = r.status, "server reported an error for no request");
            }
            return;
        };
        let args = r.args;
        if let Some(t) = p.trace {
            t.stamp("reply received");
            self.table.locked().traces.insert(r.id, t);
        }
        let result = if r.status != 0 {
            Err(r.status)
        } else if r.discard > 0 {
            tracing::warn!("server sent more payload than the request asked for");
            Err(errno::EPROTO)
        } else {
            Ok(ReplyData {
                args,
                payload_len: landed,
                fds: r.fds,
            })
        };
        deliver(
            p.done,
            Completion {
                result,
                keep: p.keep,
                lost: None,
            },
        );
    }
}

fn poll_fd(fd: i32, events: i16) -> io::Result<()> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, -1) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}
