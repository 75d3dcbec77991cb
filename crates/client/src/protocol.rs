//! The protocol-client layer: the bottom of a client stack, one connection to one brick.
//!
//! Every fop becomes one frame. A read into the caller's memory ([`ReadDst::Into`]) hands those
//! vectors to the connection as the reply's sink, so the payload lands there straight from the
//! socket; a write gathers its frame from the caller's vectors. The memory's owner travels with
//! the request and comes back with the completion, so a dropped future can never free memory
//! the connection is still writing.
//!
//! When the connection fails, the layer reconnects by itself in the background (backing off
//! from 20 ms to 1 s between attempts). Handles opened on an earlier connection are stale on
//! the new one: fops on them fail with `ESTALE`, which tells the layer above (replicate) to
//! reopen the file.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use kiln_layer::{
    errno, fail, Attr, Ctx, Fd, FopResult, Fut, IoBufs, Layer, ReadDst, ReadOut, ReaddirReply,
    Written,
};
use kiln_proto::codec::{Seq, Wire};
use kiln_proto::iov::RawIov;
use kiln_proto::ops::*;
use kiln_proto::Op;

use crate::client::{wire_path, Client, SlotWait};
use crate::conn::{Completion, Done, Slot};

/// A handle on the brick, valid on the connection of generation `gen`.
struct RemoteFd {
    fh: u64,
    gen: u64,
}

/// Stale handle: opened on an earlier connection.
const ESTALE: u32 = 116;

/// The connection now, and how many times it was replaced.
struct Link {
    cur: RwLock<(Arc<Client>, u64)>,
    reconnecting: AtomicBool,
}

/// The protocol-client layer.
pub struct ProtocolClient {
    name: String,
    link: Arc<Link>,
    /// The brick is on this host (see [`is_local_address`]).
    local: bool,
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

impl ProtocolClient {
    /// A protocol-client layer named `name` over a connected client.
    pub fn new(name: &str, client: Arc<Client>) -> ProtocolClient {
        ProtocolClient {
            local: is_local_address(client.server()),
            name: name.into(),
            link: Arc::new(Link {
                cur: RwLock::new((client, 0)),
                reconnecting: AtomicBool::new(false),
            }),
        }
    }

    /// The connection now (it changes when the layer reconnects).
    pub fn client(&self) -> Arc<Client> {
        self.current().0
    }

    fn current(&self) -> (Arc<Client>, u64) {
        let g = self.link.cur.read().unwrap_or_else(|e| e.into_inner());
        (g.0.clone(), g.1)
    }

    /// Starts reconnecting in the background, once.
    fn revive(&self) {
        if self.link.reconnecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Link> = Arc::downgrade(&self.link);
        let name = self.name.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kiln-reconnect-{name}"))
            .spawn(move || {
                let mut wait = Duration::from_millis(20);
                loop {
                    let Some(link) = weak.upgrade() else { return };
                    let old = link.cur.read().unwrap_or_else(|e| e.into_inner()).0.clone();
                    match old.reconnect() {
                        Ok(c) => {
                            let mut g = link.cur.write().unwrap_or_else(|e| e.into_inner());
                            g.1 += 1;
                            g.0 = Arc::new(c);
                            tracing::info!(
                                layer = name,
                                gen = g.1,
                                "reconnected to {}",
                                old.server()
                            );
                            link.reconnecting.store(false, Ordering::Release);
                            return;
                        }
                        Err(e) => tracing::debug!(layer = name, "reconnect failed: {e}"),
                    }
                    drop((link, old));
                    // Back-off of a background retry loop, not synchronisation.
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(Duration::from_secs(1));
                }
            });
        if spawned.is_err() {
            self.link.reconnecting.store(false, Ordering::Release);
        }
    }

    /// Sends one frame and waits for its completion.
    fn send<'a>(
        &'a self,
        cx: &Ctx,
        op: Op,
        args: Vec<u8>,
        payload: &[RawIov],
        sink: Vec<RawIov>,
        keep: Option<Box<dyn std::any::Any + Send>>,
    ) -> impl std::future::Future<Output = FopResult<Completion>> + Send + 'a {
        let slot = Arc::new(Slot::default());
        let (client, _) = self.current();
        // A caller's identity rides in front of the arguments of the fops the brick runs for
        // the caller (root's too: a brick may squash it).
        let cred = cx.cred.as_deref().filter(|_| op.acts_for_caller());
        let args = match cred {
            Some(c) => {
                let mut a = c.to_wire();
                a.extend_from_slice(&args);
                a
            }
            None => args,
        };
        // SAFETY: `payload` and `sink` point into memory owned by `keep` (or promised valid by
        // an `IoBufs::raw` caller until completion); the connection holds `keep` until the
        // completion is delivered.
        let r = unsafe {
            client.conn.submit(
                op,
                cred.is_some(),
                &args,
                payload,
                sink,
                keep,
                Done::Slot(slot.clone()),
                cx.trace.clone(),
            )
        };
        if r.is_err() && client.is_dead() {
            self.revive();
        }
        async move {
            r?;
            Ok(SlotWait(slot).await)
        }
    }

    /// The brick handle of `fd`, if it belongs to the current connection.
    fn fh(&self, fd: &Fd) -> FopResult<u64> {
        let r = fd.get::<RemoteFd>()?;
        if r.gen != self.link.cur.read().unwrap_or_else(|e| e.into_inner()).1 {
            return Err(ESTALE);
        }
        Ok(r.fh)
    }

    fn gen(&self) -> u64 {
        self.link.cur.read().unwrap_or_else(|e| e.into_inner()).1
    }

    fn call<'a, R: Wire + Send + 'a>(&'a self, cx: &'a Ctx, op: Op, req: &impl Wire) -> Fut<'a, R> {
        let f = self.send(cx, op, req.to_wire(), &[], Vec::new(), None);
        Box::pin(async move {
            let c = f.await?;
            let r = c.result?;
            R::from_wire(&r.args).map_err(|e| {
                tracing::warn!(op = op.name(), "bad reply arguments: {e}");
                errno::EPROTO
            })
        })
    }

    /// OPEN or HEAL_OPEN.
    fn open_as<'a>(&'a self, cx: &'a Ctx, op: Op, p: &'a str, flags: u32) -> Fut<'a, Fd> {
        // Read before sending: a reconnect in between makes the handle look stale (safe),
        // never a stale handle look current.
        let gen = self.gen();
        let f = self.call::<OpenReply>(
            cx,
            op,
            &OpenReq {
                path: try_fut!(path(p)),
                flags,
            },
        );
        Box::pin(async move {
            Ok(Fd::new(RemoteFd {
                fh: f.await?.fh,
                gen,
            }))
        })
    }

    fn unit<'a>(&'a self, cx: &'a Ctx, op: Op, req: &impl Wire) -> Fut<'a, ()> {
        let f = self.send(cx, op, req.to_wire(), &[], Vec::new(), None);
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
    (handle, $self:ident, $e:expr) => {
        try_fut!($self.fh($e))
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
                let f = self.call::<$wire>(cx, Op::$op, &req);
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

    fn local(&self) -> bool {
        self.local
    }

    fn up(&self) -> bool {
        let dead = self
            .link
            .cur
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .is_dead();
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
            Ok((Fd::new(RemoteFd { fh: r.fh, gen }), r.attr))
        })
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        let fh = try_fut!(self.fh(fd));
        let len = try_fut!(check_len(dst.len()));
        let args = ReadReq { fh, offset, len }.to_wire();
        match dst {
            ReadDst::Into(bufs) => {
                let (iov, keep) = bufs.into_parts();
                let sink = iov.clone();
                let f = self.send(cx, Op::Read, args, &[], sink, Some(Box::new((iov, keep))));
                Box::pin(async move {
                    let mut c = f.await?;
                    let bufs = take_back(&mut c);
                    let n = c.result?.payload_len;
                    Ok(ReadOut::Into { n, bufs })
                })
            }
            ReadDst::Any(len) => {
                let mut buf = vec![0u8; len as usize];
                let sink = vec![RawIov {
                    base: buf.as_mut_ptr() as usize,
                    len: buf.len(),
                }];
                let f = self.send(cx, Op::Read, args, &[], sink, Some(Box::new(buf)));
                Box::pin(async move {
                    let c = f.await?;
                    let n = c.result?.payload_len;
                    let mut buf = *c
                        .keep
                        .expect("the connection hands back what it kept")
                        .downcast::<Vec<u8>>()
                        .expect("same type");
                    buf.truncate(n);
                    Ok(ReadOut::Buf(buf))
                })
            }
        }
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        let fh = try_fut!(self.fh(fd));
        try_fut!(check_len(data.len()));
        let args = WriteReq { fh, offset }.to_wire();
        let (iov, keep) = data.into_parts();
        let f = self.send(
            cx,
            Op::Write,
            args,
            &iov.clone(),
            Vec::new(),
            Some(Box::new((iov, keep))),
        );
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

    fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        let fh = try_fut!(self.fh(&fd));
        self.unit(cx, Op::Release, &HandleReq { fh })
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
