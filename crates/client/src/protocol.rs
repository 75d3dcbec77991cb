//! The protocol-client layer: the bottom of a client stack, one connection to one brick.
//!
//! Every fop becomes one frame. A read into the caller's memory ([`ReadDst::Into`]) hands those
//! vectors to the connection as the reply's sink, so the payload lands there straight from the
//! socket; a write gathers its frame from the caller's vectors. The memory's owner travels with
//! the request and comes back with the completion, so a dropped future can never free memory
//! the connection is still writing.
//!
//! When the connection fails, the layer reconnects by itself in the background (backing off
//! from 20 ms to 1 s between attempts, each handshake bounded by
//! [`crate::client::HANDSHAKE_TIMEOUT`]). A fop whose connection was lost — before it was sent
//! or while it waited for its answer — waits for the new connection (up to the layer's
//! patience: 30 s by default, none under replicate, see [`ProtocolClient::with_patience`]),
//! reopens its handle there with the path, flags and caller it was opened with, and is sent
//! again as [`crate::replay`] says is safe; only then, or when the patience runs out
//! (`ENOTCONN`), does the caller see an answer. Heal handles are not reopened (`ESTALE`):
//! their session ended with the connection.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use kiln_layer::timer::Signal;
use kiln_layer::{
    errno, fail, Attr, Ctx, Fd, FopResult, Fut, IoBufs, Layer, Opened, ReadDst, ReadOut,
    ReaddirReply, SpliceOut, Written,
};
use kiln_proto::codec::{Seq, Wire};
use kiln_proto::frame::{FLAG_CRED, FLAG_STAMP};
use kiln_proto::iov::RawIov;
use kiln_proto::ops::*;
use kiln_proto::sync::{MutexExt as _, RwLockExt as _};
use kiln_proto::Op;

use crate::client::{wire_path, Client, SlotWait};
use crate::conn::{Completion, Done, Lost, Refused, ReplyData, Sink, Slot};
use crate::replay::{self, Replay};
use crate::shortcut::{HandleGrant, Shortcut};

mod local;
mod reconnect;
use reconnect::reconnect_loop;

/// How long a fop waits for its brick to come back by default (an NFS hard mount's patience).
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(30);

/// A handle on the brick. After a reconnect it is reopened (same path, flags and caller) on
/// first use — except a heal handle, whose session ended with its connection.
struct RemoteFd {
    path: String,
    flags: u32,
    heal: bool,
    cred: Option<Arc<kiln_proto::Cred>>,
    /// The brick's handle number, and the generation of the connection it belongs to.
    at: Mutex<(u64, u64)>,
    /// Local short-circuit reads ([`crate::shortcut`]).
    direct: HandleGrant,
    /// The inode of the brick file this handle pinned (FUSE passthrough), 0 if none.
    pinned: AtomicU64,
    /// Set (under `at`'s lock) when the handle is released: a pin taken again after a
    /// reconnect is then released at once.
    released: AtomicBool,
}

/// Stale handle: opened on an earlier connection.
const ESTALE: u32 = 116;

/// The connection now, and how many times it was replaced.
struct Link {
    cur: RwLock<(Arc<Client>, u64)>,
    reconnecting: AtomicBool,
    /// Shut down for good: no reconnecting.
    closed: AtomicBool,
    /// Notified after every reconnect attempt, whatever its outcome.
    attempts: Signal,
    /// The last attempt was refused for its key (removed, rotated): fops waiting for a new
    /// connection fail at once instead of waiting out their patience.
    denied: AtomicBool,
    /// A thread asks a new brick, once a second, whether it has become a member.
    watching: AtomicBool,
    /// Handles that pinned their file: pinned again after a reconnect.
    pins: Mutex<Vec<Weak<RemoteFd>>>,
    /// Where the brick's pushes go, if this layer watches: asked for again after a reconnect.
    push: Mutex<Option<crate::conn::PushSink>>,
}

/// The protocol-client layer.
pub struct ProtocolClient {
    name: String,
    link: Arc<Link>,
    /// The brick is on this host (see [`is_local_address`]).
    local: bool,
    /// How long a fop waits for a lost connection to come back before it fails.
    patience: Duration,
    /// Reads straight from the brick's files, when it is on this host.
    shortcut: Arc<Shortcut>,
}

/// One request, kept whole until it is answered so that it can go again on a new connection.
struct Request<'a> {
    op: Op,
    /// Encoded arguments, behind `prefix` bytes of the caller's credentials and the change's
    /// stamp, as `flags` say.
    args: Vec<u8>,
    prefix: usize,
    flags: u32,
    /// The open file a handle fop names (its number leads the arguments).
    fd: Option<&'a RemoteFd>,
    shape: Shape,
    /// A read's other way out (see [`kiln_layer::SpliceOut`]).
    out: Option<Arc<SpliceOut>>,
    /// A read that checks the blocks' sums itself when the brick ships them (`FLAG_SUMS`).
    sums: bool,
}

/// Where a request's payload comes from and its reply's payload goes: both are found again
/// in what the request keeps, so a repeat needs no copy of them.
#[derive(Clone, Copy)]
enum Shape {
    Plain,
    /// A write: the payload is the kept vectors.
    Write,
    /// A read into the kept vectors.
    ReadInto,
    /// A read into a kept `Vec<u8>`.
    ReadAny,
}

type Keep = Option<Box<dyn std::any::Any + Send>>;

/// Where [`ProtocolClient::recover`] starts.
enum Recover {
    Sent(Sent),
    Lost(Completion, u64),
}

/// A request handed to a connection, or refused by it.
enum Sent {
    /// The request's handle belongs to an earlier connection.
    Stale(Keep),
    Waiting(Arc<Slot>, u64),
    Refused(Refused, u64),
}

/// True when `addr` (`unix:PATH`, `tcp:HOST:PORT` or `HOST:PORT`) leads to this host: a Unix
/// socket, or an address this host can bind.
pub fn is_local_address(addr: &str) -> bool {
    if addr.starts_with("unix:") {
        return true;
    }
    let hp = addr.strip_prefix("tcp:").unwrap_or(addr);
    std::net::ToSocketAddrs::to_socket_addrs(hp)
        .into_iter()
        .flatten()
        .any(|sa| is_local_ip(sa.ip()))
}

/// True when this host can bind `ip` (an unspecified address is nobody's).
pub fn is_local_ip(ip: std::net::IpAddr) -> bool {
    !ip.is_unspecified() && std::net::TcpListener::bind((ip, 0)).is_ok()
}

macro_rules! try_fut {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return fail(e),
        }
    };
}

// After `try_fut!`, which it uses.
mod open;
mod read;
mod watch;
pub use read::shipped_checks;

/// The vector a [`Shape::ReadAny`] request kept, holding the `n` payload bytes that landed
/// in it.
fn landed(keep: Keep, n: usize) -> Vec<u8> {
    let mut buf = *keep
        .expect("the connection hands back what it kept")
        .downcast::<Vec<u8>>()
        .expect("same type");
    assert!(n <= buf.capacity(), "more landed than the sink holds");
    // SAFETY: the connection received the reply's payload into the vector's spare capacity
    // from its start (the sink `vectors` gave it), and `n` is what landed there, at most the
    // capacity: the first `n` bytes are initialised.
    unsafe { buf.set_len(n) };
    buf
}

/// The payload and sink vectors of a request of `shape` whose memory `keep` holds.
fn vectors(shape: Shape, keep: &Keep) -> (Vec<RawIov>, Vec<RawIov>) {
    let kept = || keep.as_ref().and_then(|k| k.downcast_ref::<Kept>());
    match shape {
        Shape::Plain => (Vec::new(), Vec::new()),
        Shape::Write => (kept().map(|k| k.0.clone()).unwrap_or_default(), Vec::new()),
        Shape::ReadInto => (Vec::new(), kept().map(|k| k.0.clone()).unwrap_or_default()),
        Shape::ReadAny => {
            // The payload lands in the vector's spare capacity: nothing zeroes it first, and
            // the completion sets the length to what landed (see `landed`).
            let buf = keep.as_ref().and_then(|k| k.downcast_ref::<Vec<u8>>());
            let sink = buf.map(|b| RawIov {
                base: b.as_ptr() as usize,
                len: b.capacity(),
            });
            (Vec::new(), sink.into_iter().collect())
        }
    }
}

impl ProtocolClient {
    /// A protocol-client layer named `name` over a connected client, waiting up to
    /// [`DEFAULT_PATIENCE`] for a lost connection to come back.
    pub fn new(name: &str, client: Arc<Client>) -> ProtocolClient {
        // Grants come only over a Unix socket; the layer reconnects to the same address.
        let unix = client.server().starts_with("unix:");
        ProtocolClient {
            local: is_local_address(client.server()),
            name: name.into(),
            link: Arc::new(Link {
                cur: RwLock::new((client, 0)),
                reconnecting: AtomicBool::new(false),
                closed: AtomicBool::new(false),
                attempts: Signal::default(),
                denied: AtomicBool::new(false),
                watching: AtomicBool::new(false),
                pins: Mutex::new(Vec::new()),
                push: Mutex::new(None),
            }),
            patience: DEFAULT_PATIENCE,
            shortcut: Arc::new(Shortcut::new(unix)),
        }
    }

    /// Turns local short-circuit reads on or off (on by default; they happen only over a Unix
    /// socket, to a brick on this host).
    pub fn set_short_circuit(&self, on: bool) {
        self.shortcut.set(on);
    }

    /// How long a fop waits for a lost connection to come back before failing with
    /// `ENOTCONN`. Zero still lets the reconnect that the loss starts finish once (a brick
    /// that restarted is found at once); a replica's protocol-client uses it, since its
    /// replicate layer goes on with the other replicas.
    pub fn with_patience(mut self, patience: Duration) -> ProtocolClient {
        self.patience = patience;
        self
    }

    /// The connection now (it changes when the layer reconnects).
    pub fn client(&self) -> Arc<Client> {
        self.current().0
    }

    fn current(&self) -> (Arc<Client>, u64) {
        let g = self.link.cur.read_locked();
        (g.0.clone(), g.1)
    }

    fn gen(&self) -> u64 {
        self.link.cur.read_locked().1
    }

    /// Closes the connection for good: requests in flight and later ones fail with
    /// `ENOTCONN` at once, and the layer never reconnects.
    pub fn shutdown(&self) {
        self.link.closed.store(true, Ordering::Release);
        self.client().shutdown();
        self.link.attempts.notify();
    }

    /// True once [`Self::shutdown`] ran.
    pub fn is_shut(&self) -> bool {
        self.link.closed.load(Ordering::Acquire)
    }

    /// Starts reconnecting in the background, once (never after [`Self::shutdown`]).
    fn revive(&self) {
        if self.link.closed.load(Ordering::Acquire)
            || self.link.reconnecting.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let weak: Weak<Link> = Arc::downgrade(&self.link);
        let (name, shortcut) = (self.name.clone(), self.shortcut.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("kiln-reconnect-{name}"))
            .spawn(move || reconnect_loop(weak, name, shortcut));
        if spawned.is_err() {
            self.link.reconnecting.store(false, Ordering::Release);
        }
    }

    /// Starts asking the brick, once a second, whether it is still new (heal makes it a
    /// member when its rebuild ends); stops when it is not, or when the layer is gone.
    fn watch_joining(&self) {
        if self.link.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Link> = Arc::downgrade(&self.link);
        let spawned = std::thread::Builder::new()
            .name(format!("kiln-joining-{}", self.name))
            .spawn(move || loop {
                // A poll interval, not synchronisation: the brick has no way to tell us.
                std::thread::sleep(Duration::from_secs(1));
                let Some(link) = weak.upgrade() else { return };
                if link.closed.load(Ordering::Acquire) {
                    link.watching.store(false, Ordering::Release);
                    return;
                }
                let c = link.cur.read_locked().0.clone();
                if !c.joining() {
                    link.watching.store(false, Ordering::Release);
                    return;
                }
                if c.is_dead() {
                    continue;
                }
                let deadline = Instant::now() + Duration::from_secs(5);
                let _ = crate::block_on(kiln_layer::timer::within(deadline, c.refresh_joining()));
            });
        if spawned.is_err() {
            self.link.watching.store(false, Ordering::Release);
        }
    }

    /// Waits until the connection of generation `gen` has been replaced (true) or `deadline`
    /// passed (false). However close the deadline, the next reconnect attempt is waited for
    /// (up to 2 s), so a brick that is back already is found.
    async fn replaced(&self, gen: u64, deadline: Instant) -> bool {
        let mut first = true;
        loop {
            let seen = self.link.attempts.epoch();
            if self.gen() != gen {
                return true;
            }
            if self.link.closed.load(Ordering::Acquire) {
                return false;
            }
            self.revive();
            // A brick the watchdog found away has had its time already: a reconnect to it
            // would only wait on a silent network.
            let until = if first && self.client().away().is_none() {
                deadline.max(Instant::now() + Duration::from_secs(2))
            } else {
                deadline
            };
            first = false;
            let moved = self.link.attempts.changed(seen, until).await;
            if self.gen() != gen {
                return true;
            }
            if self.link.denied.load(Ordering::Acquire) {
                return false;
            }
            if !moved || Instant::now() >= deadline {
                return false;
            }
        }
    }

    /// Sends a WRITE or WRITE_MARKED (`args` with the handle number left 0) with `data` as
    /// the payload; the reply hands the memory back.
    fn send_write<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        op: Op,
        args: Vec<u8>,
        data: IoBufs,
    ) -> Fut<'a, Written> {
        let rfd = try_fut!(self.remote(fd));
        try_fut!(check_len(data.len()));
        let mut req = self.request(cx, op, args, Some(rfd));
        req.shape = Shape::Write;
        let f = self.send(cx, req, Some(Box::new(data.into_parts())));
        Box::pin(async move {
            let mut c = f.await?;
            let bufs = take_back(&mut c);
            let r = c.result?;
            let n = WriteReply::from_wire(&r.args)
                .map_err(|_| errno::EPROTO)?
                .written as usize;
            Ok(Written { n, bufs })
        })
    }

    fn request<'a>(
        &self,
        cx: &Ctx,
        op: Op,
        args: Vec<u8>,
        fd: Option<&'a RemoteFd>,
    ) -> Request<'a> {
        // A caller's identity rides in front of the arguments of the fops the brick runs for
        // the caller (root's too: a brick may squash it); a replicated change's stamp after it.
        let cred = cx.cred.as_deref().filter(|_| op.acts_for_caller());
        let stamp = cx.change.as_ref().filter(|_| op.changes_bytes());
        if cred.is_none() && stamp.is_none() {
            return Request {
                op,
                args,
                prefix: 0,
                flags: 0,
                fd,
                shape: Shape::Plain,
                out: None,
                sums: false,
            };
        }
        // One buffer: the prefixes encoded into it, the arguments after them.
        let mut e = kiln_proto::codec::Enc {
            buf: Vec::with_capacity(64 + args.len()),
        };
        let mut flags = 0;
        if let Some(c) = cred {
            c.encode(&mut e);
            flags |= FLAG_CRED;
        }
        if let Some(s) = stamp {
            s.encode(&mut e);
            flags |= FLAG_STAMP;
        }
        let prefix = e.buf.len();
        e.buf.extend_from_slice(&args);
        Request {
            op,
            args: e.buf,
            prefix,
            flags,
            fd,
            shape: Shape::Plain,
            out: None,
            sums: false,
        }
    }

    /// Hands `req` to the connection now. A handle fop's number is written into its
    /// arguments here, from the handle of that connection; a handle of an earlier one is
    /// `Stale` (reopen it, then submit again).
    fn submit(&self, cx: &Ctx, req: &mut Request<'_>, keep: Keep) -> Sent {
        let (client, gen) = self.current();
        if let Some(fd) = req.fd {
            let (fh, at) = *fd.at.locked();
            if at != gen {
                return Sent::Stale(keep);
            }
            req.args[req.prefix..req.prefix + 8].copy_from_slice(&fh.to_le_bytes());
        }
        let (payload, sink) = vectors(req.shape, &keep);
        let slot = Arc::new(Slot::default());
        let flags = match req.sums && client.ships_sums() {
            true => req.flags | kiln_proto::frame::FLAG_SUMS,
            false => req.flags,
        };
        // SAFETY: `payload` and `sink` point into memory owned by `keep` (or promised valid by
        // an `IoBufs::raw` caller until completion); the connection holds `keep` until the
        // completion is delivered, and hands it back if it refuses the request.
        let r = unsafe {
            client.conn.submit(
                req.op,
                flags,
                &req.args,
                &payload,
                Sink {
                    iov: sink,
                    out: req.out.clone(),
                },
                keep,
                Done::Slot(slot.clone()),
                cx.trace.clone(),
            )
        };
        match r {
            Ok(_) => Sent::Waiting(slot, gen),
            Err(refused) => {
                if refused.lost() {
                    self.revive();
                }
                Sent::Refused(refused, gen)
            }
        }
    }

    /// The handle number of `fd` on the connection now, reopening it there if it was opened
    /// on an earlier one.
    async fn fh_now(&self, fd: &RemoteFd) -> FopResult<u64> {
        let gen = self.gen();
        {
            let at = fd.at.locked();
            if at.1 == gen {
                return Ok(at.0);
            }
        }
        if fd.heal {
            return Err(ESTALE);
        }
        let cx = Ctx {
            cred: fd.cred.clone(),
            ..Ctx::NONE
        };
        let req = OpenReq {
            path: fd.path.clone(),
            flags: fd.flags,
            peek: 0,
        };
        let r: OpenReply = Box::pin(self.call(&cx, Op::Open, &req)).await?;
        *fd.at.locked() = (r.fh, gen);
        tracing::debug!(layer = self.name, path = fd.path, "handle reopened");
        Ok(r.fh)
    }

    /// Sends one request and waits for its answer. When the connection is lost first, waits
    /// for the next one (up to the layer's patience), reopens the request's handle there and
    /// sends the request again, as [`crate::replay`] says is safe.
    fn send<'a>(
        &'a self,
        cx: &'a Ctx,
        mut req: Request<'a>,
        keep: Keep,
    ) -> impl std::future::Future<Output = FopResult<Completion>> + Send + 'a {
        // Sent before the future is first polled, so that requests made together (a batch)
        // leave together.
        let first = self.submit(cx, &mut req, keep);
        async move {
            // The common case stays small: a reply on the connection it was sent on.
            if let Sent::Waiting(slot, gen) = first {
                let c = SlotWait(slot).await;
                if c.lost.is_none() {
                    return Ok(c);
                }
                return Box::pin(self.recover(cx, req, Recover::Lost(c, gen))).await;
            }
            Box::pin(self.recover(cx, req, Recover::Sent(first))).await
        }
    }

    /// The rare cases of [`Self::send`]: a stale handle, a refused or lost request.
    async fn recover(
        &self,
        cx: &Ctx,
        mut req: Request<'_>,
        from: Recover,
    ) -> FopResult<Completion> {
        let (mut sent, mut lost) = match from {
            Recover::Sent(s) => (Some(s), None),
            Recover::Lost(c, gen) => (None, Some((c, gen))),
        };
        let mut deadline = None;
        let mut doubt = false;
        loop {
            let (c, gen) = match (sent.take(), lost.take()) {
                (_, Some(l)) => l,
                // The brick closed it with the connection it belonged to.
                (Some(Sent::Stale(keep)), _) if req.op == Op::Release => {
                    return Ok(Completion {
                        result: Ok(ReplyData::default()),
                        keep,
                        lost: None,
                    })
                }
                (Some(Sent::Stale(keep)), _) => {
                    let fd = req.fd.expect("only a handle is stale");
                    self.fh_now(fd).await?;
                    sent = Some(self.submit(cx, &mut req, keep));
                    continue;
                }
                (Some(Sent::Waiting(slot, gen)), _) => (SlotWait(slot).await, gen),
                (Some(Sent::Refused(r, _)), _) if !r.lost() => return Err(r.errno),
                (Some(Sent::Refused(r, gen)), _) => {
                    let c = Completion {
                        result: Err(r.errno),
                        keep: r.keep,
                        lost: Some(Lost::Unsent),
                    };
                    (c, gen)
                }
                (None, None) => unreachable!("a request is sent or lost"),
            };
            let Some(how) = c.lost else {
                return Ok(self.answer(cx, &req, c, doubt).await);
            };
            doubt |= how == Lost::InDoubt;
            let rule = replay::of(req.op);
            let dl = *deadline.get_or_insert_with(|| Instant::now() + self.patience);
            if rule == Replay::Never || !self.replaced(gen, dl).await {
                return Ok(Completion {
                    result: Err(errno::ENOTCONN),
                    lost: None,
                    ..c
                });
            }
            if let Some(fd) = req.fd {
                if let Err(e) = self.fh_now(fd).await {
                    return Ok(Completion {
                        result: Err(e),
                        lost: None,
                        ..c
                    });
                }
            }
            if doubt && rule == Replay::Create {
                if let Some(a) = replay::create_again(&req.args[req.prefix..]) {
                    req.args.truncate(req.prefix);
                    req.args.extend_from_slice(&a);
                }
            }
            tracing::debug!(layer = self.name, op = req.op.name(), "sending again");
            sent = Some(self.submit(cx, &mut req, c.keep));
        }
    }

    /// A repeated request's answer: "already done" turned into the success it stands for.
    async fn answer(&self, cx: &Ctx, req: &Request<'_>, c: Completion, doubt: bool) -> Completion {
        let Err(e) = c.result else { return c };
        let done = |args: Vec<u8>| Completion {
            result: Ok(ReplyData {
                args,
                ..Default::default()
            }),
            keep: None,
            lost: None,
        };
        match replay::of(req.op) {
            Replay::DoneIf(already) if doubt && e == already => done(Vec::new()),
            Replay::Made if doubt && e == libc::EEXIST as u32 => {
                let Some(p) = replay::made_path(req.op, &req.args[req.prefix..]) else {
                    return c;
                };
                let look: FopResult<Attr> =
                    Box::pin(self.call(cx, Op::Lookup, &PathReq { path: p })).await;
                match look {
                    Ok(a) => done(a.to_wire()),
                    Err(_) => c,
                }
            }
            _ => c,
        }
    }

    /// The open handle of `fd`, or `EBADF` for another layer's.
    fn remote<'f>(&self, fd: &'f Fd) -> FopResult<&'f RemoteFd> {
        fd.get::<Arc<RemoteFd>>().map(|r| &**r)
    }

    fn call<'a, R: Wire + Send + 'a>(&'a self, cx: &'a Ctx, op: Op, req: &impl Wire) -> Fut<'a, R> {
        self.call_on(cx, op, req.to_wire(), None)
    }

    fn call_on<'a, R: Wire + Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        op: Op,
        args: Vec<u8>,
        fd: Option<&'a RemoteFd>,
    ) -> Fut<'a, R> {
        let f = self.send(cx, self.request(cx, op, args, fd), None);
        Box::pin(async move {
            let c = f.await?;
            let r = c.result?;
            R::from_wire(&r.args).map_err(|e| {
                tracing::warn!(op = op.name(), "bad reply arguments: {e}");
                errno::EPROTO
            })
        })
    }

    fn unit<'a>(&'a self, cx: &'a Ctx, op: Op, req: &impl Wire) -> Fut<'a, ()> {
        let f = self.send(cx, self.request(cx, op, req.to_wire(), None), None);
        Box::pin(async move { f.await?.result.map(|_| ()) })
    }
}

/// What a read or write kept with its request: the caller's vectors and their owner.
type Kept = (Vec<RawIov>, Option<Box<dyn std::any::Any + Send>>);

/// Rebuilds the caller's memory from a completed request's `keep`.
fn take_back(c: &mut Completion) -> IoBufs {
    let (iov, keep) = *c
        .keep
        .take()
        .expect("the connection hands back what it kept")
        .downcast::<Kept>()
        .expect("reads and writes keep a `Kept`");
    // SAFETY: the vectors point into `keep` (or raw memory its caller still promises valid);
    // the connection is done with them.
    unsafe { IoBufs::from_parts(iov, keep) }
}

/// Checks a data length against the frame limit.
fn check_len(n: usize) -> FopResult<u32> {
    if n > kiln_proto::MAX_PAYLOAD_LEN as usize {
        Err(errno::EINVAL)
    } else {
        Ok(n as u32)
    }
}

/// `p` as the wire carries it; ENAMETOOLONG past what a brick accepts (deep trees reached
/// through relative paths can be longer than any one system call's path).
fn path(p: &str) -> FopResult<String> {
    let w = wire_path(p);
    if w.len() > kiln_proto::codec::MAX_PATH_LEN {
        return Err(errno::ENAMETOOLONG);
    }
    Ok(w)
}

/// A path fop's argument as its request field.
macro_rules! wire_arg {
    (path, $self:ident, $e:expr) => {
        try_fut!(path($e))
    };
    (text, $self:ident, $e:expr) => {
        $e.to_owned()
    };
    (val, $self:ident, $e:expr) => {
        $e
    };
    (refd, $self:ident, $e:expr) => {
        $e.clone()
    };
    // Written by `submit`, from the handle of the connection the request goes on.
    (handle, $self:ident, $e:expr) => {
        0
    };
}

/// The open handle among a path fop's arguments, if one is.
macro_rules! handle_of {
    (handle, $self:ident, $e:expr) => {
        Some(try_fut!($self.remote($e)))
    };
    ($kind:ident, $self:ident, $e:expr) => {
        None
    };
}

/// The path fops ([`kiln_layer::for_each_path_fop`]): one request struct out, one value back.
macro_rules! path_methods {
    (() $( ($name:ident, $op:ident, $req:path { $( $f:ident : $ty:ty => $kind:ident ),* },
            $ret:ty, $wire:ty, $to_ret:tt, $to_wire:tt) )*) => {
        $(
            fn $name<'a>(&'a self, cx: &'a Ctx, $( $f: $ty ),*) -> Fut<'a, $ret> {
                // A struct literal needs a type name, not a path fragment.
                type Req = $req;
                let req = Req { $( $f: wire_arg!($kind, self, $f) ),* };
                let fd: Option<&RemoteFd> = None $( .or(handle_of!($kind, self, $f)) )*;
                let f = self.call_on::<$wire>(cx, Op::$op, req.to_wire(), fd);
                Box::pin(async move { f.await.map($to_ret) })
            }
        )*
    };
}

/// The control fops ([`kiln_layer::for_each_control_fop`]): `(path, argument)` out, one value
/// back.
macro_rules! control_methods {
    (() $( ($name:ident, $op:ident, $arg:ty, $ret:ty) )*) => {
        $(
            fn $name<'a>(&'a self, cx: &'a Ctx, p: &'a str, arg: &'a $arg) -> Fut<'a, $ret> {
                self.call::<$ret>(cx, Op::$op, &(try_fut!(path(p)), arg.clone()))
            }
        )*
    };
}

impl Layer for ProtocolClient {
    fn name(&self) -> &str {
        &self.name
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn pin_local<'a>(&'a self, _: &'a Ctx, fd: &'a Fd) -> Fut<'a, std::os::fd::OwnedFd> {
        let rfd = try_fut!(fd.get::<Arc<RemoteFd>>());
        Box::pin(self.pin_file(rfd))
    }

    fn local(&self) -> bool {
        self.local
    }

    fn joining(&self) -> bool {
        // Asked for every replica on every replicated fop: no Arc clone on the way.
        let joining = self.link.cur.read_locked().0.joining();
        if !joining {
            return false;
        }
        self.watch_joining();
        true
    }

    fn up(&self) -> bool {
        let dead = self.link.cur.read_locked().0.is_dead();
        if dead {
            self.revive();
        }
        !dead
    }

    fn open<'a>(&'a self, cx: &'a Ctx, p: &'a str, flags: u32) -> Fut<'a, Fd> {
        self.open_as(cx, Op::Open, p, flags)
    }

    fn heal_open<'a>(&'a self, cx: &'a Ctx, p: &'a str, flags: u32) -> Fut<'a, Fd> {
        self.open_as(cx, Op::HealOpen, p, flags)
    }

    fn open_small<'a>(&'a self, cx: &'a Ctx, p: &'a str, flags: u32, max: u32) -> Fut<'a, Opened> {
        self.open_whole(cx, p, flags, max)
    }

    kiln_layer::for_each_control_fop!(control_methods);
    kiln_layer::for_each_path_fop!(path_methods);

    fn create<'a>(&'a self, cx: &'a Ctx, p: &'a str, flags: u32, mode: u32) -> Fut<'a, (Fd, Attr)> {
        let req = CreateReq {
            path: try_fut!(path(p)),
            flags,
            mode,
        };
        let gen = self.gen();
        let f = self.call::<CreateReply>(cx, Op::Create, &req);
        Box::pin(async move {
            let r = f.await?;
            let fd = self.handle(cx, Op::Create, &req.path, flags, r.fh, gen);
            Ok((fd, r.attr))
        })
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        let rfd = try_fut!(self.remote(fd));
        if self.local && !rfd.heal && self.shortcut.is_on() {
            return Box::pin(self.read_local(cx, rfd, offset, dst));
        }
        self.read_brick(cx, rfd, offset, dst)
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        let args = WriteReq { fh: 0, offset }.to_wire();
        self.send_write(cx, fd, Op::Write, args, data)
    }

    fn write_marked<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        offset: u64,
        data: IoBufs,
        missed: u32,
    ) -> Fut<'a, Written> {
        let args = WriteMarkedReq {
            fh: 0,
            offset,
            missed,
        }
        .to_wire();
        self.send_write(cx, fd, Op::WriteMarked, args, data)
    }

    fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        Box::pin(async move {
            let rfd = self.remote(&fd)?;
            if rfd.direct.used() {
                self.report_now().await;
            }
            {
                let _at = rfd.at.locked();
                rfd.released.store(true, Ordering::Relaxed);
            }
            let args = HandleReq { fh: 0 }.to_wire();
            let req = self.request(cx, Op::Release, args, Some(rfd));
            self.send(cx, req, None).await?.result.map(|_| ())
        })
    }

    fn readdir<'a>(
        &'a self,
        cx: &'a Ctx,
        p: &'a str,
        offset: u64,
        max: u32,
    ) -> Fut<'a, ReaddirReply> {
        let req = ReaddirReq {
            path: try_fut!(path(p)),
            offset,
            max,
        };
        self.call(cx, Op::Readdir, &req)
    }

    fn setxattr<'a>(
        &'a self,
        cx: &'a Ctx,
        p: &'a str,
        name: &'a str,
        value: &'a [u8],
        flags: u32,
    ) -> Fut<'a, ()> {
        let req = SetxattrReq {
            path: try_fut!(path(p)),
            name: name.into(),
            value: value.to_vec(),
            flags,
        };
        self.unit(cx, Op::Setxattr, &req)
    }

    fn listxattr<'a>(&'a self, cx: &'a Ctx, p: &'a str) -> Fut<'a, Vec<String>> {
        let f = self.call::<XattrNames>(
            cx,
            Op::Listxattr,
            &PathReq {
                path: try_fut!(path(p)),
            },
        );
        Box::pin(async move {
            let Seq(names) = f.await?.names;
            Ok(names)
        })
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, p: &'a str, name: &'a str) -> Fut<'a, ()> {
        let req = XattrReq {
            path: try_fut!(path(p)),
            name: name.into(),
        };
        self.unit(cx, Op::Removexattr, &req)
    }
}
