//! One client connection: receive frames, run fops against the brick, send replies.
//!
//! The receive side reads each frame's arguments and payload straight into the buffers that will
//! be used — a WRITE's payload lands in the buffer handed to `pwrite` — and reads ahead into the
//! next frame's header in the same `readv`. Replies that are ready together leave together: the
//! in-memory parts of consecutive replies are gathered into one `sendmsg`, and a large READ's
//! file data follows its header with `sendfile`, never passing through user space.
//!
//! Each connection runs on a thread of its own (see [`crate::spawn_serve`]). Fast fops run
//! inline on it (page-cache reads and writes, metadata): no hop to another thread, and a storage
//! call that blocks — a slow disk, a hung file system under the brick — holds up only the
//! connection that asked. Fops that may block for long (fsync, fallocate) run on the blocking
//! pool and their replies join the queue when done, so replies leave in completion order, not
//! request order.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use kiln_layer::{Ctx, Fd, LayerRef, Trace};
use kiln_proto::codec::Wire;
use kiln_proto::frame::{Header, HEADER_LEN, KIND_REQUEST};
use kiln_proto::ops::*;
use kiln_proto::sync::MutexExt as _;
use kiln_proto::{errno, Op};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

pub use crate::limits::Limits;
use crate::stats::Stats;
use kiln_layer::Errno;

pub use kiln_layer::layers::posix::SENDFILE_MIN;

mod caps;
mod fops;
mod handshake;
mod incoming;
mod pushes;

use crate::watch::pushed;
use incoming::{fill_random, raw, recv_into, Incoming};
mod grant;
mod send;

/// Bytes read past a header at a frame boundary: enough for the arguments of every fop but
/// long paths, so a small request costs one `readv`. A WRITE whose payload starts inside it has
/// at most this many payload bytes copied (counted in `Stats::bytes_copied`).
const STAGE_LEN: usize = 64;
/// The stage once [`QUIET_FRAMES`] small frames in a row came (no WRITE, no reply sent from a
/// file): a burst of small requests (32 reads at queue depth 32 are 1.8 KiB) then arrives in
/// one `readv` instead of one each. The first WRITE after such a run may have up to this many
/// payload bytes copied (counted); a stream with writes in it keeps the short stage and its
/// payloads land in place. Streams of big reads (replies sent from the file) keep it short
/// too: each of their replies costs a `sendmsg` and a `sendfile` anyway, so bursts gain them
/// nothing measurable (128 KiB QD32 within noise either way, bench/README.md).
const STAGE_MAX: usize = 4096;
/// Small frames in a row after which the stage grows to [`STAGE_MAX`].
const QUIET_FRAMES: u32 = 64;
/// Stop reading new requests while this many reply bytes wait to be sent.
const OUT_HIGH_WATER: usize = 8 * 1024 * 1024;
/// Most vectors gathered into one `sendmsg`.
const GATHER_MAX: usize = 64;

/// The body of a reply.
enum Body {
    None,
    Buf(Vec<u8>),
    /// `len` bytes of `file` from `offset`, sent with `sendfile`.
    File {
        file: Arc<File>,
        offset: u64,
        len: usize,
    },
    /// No payload: descriptors that go with the frame's first byte ([`grant`]).
    Fds(Vec<OwnedFd>),
}

impl Body {
    fn len(&self) -> usize {
        match self {
            Body::None | Body::Fds(_) => 0,
            Body::Buf(b) => b.len(),
            Body::File { len, .. } => *len,
        }
    }
}

/// A reply waiting to be sent.
struct OutReply {
    head: Vec<u8>,
    body: Body,
    /// Bytes of head + body already sent.
    sent: usize,
    /// For a trace frame: where in `head` the "reply write" stamp goes.
    stamp_at: Option<usize>,
    /// The next queued frame is this reply's trace frame: stamp it when this reply's first byte
    /// is handed to the socket.
    stamps_next: bool,
}

/// Label of the last stamp of a traced reply.
const REPLY_WRITE: &str = "brick: reply write";

impl OutReply {
    fn new(op: u16, id: u64, result: Result<(Vec<u8>, Body), Errno>) -> OutReply {
        OutReply::plain(op, id, result)
    }

    /// A reply, and with a trace the frame that carries the brick's stamps after it. The
    /// stamps end with a placeholder for the reply-write stamp, filled in when the reply's
    /// first byte is handed to the socket.
    fn traced(
        op: u16,
        id: u64,
        result: Result<(Vec<u8>, Body), Errno>,
        trace: Option<&Trace>,
    ) -> (OutReply, Option<OutReply>) {
        let reply = OutReply::plain(op, id, result);
        let Some(t) = trace else {
            return (reply, None);
        };
        t.stamp("brick: reply queued");
        t.stamp_at(0, REPLY_WRITE);
        let block = t.to_block().to_wire();
        let hdr = Header::reply(op, id, 0, block.len() as u32, 0).with_trace();
        let mut head = Vec::with_capacity(HEADER_LEN + block.len());
        head.extend_from_slice(&hdr.to_bytes());
        head.extend_from_slice(&block);
        // The block ends with the placeholder event: t_ns (8 bytes), then its label.
        let stamp_at = Some(head.len() - REPLY_WRITE.to_owned().to_wire().len() - 8);
        let frame = OutReply {
            head,
            body: Body::None,
            sent: 0,
            stamp_at,
            stamps_next: false,
        };
        (
            OutReply {
                stamps_next: true,
                ..reply
            },
            Some(frame),
        )
    }

    fn plain(op: u16, id: u64, result: Result<(Vec<u8>, Body), Errno>) -> OutReply {
        let (status, args, body) = match result {
            Ok((args, body)) => (0, args, body),
            Err(e) => (e, Vec::new(), Body::None),
        };
        let mut hdr = Header::reply(op, id, status, args.len() as u32, body.len() as u32);
        if matches!(body, Body::Fds(_)) {
            hdr = hdr.with_fds();
        }
        let mut head = Vec::with_capacity(HEADER_LEN + args.len());
        head.extend_from_slice(&hdr.to_bytes());
        head.extend_from_slice(&args);
        OutReply {
            head,
            body,
            sent: 0,
            stamp_at: None,
            stamps_next: false,
        }
    }

    fn total(&self) -> usize {
        self.head.len() + self.body.len()
    }
}

/// What the receiving side of a connection holds between reads: the next frame's header as
/// far as it came, the frame being received, and the stage (see [`STAGE_LEN`]).
struct Rx {
    next_hdr: [u8; HEADER_LEN],
    hdr_got: usize,
    cur: Option<Incoming>,
    stage: Vec<u8>,
}

/// How a round of receiving ended.
enum Received {
    /// The socket has nothing more for now (or replies back up).
    Drained,
    /// The peer closed the connection.
    Closed,
    /// The stream is broken (a bad header): why.
    Broken(String),
}

/// A fop's outcome before it becomes a reply: open and create hand back a handle that the
/// connection numbers when it queues the reply.
enum Done {
    Reply(Vec<u8>, Body),
    Open(Fd),
    Create(Fd, Attr),
}

/// A fop still running (it waited on something: the blocking pool, a delay).
type FopFuture = Pin<Box<dyn Future<Output = Result<Done, Errno>> + Send>>;

/// A fop that finished off the connection's task.
struct Finished {
    op: u16,
    id: u64,
    result: Result<Done, Errno>,
    trace: Option<Arc<Trace>>,
}

/// What the connection learns from a request.
enum Step {
    /// Reply now (protocol fops, errors found while decoding).
    Now(Vec<u8>, Body),
    /// Run through the stack.
    Stack(FopFuture),
}

/// Clients that announced a metrics endpoint, by connection: `kiln volume profile` asks them.
pub type ClientBook = Arc<std::sync::Mutex<HashMap<u64, String>>>;

/// A connection that ran no frame for this long asks its socket, before the next, whether
/// the client reset it meanwhile (see [`Conn::abandoned_by_client`]): well under the time a
/// client waits before it gives a silent brick up.
const RECHECK_AFTER: std::time::Duration = std::time::Duration::from_millis(500);

/// Per-connection state.
struct Conn {
    stack: LayerRef,
    stats: Arc<Stats>,
    clients: ClientBook,
    conn_id: u64,
    limits: Limits,
    peer: String,
    /// What the client must prove, and what it proved.
    who: handshake::Who,
    /// What the connection may do (the compatibility identity's until AUTH says otherwise).
    caps: Arc<crate::identity::Caps>,
    /// `caps` restrict nothing: requests are not checked against them.
    unrestricted: bool,
    /// `caps`' subtree, shared by the requests that carry it to the posix layer.
    subtree: Option<Arc<str>>,
    /// Answers MGMT requests, on a kilnd that manages volumes.
    mgmt: Option<crate::control::Handler>,
    /// Close once the queued replies are out (a refused client).
    closing: bool,
    /// The socket the client's bytes arrive by (over TLS, the TCP socket under the tunnel),
    /// asked after a pause whether the client reset the connection meanwhile.
    wire: Option<OwnedFd>,
    /// When this connection last started running a frame.
    last_frame: std::time::Instant,
    /// The client reset the connection while frames of it waited here: they are dropped
    /// unrun (see [`Conn::abandoned_by_client`]).
    abandoned: bool,
    /// Requests dispatched whose replies have not been fully sent.
    inflight: usize,
    /// Frames since the last WRITE or file-body reply (saturating): how much [`Conn::run`]
    /// reads past a header.
    small_run: u32,
    handles: HashMap<u64, Fd>,
    next_fh: u64,
    out: VecDeque<OutReply>,
    out_bytes: usize,
    done_tx: mpsc::UnboundedSender<Finished>,
    /// Over TLS: seals replies into records on the TCP socket (requests arrive through the
    /// tunnel in plaintext).
    tls_out: Option<kiln_tls::RecordWriter>,
    /// This connection's place: a stranger's until the handshake is done.
    ticket: crate::door::Ticket,
    /// A Unix-socket peer: may take grants.
    local: bool,
    /// The brick's grants, and this connection's.
    grants: Arc<crate::grants::Grants>,
    mine: crate::grants::ConnGrants,
    /// The brick's watchers, and this connection's place among them if it watches.
    watchers: Arc<crate::watch::Watchers>,
    watch: Option<Arc<crate::watch::Watcher>>,
    /// The path each handle was opened by, for the changes made through it.
    handle_paths: HashMap<u64, String>,
    /// Requests on the stack that change something, by request id: what to publish when
    /// they are done, and the path of an open's handle.
    changing: HashMap<u64, Changing>,
}

/// What a request on the stack changes, published when it is done (see `pushes`); for an
/// open, the path its handle will have.
struct Changing {
    changes: Vec<(String, u8)>,
    opened: Option<String>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.clients.locked().remove(&self.conn_id);
        self.watchers.remove(self.conn_id);
        // First what the connection may have left half done (a client killed mid-write),
        // while its handles still say what it was changing; then the handles it never
        // released.
        self.stack.hangup(self.conn_id);
        self.mine.hangup(&self.grants, self.conn_id);
        for (_, fd) in self.handles.drain() {
            let stack = self.stack.clone();
            kiln_layer::exec::spawn(async move {
                let _ = stack.release(&Ctx::NONE, fd).await;
            });
        }
    }
}

/// What a connection runs on.
pub enum Sock {
    /// A plain socket: requests in, replies out (with `sendfile`).
    Plain(OwnedFd),
    /// TLS: requests arrive in plaintext from a receiving thread, replies are sealed straight
    /// from their buffers and files onto the TCP socket (see [`kiln_tls::SplitServer`]).
    Tls(kiln_tls::SplitServer),
}

fn register(sock: OwnedFd, peer: &str) -> Option<AsyncFd<OwnedFd>> {
    if let Err(e) = rustix::io::ioctl_fionbio(&sock, true) {
        tracing::warn!(%peer, "cannot make socket non-blocking: {e}");
        return None;
    }
    // SAFETY: `OwnedFd` owns a valid open descriptor and returns the same one from `as_raw_fd`
    // until the `AsyncFd` drops it.
    match unsafe { AsyncFd::register(sock) } {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::warn!(%peer, "cannot register socket: {e}");
            None
        }
    }
}

/// What every connection of a server is served with (cloned per connection).
#[derive(Clone)]
pub struct Served {
    /// The brick's stack.
    pub stack: LayerRef,
    /// The server's counters.
    pub stats: Arc<Stats>,
    /// Clients' metrics endpoints, for profiles.
    pub clients: ClientBook,
    /// Per-connection limits.
    pub limits: Limits,
    /// The compatibility identity's key clients may prove (a shared secret), if any.
    pub secret: Option<Arc<[u8]>>,
    /// The named identities clients may prove, if the server admits any.
    pub identities: Option<Arc<crate::identity::Identities>>,
    /// The compatibility identity's capabilities (a server's without keys too).
    pub compat: Arc<crate::identity::Caps>,
    /// The management handler, on a kilnd that manages volumes.
    pub mgmt: Option<crate::control::Handler>,
    /// Local clients' short-circuit grants, brick-wide.
    pub grants: Arc<crate::grants::Grants>,
    /// Connections that asked to be told of others' changes, brick-wide.
    pub watchers: Arc<crate::watch::Watchers>,
}

/// Serves one connection from `from` (None: a Unix socket), holding `ticket` (its place at
/// the door), until the peer closes it or breaks the protocol.
pub async fn serve(
    sock: Sock,
    served: Served,
    ticket: crate::door::Ticket,
    from: crate::door::Address,
    peer: String,
) {
    let mut who = handshake::Who::new(&served, from);
    let Served {
        stack,
        stats,
        clients,
        limits,
        mgmt,
        grants,
        watchers,
        ..
    } = served;
    static NEXT_CONN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let (recv, send) = match sock {
        Sock::Plain(s) => (s, None),
        Sock::Tls(t) => {
            who.certificate = t.peer_name;
            (t.recv, Some((t.send, t.writer)))
        }
    };
    // Grants go only to Unix-socket peers: on this host, and able to take descriptors.
    let local = send.is_none()
        && rustix::net::getsockname(&recv)
            .is_ok_and(|a| a.address_family() == rustix::net::AddressFamily::UNIX);
    let Some(fd) = register(recv, &peer) else {
        return;
    };
    let (wfd, tls_out) = match send {
        Some((s, w)) => match register(s, &peer) {
            Some(wfd) => (Some(wfd), Some(w)),
            None => return,
        },
        None => (None, None),
    };
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let mut conn = Conn {
        stack,
        stats,
        clients,
        conn_id: NEXT_CONN.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        limits,
        peer: peer.clone(),
        caps: who.compat.clone(),
        unrestricted: caps::unrestricted(&who.compat),
        subtree: None,
        who,
        mgmt,
        closing: false,
        wire: rustix::io::dup(wfd.as_ref().unwrap_or(&fd).get_ref()).ok(),
        last_frame: std::time::Instant::now(),
        abandoned: false,
        inflight: 0,
        small_run: 0,
        handles: HashMap::new(),
        next_fh: 1,
        out: VecDeque::new(),
        out_bytes: 0,
        done_tx,
        tls_out,
        ticket,
        local,
        grants,
        mine: Default::default(),
        watchers,
        watch: None,
        handle_paths: HashMap::new(),
        changing: HashMap::new(),
    };
    match conn
        .run(&fd, wfd.as_ref().unwrap_or(&fd), &mut done_rx, &peer)
        .await
    {
        Ok(()) => tracing::debug!(%peer, "connection closed"),
        Err(e) => tracing::info!(%peer, "connection ended: {e}"),
    }
    // The client hears the end at once, whatever still runs here. Over TLS the receiving
    // thread holds the TCP socket too: this ends its read, and the connection.
    for sock in std::iter::once(&fd).chain(&wfd) {
        let _ = rustix::net::shutdown(sock.get_ref(), rustix::net::Shutdown::Both);
    }
    // Fops still running (waiting for a lock, on the blocking pool) finish before the
    // connection's runtime goes: each holds a sender, so the channel ends with the last. What
    // they opened joins the connection's handles, released with them; only then does the
    // stack mark what the connection left half done.
    conn.done_tx = mpsc::unbounded_channel().0;
    while let Some(f) = done_rx.recv().await {
        conn.finish(f);
    }
    drop(conn);
}

/// Splits what a request's flags say its arguments start with — the caller's credentials,
/// then a change's stamp — from the fop's own arguments, into the context. Credentials count
/// only for fops run for the caller ([`Op::acts_for_caller`]: replication control and data
/// fops run as the brick), stamps only for changes of bytes.
fn prefixed<'a>(
    hdr: &Header,
    op: Op,
    mut cx: Ctx,
    args: &'a [u8],
) -> Result<(Ctx, &'a [u8]), kiln_proto::DecodeError> {
    let mut rest = args;
    if hdr.has_cred() {
        let (c, r) = kiln_proto::Cred::split(rest)?;
        if op.acts_for_caller() {
            cx = cx.with_cred(Some(Arc::new(c)));
        }
        rest = r;
    }
    if hdr.has_stamp() {
        let (s, r) = kiln_proto::stamp::Stamp::split(rest)?;
        if op.changes_bytes() {
            cx.change = Some(s);
        }
        rest = r;
    }
    cx.ship_sums = hdr.wants_sums() && op == Op::Read;
    Ok((cx, rest))
}

impl Conn {
    /// True while this connection may take in more requests.
    fn may_read(&self) -> bool {
        !self.closing && self.out_bytes < OUT_HIGH_WATER && self.inflight < self.limits.max_inflight
    }

    async fn run(
        &mut self,
        fd: &AsyncFd<OwnedFd>,
        wfd: &AsyncFd<OwnedFd>,
        done_rx: &mut mpsc::UnboundedReceiver<Finished>,
        peer: &str,
    ) -> io::Result<()> {
        let mut rx = Rx {
            next_hdr: [0u8; HEADER_LEN],
            hdr_got: 0,
            cur: None,
            stage: vec![0u8; STAGE_MAX],
        };
        // One timer for the idle timeout, re-armed lazily: when it fires after activity, it is
        // pushed out instead of being reset on every frame.
        let idle = self.limits.idle_timeout;
        let idle_on = !idle.is_zero();
        let mut last_activity = tokio::time::Instant::now();
        // With the timeout off the timer is parked a year out and never polled.
        let park = std::time::Duration::from_secs(365 * 24 * 3600);
        let idle_timer =
            tokio::time::sleep_until(last_activity + if idle_on { idle } else { park });
        tokio::pin!(idle_timer);
        loop {
            let watch = self.watch.clone();
            let mut reloads = self.who.reloads.take();
            let reading = self.may_read();
            let writing = self.has_output();
            let quiet = idle_on && self.inflight == 0 && self.out.is_empty();
            tokio::select! {
                biased;
                Some(f) = done_rx.recv() => self.finish(f),
                why = self.ticket.closing(), if !self.ticket.is_client() => {
                    tracing::info!(peer, "{why}");
                    return Ok(());
                }
                () = &mut idle_timer, if quiet => {
                    if last_activity.elapsed() >= idle {
                        tracing::info!(peer, "closing a connection idle for {idle:?}");
                        return Ok(());
                    }
                    idle_timer.as_mut().reset(last_activity + idle);
                }
                g = fd.readable(), if reading => {
                    let mut g = g?;
                    last_activity = tokio::time::Instant::now();
                    match self.receive(&mut g, &mut rx)? {
                        Received::Drained => {}
                        Received::Closed => return Ok(()),
                        Received::Broken(why) => return self.fatal(wfd, &why).await,
                    }
                }
                g = wfd.writable(), if writing => g?.retain_ready(),
                () = pushed(watch.as_deref()) => {}
                () = handshake::reloaded(reloads.as_mut()) => {
                    if !self.identity_still_good() {
                        return Ok(());
                    }
                }
            }
            if self.who.reloads.is_none() {
                self.who.reloads = reloads;
            }
            self.queue_pushes();
            while let Ok(f) = done_rx.try_recv() {
                self.finish(f);
            }
            self.flush(wfd)?;
            if self.closing && !self.has_output() {
                return Ok(());
            }
        }
    }

    /// Receives and runs everything the socket holds, unless replies back up.
    fn receive(
        &mut self,
        g: &mut tokio::io::unix::AsyncFdReadyGuard<'_, OwnedFd>,
        rx: &mut Rx,
    ) -> io::Result<Received> {
        while self.may_read() {
            // At a frame boundary, also ask for the start of the frame into the stage: a small
            // request then costs one readv, not two (header, then args).
            let at_boundary = rx.cur.is_none();
            let stage_len = self.stage_len();
            let recv = g.try_io(|s| {
                let stage = if at_boundary {
                    Some(&mut rx.stage[..stage_len])
                } else {
                    None
                };
                let hdr = &mut rx.next_hdr[rx.hdr_got..];
                recv_into(s.as_raw_fd(), rx.cur.as_mut(), hdr, stage)
            });
            self.stats
                .recv_calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (n, asked) = match recv {
                Ok(Ok((0, _))) => return Ok(Received::Closed),
                Ok(Ok(r)) => r,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => break,
            };
            let (direct, staged) = if at_boundary {
                let h = (HEADER_LEN - rx.hdr_got).min(n);
                (h, n - h)
            } else {
                (n, 0)
            };
            let mut left = direct;
            if let Some(inc) = rx.cur.as_mut() {
                left = inc.advance(left);
                if inc.is_complete() {
                    let inc = rx.cur.take().expect("current frame");
                    self.dispatch(inc);
                }
            }
            rx.hdr_got += left;
            if let Err(why) = self.start_frames(&rx.next_hdr, &mut rx.hdr_got, &mut rx.cur) {
                return Ok(Received::Broken(why));
            }
            let staged = &rx.stage[..staged];
            if let Err(why) =
                self.take_staged(staged, &mut rx.next_hdr, &mut rx.hdr_got, &mut rx.cur)
            {
                return Ok(Received::Broken(why));
            }
            if n < asked {
                // A short read drained the socket: wait for the next readiness event instead
                // of asking again only to hear "would block". (The guard clears only the
                // readiness it saw, so a newer event stays.)
                g.clear_ready();
                break;
            }
        }
        Ok(Received::Drained)
    }

    /// Runs the bytes that landed in the stage: the rest of the current frame's arguments (and,
    /// for a WRITE, at most the stage's length of payload, copied and counted), possibly
    /// followed by further frames. Returns why the stream is broken if a header is bad.
    fn take_staged(
        &mut self,
        mut rest: &[u8],
        next_hdr: &mut [u8; HEADER_LEN],
        hdr_got: &mut usize,
        cur: &mut Option<Incoming>,
    ) -> Result<(), String> {
        while !rest.is_empty() {
            if let Some(inc) = cur.as_mut() {
                let (used, copied) = inc.fill_from(rest);
                self.stats.add_copied(copied);
                rest = &rest[used..];
                if inc.is_complete() {
                    let inc = cur.take().expect("current frame");
                    self.dispatch(inc);
                }
            } else {
                let take = (HEADER_LEN - *hdr_got).min(rest.len());
                next_hdr[*hdr_got..*hdr_got + take].copy_from_slice(&rest[..take]);
                *hdr_got += take;
                rest = &rest[take..];
                self.start_frames(next_hdr, hdr_got, cur)?;
            }
        }
        Ok(())
    }

    /// How much to read past a header at a frame boundary (see [`STAGE_MAX`]).
    fn stage_len(&self) -> usize {
        if self.small_run >= QUIET_FRAMES {
            STAGE_MAX
        } else {
            STAGE_LEN
        }
    }

    /// With a whole header in `next_hdr`, starts its frame (running it at once if it has no
    /// arguments or payload); returns why the stream is broken if the header is bad.
    fn start_frames(
        &mut self,
        next_hdr: &[u8; HEADER_LEN],
        hdr_got: &mut usize,
        cur: &mut Option<Incoming>,
    ) -> Result<(), String> {
        if cur.is_some() || *hdr_got < HEADER_LEN {
            return Ok(());
        }
        *hdr_got = 0;
        let hdr = match Header::parse(next_hdr) {
            Ok(h) if h.kind == KIND_REQUEST => h,
            Ok(_) => return Err("a reply frame sent to the server".into()),
            Err(e) => return Err(e.to_string()),
        };
        let size = hdr.args_len.get() as usize + hdr.payload_len.get() as usize;
        if self.who.required() && !self.who.authed && size > crate::limits::MAX_STRANGER_FRAME {
            self.stats
                .refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(format!(
                "a {size}-byte frame before authentication (at most {})",
                crate::limits::MAX_STRANGER_FRAME
            ));
        }
        let inc = Incoming::new(hdr);
        if inc.is_complete() {
            self.dispatch(inc);
        } else {
            *cur = Some(inc);
        }
        Ok(())
    }

    /// Sends an error for a frame that broke the stream's framing, then ends the connection.
    async fn fatal(&mut self, fd: &AsyncFd<OwnedFd>, why: &str) -> io::Result<()> {
        tracing::warn!("malformed frame, closing connection: {why}");
        self.bad_frame();
        self.push(OutReply::new(0, 0, Err(errno::EPROTO)));
        // Best effort: the peer is already misbehaving, so do not wait on it for long.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
        while self.has_output() && tokio::time::Instant::now() < deadline {
            self.flush(fd)?;
            if self.has_output() {
                let _ = tokio::time::timeout_at(deadline, fd.writable()).await;
            }
        }
        Err(io::Error::new(io::ErrorKind::InvalidData, why.to_owned()))
    }

    /// The front reply has left: it no longer counts against the in-flight limit. (The error
    /// reply to a broken frame was never dispatched, hence the saturation.)
    fn reply_sent(&mut self) {
        self.out.pop_front();
        self.inflight = self.inflight.saturating_sub(1);
    }

    fn push(&mut self, r: OutReply) {
        if matches!(r.body, Body::File { .. }) {
            self.small_run = 0;
        }
        self.out_bytes += r.total();
        self.out.push_back(r);
    }

    /// Runs one complete request; its reply is queued now or, for fops that wait, later.
    fn dispatch(&mut self, inc: Incoming) {
        if self.abandoned || self.abandoned_by_client() {
            return;
        }
        self.inflight += 1;
        let id = inc.hdr.request_id.get();
        let opcode = inc.hdr.opcode.get();
        let writes = [Op::Write as u16, Op::WriteMarked as u16];
        self.small_run = if writes.contains(&opcode) {
            0
        } else {
            self.small_run.saturating_add(1)
        };
        let cx = if inc.hdr.traced() {
            let cx = Ctx::traced();
            cx.stamp(|| "brick: frame received".into());
            cx.with_owner(self.conn_id)
        } else {
            Ctx::NONE.with_owner(self.conn_id)
        };
        let Some(op) = Op::from_u16(opcode) else {
            tracing::warn!(opcode, "unknown opcode");
            self.bad_frame();
            return self.push(OutReply::new(opcode, id, Err(errno::ENOSYS)));
        };
        self.stats.count(op);
        // MGMT passes on a management server: its handler decides per command (control::Caller).
        let open = matches!(op, Op::Hello | Op::Auth) || (op == Op::Mgmt && self.mgmt.is_some());
        if self.who.required() && !self.who.authed && !open {
            tracing::warn!(peer = %self.peer, op = op.name(), "request before authentication; closing");
            self.closing = true;
            return self.push(OutReply::new(opcode, id, Err(errno::EACCES)));
        }
        if !matches!(op, Op::Write | Op::WriteMarked) && inc.payload_len != 0 {
            tracing::warn!(op = op.name(), "payload on a fop that takes none");
            self.bad_frame();
            return self.push(OutReply::new(opcode, id, Err(errno::EPROTO)));
        }
        let trace = cx.trace.clone();
        let (mut cx, args) = match prefixed(&inc.hdr, op, cx, &inc.args) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(op = op.name(), "bad credentials or change stamp: {e}");
                self.bad_frame();
                return self.push(OutReply::new(opcode, id, Err(errno::EPROTO)));
            }
        };
        if let Err(e) = self.apply_caps(op, args, &mut cx) {
            return self.push(OutReply::new(opcode, id, Err(e)));
        }
        self.before_change(op, args);
        let changing = self.changes_of(op, args);
        match self.fop(op, args, inc.payload, cx) {
            Ok(Step::Now(args, body)) => self.push_traced(OutReply::traced(
                opcode,
                id,
                Ok((args, body)),
                trace.as_deref(),
            )),
            Ok(Step::Stack(mut fut)) => {
                if let Some(c) = changing {
                    self.changing.insert(id, c);
                }
                // Most fops complete on their first poll (posix is synchronous): queue the
                // reply now, without a task. The rest finish on a task of their own.
                let mut cx = Context::from_waker(std::task::Waker::noop());
                match fut.as_mut().poll(&mut cx) {
                    Poll::Ready(result) => self.finish(Finished {
                        op: opcode,
                        id,
                        result,
                        trace,
                    }),
                    Poll::Pending => {
                        let tx = self.done_tx.clone();
                        tokio::spawn(async move {
                            let result = fut.await;
                            let _ = tx.send(Finished {
                                op: opcode,
                                id,
                                result,
                                trace,
                            });
                        });
                    }
                }
            }
            Err(Fail::Errno(e)) => self.push(OutReply::new(opcode, id, Err(e))),
            Err(Fail::Decode(e)) => {
                tracing::warn!(op = op.name(), "bad arguments: {e}");
                self.bad_frame();
                self.push(OutReply::new(opcode, id, Err(errno::EPROTO)))
            }
        }
    }

    /// True (and the connection closing) when, after a pause of [`RECHECK_AFTER`] since
    /// this connection last ran a frame, its socket says the client reset it: frames that
    /// arrived before the reset and waited here — behind a storage call that hung, or in a
    /// brick that was stopped — belong to a connection the client gave up on. It has marked
    /// what they would change as missed here and may since have written newer bytes through
    /// another connection; running them now would overwrite those with nothing marking it.
    /// Costs one clock read per frame, and a system call only after a pause.
    fn abandoned_by_client(&mut self) -> bool {
        let now = std::time::Instant::now();
        let paused = now.duration_since(self.last_frame) >= RECHECK_AFTER;
        self.last_frame = now;
        let reset = paused
            && self.wire.as_ref().is_some_and(|w| {
                matches!(rustix::net::sockopt::socket_error(w), Ok(Err(_)) | Err(_))
            });
        if reset {
            tracing::warn!(
                peer = %self.peer,
                "the client reset the connection while its requests waited here: dropping them unrun"
            );
            self.abandoned = true;
            self.closing = true;
        }
        reset
    }

    fn bad_frame(&self) {
        self.stats
            .bad_frames
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Queues the reply of a fop that went through the stack.
    fn finish(&mut self, f: Finished) {
        let opened = self.changes_done(f.id);
        let result = f.result.and_then(|done| match done {
            Done::Reply(args, body) => Ok((args, body)),
            Done::Open(fd) => Ok((
                OpenReply {
                    fh: self.new_handle(fd, opened.clone())?,
                }
                .to_wire(),
                Body::None,
            )),
            Done::Create(fd, attr) => Ok((
                CreateReply {
                    fh: self.new_handle(fd, opened.clone())?,
                    attr,
                }
                .to_wire(),
                Body::None,
            )),
        });
        self.push_traced(OutReply::traced(f.op, f.id, result, f.trace.as_deref()));
    }

    /// Queues a reply and, right behind it, its trace frame. The trace frame is not a request
    /// of its own: it does not count against the in-flight limit.
    fn push_traced(&mut self, (reply, frame): (OutReply, Option<OutReply>)) {
        self.push(reply);
        if let Some(f) = frame {
            self.inflight += 1; // `reply_sent` releases one per frame sent
            self.push(f);
        }
    }

    fn handle(&self, fh: u64) -> Result<Fd, Fail> {
        self.handles
            .get(&fh)
            .cloned()
            .ok_or(Fail::Errno(errno::EBADF))
    }

    /// Numbers an opened file for the client, or, past the connection's handle limit, closes
    /// it again and fails the open with `EMFILE`.
    fn new_handle(&mut self, fd: Fd, path: Option<String>) -> Result<u64, Errno> {
        if self.handles.len() >= self.limits.max_handles {
            tracing::warn!(peer = %self.peer, limit = self.limits.max_handles, "an open past the connection's handle limit: EMFILE");
            let stack = self.stack.clone();
            kiln_layer::exec::spawn(async move {
                let _ = stack.release(&Ctx::NONE, fd).await;
            });
            return Err(errno::EMFILE);
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, fd);
        if let Some(p) = path {
            self.handle_paths.insert(fh, p);
        }
        Ok(fh)
    }
}

/// Why a fop produced no result.
enum Fail {
    Errno(Errno),
    Decode(kiln_proto::DecodeError),
}

impl From<Errno> for Fail {
    fn from(e: Errno) -> Fail {
        Fail::Errno(e)
    }
}

impl From<kiln_proto::DecodeError> for Fail {
    fn from(e: kiln_proto::DecodeError) -> Fail {
        Fail::Decode(e)
    }
}
