//! Graph switching: a client stack that moves to a new volume graph while it runs.
//!
//! A volume's graph changes when its bricks do (a brick restarted on another port, bricks added
//! or replaced) or an option the client stack reads does. [`Switch`] is the top layer of a stack
//! built from a kilnd's graph: it holds the current [`Gen`] (one built graph and the version the
//! pool's store gave it) and sends every fop to it. [`Switch::install`] puts a new generation in
//! place without stopping anything:
//!
//! - a fop already sent finishes on the generation it started on;
//! - a path fop sent afterwards goes to the new one;
//! - an open file moves on its next fop: the switch reopens it on the new generation with the
//!   path (renames followed), flags and caller it was opened with, and releases the old handle
//!   once no fop still uses it. A file that cannot be reopened there (unlinked while open, say)
//!   stays on the generation where it was opened, which lives on until its last file closes;
//! - a brick's connection that the new graph names alike (same layer name, address and
//!   timeout) is kept, not reconnected ([`Gen::reusable`]); the others close when the last
//!   generation using them goes.
//!
//! - a fop on an open file that a rebalance moved to another subvolume (`EMOVED`: see
//!   `kiln_layer::layers::marks`) reopens the file where it is now, on the current generation,
//!   and is sent again, with the same memory; while the mover is cutting over (a reopen says
//!   `EMOVED` too) it tries again after a pause that doubles up to 50 ms, for at most
//!   [`MOVE_WAIT`]. The caller never sees the move.
//!
//! [`watch`] polls the kilnd for the volume's graph version and installs each new one.

use std::any::Any;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use kiln_layer::shared::Retry;
use kiln_layer::volfile::Volfile;
use kiln_layer::{
    errno, exec, Ctx, Fd, FopResult, Fut, IoBufs, Layer, LayerRef, ReadDst, ReadOut, Written,
};
use kiln_proto::sync::{MutexExt as _, RwLockExt as _};
use kiln_proto::Cred;

use crate::protocol::ProtocolClient;

/// One built graph.
pub struct Gen {
    /// The graph's version in the pool's store (0: not from a store).
    pub version: u64,
    /// The graph's top layer.
    pub top: LayerRef,
    /// Its protocol-clients.
    pub links: Vec<Arc<ProtocolClient>>,
    /// The address and timeout each of `links` was built for.
    built: Vec<(String, Option<u32>)>,
    /// Connections this generation used that its successor does not: closed when it goes.
    retire: Mutex<Vec<Arc<ProtocolClient>>>,
}

impl Gen {
    /// Where this generation's pushes go, if the volume watches.
    pub fn push_sink(&self) -> Option<crate::conn::PushSink> {
        self.links.iter().find_map(|l| l.push_sink())
    }

    /// A generation of `top`, built with `links`.
    pub fn new(
        version: u64,
        top: LayerRef,
        links: Vec<(Arc<ProtocolClient>, String, Option<u32>)>,
    ) -> Gen {
        let (links, built) = links.into_iter().map(|(l, r, t)| (l, (r, t))).unzip();
        Gen {
            version,
            top,
            links,
            built,
            retire: Mutex::new(Vec::new()),
        }
    }

    /// The connection of protocol-client `name`, when it was built for `remote` and `timeout`
    /// and is not shut down: a new graph keeps it.
    pub fn reusable(
        &self,
        name: &str,
        remote: &str,
        timeout: Option<u32>,
    ) -> Option<Arc<ProtocolClient>> {
        self.links
            .iter()
            .zip(&self.built)
            .find(|(l, (r, t))| l.name() == name && r == remote && *t == timeout && !l.is_shut())
            .map(|(l, _)| l.clone())
    }
}

impl Drop for Gen {
    fn drop(&mut self) {
        for l in self.retire.locked().drain(..) {
            tracing::debug!("{}: not in the volume's graph any more; closing", l.name());
            l.shutdown();
        }
    }
}

/// How long a fop on a moved file waits for its new place to be ready before it fails.
pub const MOVE_WAIT: Duration = Duration::from_secs(30);

/// The switching top layer.
pub struct Switch {
    name: String,
    cur: RwLock<Arc<Gen>>,
    /// Files open through the switch, for renames to follow.
    open: Mutex<Vec<Weak<Opened>>>,
    /// The image leases taken through the switch, by path: (holder, time to live in ms). A
    /// handle reopened on a new generation takes its file's lease there first, so that its
    /// writes are not refused while the old generation's connection holds it.
    leases: Mutex<std::collections::HashMap<String, (String, u32)>>,
    /// Shut down: the watcher stops.
    closed: AtomicBool,
}

/// How a file was opened: what reopening it on a new generation needs.
struct Opened {
    path: Mutex<String>,
    flags: u32,
    heal: bool,
    cred: Option<Arc<Cred>>,
    /// The generation's handle now.
    bound: Mutex<Arc<Held>>,
    /// The last version it could not be reopened on (not tried again there).
    stuck: AtomicU64,
}

/// A handle on one generation; released there when the last fop using it is done.
struct Held {
    gen: Arc<Gen>,
    fd: Option<Fd>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(fd) = self.fd.take() {
            // The generation lives until the release is answered.
            let gen = self.gen.clone();
            exec::spawn(async move {
                let _ = gen.top.release(&Ctx::NONE, fd).await;
            });
        }
    }
}

/// The switch's own handle.
struct SwitchFd(Arc<Opened>);

impl Switch {
    /// A switch named `name` (the graph's top layer name) over `first`.
    pub fn new(name: &str, first: Gen) -> Switch {
        Switch {
            name: name.to_owned(),
            cur: RwLock::new(Arc::new(first)),
            open: Mutex::new(Vec::new()),
            leases: Mutex::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// Takes `path`'s lease, if this switch's user holds one, through `fd` on `gen` (a handle
    /// just reopened there). Best effort: a refusal shows in the writes that follow.
    async fn carry_lease(&self, cx: &Ctx, gen: &Gen, path: &str, fd: &Fd) {
        let lease = self.leases.locked().get(path).cloned();
        if let Some((holder, ttl)) = lease {
            let acquire = kiln_proto::ops::LEASE_ACQUIRE;
            match gen.top.lease(cx, fd, acquire, ttl, &holder).await {
                Ok(s) if s.granted => {}
                Ok(s) => tracing::warn!(path, by = s.holder, "the image lease is held elsewhere"),
                Err(e) => tracing::warn!(path, "cannot carry the image lease over: errno {e}"),
            }
        }
    }

    /// The current generation.
    pub fn current(&self) -> Arc<Gen> {
        self.cur.read_locked().clone()
    }

    /// Makes `next` the current generation; connections of the old one that `next` does not
    /// use close when the old one goes.
    pub fn install(&self, next: Gen) {
        let mut cur = self.cur.write_locked();
        let keep: Vec<*const ProtocolClient> = next.links.iter().map(Arc::as_ptr).collect();
        let gone = cur
            .links
            .iter()
            .filter(|l| !keep.contains(&Arc::as_ptr(l)))
            .cloned();
        cur.retire.locked().extend(gone);
        tracing::info!(
            "volume {}: graph version {} → {}",
            self.name,
            cur.version,
            next.version
        );
        *cur = Arc::new(next);
    }

    /// Every protocol client of every generation still kept.
    pub fn links(&self) -> Vec<Arc<ProtocolClient>> {
        let g = self.current();
        let mut all = g.links.clone();
        all.extend(g.retire.locked().iter().cloned());
        all
    }

    /// Shuts every connection of every generation down for good.
    pub fn shutdown(&self) {
        let g = self.current();
        self.closed.store(true, Relaxed);
        for l in &g.links {
            l.shutdown();
        }
        for l in g.retire.locked().iter() {
            l.shutdown();
        }
    }

    /// A switch handle for `fd`, just opened on `gen`.
    fn wrap(&self, cx: &Ctx, gen: Arc<Gen>, fd: Fd, path: &str, flags: u32, heal: bool) -> Fd {
        let o = Arc::new(Opened {
            path: Mutex::new(path.to_owned()),
            flags: flags & !((libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC) as u32),
            heal,
            cred: cx.cred.clone(),
            bound: Mutex::new(Arc::new(Held { gen, fd: Some(fd) })),
            stuck: AtomicU64::new(0),
        });
        let mut open = self.open.locked();
        if open.len() >= 64 && open.len().is_power_of_two() {
            open.retain(|w| w.strong_count() > 0);
        }
        open.push(Arc::downgrade(&o));
        Fd::new(SwitchFd(o))
    }

    /// The handle to use for `fd` now: on the current generation, reopened there if it was
    /// opened on an older one and can be.
    async fn bind(&self, fd: &Fd) -> FopResult<Arc<Held>> {
        let o = &fd.get::<SwitchFd>()?.0;
        let held = o.bound.locked().clone();
        let cur = self.current();
        if Arc::ptr_eq(&held.gen, &cur)
            || held.gen.version >= cur.version
            || o.heal
            || o.stuck.load(Relaxed) == cur.version
        {
            return Ok(held);
        }
        let path = o.path.locked().clone();
        let cx = Ctx::NONE.with_cred(o.cred.clone());
        match cur.top.open(&cx, &path, o.flags).await {
            Ok(new) => {
                self.carry_lease(&cx, &cur, &path, &new).await;
                let new = Arc::new(Held {
                    gen: cur,
                    fd: Some(new),
                });
                let mut b = o.bound.locked();
                if b.gen.version < new.gen.version {
                    let old = std::mem::replace(&mut *b, new.clone());
                    drop(b);
                    tracing::debug!(path, "handle moved to graph version {}", new.gen.version);
                    // Released on the old generation when its last fop is done.
                    drop(old);
                    Ok(new)
                } else {
                    // Another fop moved it first; ours is released as it drops.
                    Ok(b.clone())
                }
            }
            Err(e) => {
                o.stuck.store(cur.version, Relaxed);
                tracing::debug!(
                    path,
                    "cannot reopen on graph version {} (errno {e}); staying on {}",
                    cur.version,
                    held.gen.version
                );
                Ok(held)
            }
        }
    }

    /// `stale` said its file moved: reopens the file where it is now (see the module
    /// documentation), unless another fop did already.
    async fn relocate(&self, fd: &Fd, stale: &Arc<Held>) -> FopResult<Arc<Held>> {
        let o = &fd.get::<SwitchFd>()?.0;
        if o.heal {
            return Err(errno::EMOVED);
        }
        let deadline = Instant::now() + MOVE_WAIT;
        let mut pause = Duration::from_millis(1);
        loop {
            let now = o.bound.locked().clone();
            if !Arc::ptr_eq(&now, stale) {
                return Ok(now);
            }
            let cur = self.current();
            let path = o.path.locked().clone();
            let cx = Ctx::NONE.with_cred(o.cred.clone());
            match cur.top.open(&cx, &path, o.flags).await {
                Ok(new) => {
                    self.carry_lease(&cx, &cur, &path, &new).await;
                    let new = Arc::new(Held {
                        gen: cur,
                        fd: Some(new),
                    });
                    let mut b = o.bound.locked();
                    if !Arc::ptr_eq(&b, stale) {
                        return Ok(b.clone());
                    }
                    // The old handle is released once no fop uses it.
                    *b = new.clone();
                    tracing::info!(path, "a moved file reopened where it is now");
                    return Ok(new);
                }
                Err(errno::EMOVED) if Instant::now() < deadline => {
                    kiln_layer::timer::sleep_until(Instant::now() + pause).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => {
                    tracing::warn!(path, "a moved file cannot be reopened: errno {e}");
                    return Err(e);
                }
            }
        }
    }

    /// Runs a path fop, again after a pause while it says `EMOVED`: its file is frozen for a
    /// move's cut-over (see the module documentation).
    async fn past_moves<'b, T>(&'b self, f: impl Fn() -> Fut<'b, T>) -> FopResult<T> {
        let deadline = Instant::now() + MOVE_WAIT;
        let mut pause = Duration::from_millis(1);
        loop {
            match f().await {
                Err(errno::EMOVED) if Instant::now() < deadline => {
                    kiln_layer::timer::sleep_until(Instant::now() + pause).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                r => return r,
            }
        }
    }

    /// Renames under `from` now live under `to`, for open files' reopening.
    fn renamed(&self, from: &str, to: &str) {
        for o in self.open.locked().iter().filter_map(Weak::upgrade) {
            let mut p = o.path.locked();
            if *p == from {
                *p = to.to_owned();
            } else if let Some(rest) = p.strip_prefix(from).filter(|r| r.starts_with('/')) {
                *p = format!("{to}{rest}");
            }
        }
    }
}

/// The handle inside `h`.
fn inner(h: &Held) -> &Fd {
    h.fd.as_ref()
        .expect("a bound handle is released only when dropped")
}

/// A fop with an open file as its first argument (`fh` or `fd`): bound to a generation first,
/// and sent again where the file is now if it moved.
macro_rules! switch_fop {
    ($name:ident, $fd:ident, ($($arg:ident : $ty:ty),*), $ret:ty) => {
        fn $name<'a>(&'a self, cx: &'a Ctx, $fd: &'a Fd, $($arg: $ty),*) -> Fut<'a, $ret> {
            Box::pin(async move {
                let mut h = self.bind($fd).await?;
                loop {
                    match h.gen.top.$name(cx, inner(&h), $($arg),*).await {
                        Err(errno::EMOVED) => h = self.relocate($fd, &h).await?,
                        r => return r,
                    }
                }
            })
        }
    };
}

/// A change with memory (`write`, `write_marked`): as [`switch_fop`], the memory shared by
/// the tries.
macro_rules! switch_write {
    ($name:ident, ($($arg:ident : $ty:ty),*)) => {
        fn $name<'a>(
            &'a self,
            cx: &'a Ctx,
            fd: &'a Fd,
            offset: u64,
            data: IoBufs,
            $($arg: $ty),*
        ) -> Fut<'a, Written> {
            Box::pin(async move {
                let mut h = self.bind(fd).await?;
                let mut tries = Retry::new(data);
                loop {
                    let data = tries.take();
                    match h.gen.top.$name(cx, inner(&h), offset, data, $($arg),*).await {
                        Err(errno::EMOVED) => h = self.relocate(fd, &h).await?,
                        Err(e) => return Err(e),
                        Ok(w) => return Ok(Written { n: w.n, bufs: tries.back(w.bufs) }),
                    }
                }
            })
        }
    };
}

impl Switch {
    /// A read, sent again where the file is now if it moved (into the same memory).
    async fn read_moving(
        &self,
        cx: &Ctx,
        fd: &Fd,
        offset: u64,
        dst: ReadDst,
    ) -> FopResult<ReadOut> {
        let mut h = self.bind(fd).await?;
        let (mut tries, any) = match dst {
            ReadDst::Into(b) => (Some(Retry::new(b)), 0),
            ReadDst::Any(n) => (None, n),
        };
        loop {
            let dst = match &mut tries {
                Some(t) => ReadDst::Into(t.take()),
                None => ReadDst::Any(any),
            };
            match h.gen.top.read(cx, inner(&h), offset, dst).await {
                Err(errno::EMOVED) => h = self.relocate(fd, &h).await?,
                Err(e) => return Err(e),
                Ok(ReadOut::Into { n, bufs }) => {
                    let bufs = match tries {
                        Some(t) => t.back(bufs),
                        None => return Err(errno::EIO),
                    };
                    return Ok(ReadOut::Into { n, bufs });
                }
                Ok(out) => return Ok(out),
            }
        }
    }
}

macro_rules! switch_layer {
    (() $( ($name:ident, $op:ident, ($($arg:ident : $ty:ty),*), $ret:ty) )*) => {
        impl Layer for Switch {
            fn name(&self) -> &str {
                &self.name
            }
            fn visit(&self, f: &mut dyn FnMut(&dyn Layer)) {
                let g = self.current();
                f(&*g.top);
                g.top.visit(f);
            }
            fn graph_children(&self) -> Vec<LayerRef> {
                vec![self.current().top.clone()]
            }
            fn up(&self) -> bool {
                self.current().top.up()
            }
            fn local(&self) -> bool {
                self.current().top.local()
            }
            fn joining(&self) -> bool {
                self.current().top.joining()
            }
            fn as_any(&self) -> Option<&dyn Any> {
                Some(self)
            }
            fn hangup(&self, owner: u64) {
                self.current().top.hangup(owner)
            }
            fn goodbye(&self, owner: u64) {
                self.current().top.goodbye(owner)
            }
            fn pin_local<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, std::os::fd::OwnedFd> {
                Box::pin(async move {
                    let h = self.bind(fd).await?;
                    h.gen.top.pin_local(cx, inner(&h)).await
                })
            }
            fn open_small<'a>(
                &'a self,
                cx: &'a Ctx,
                path: &'a str,
                flags: u32,
                max: u32,
            ) -> Fut<'a, kiln_layer::Opened> {
                Box::pin(async move {
                    let (g, o) = self
                        .past_moves(|| {
                            Box::pin(async move {
                                let g = self.current();
                                let o = g.top.open_small(cx, path, flags, max).await?;
                                Ok((g, o))
                            })
                        })
                        .await?;
                    Ok(o.map_fd(|fd| self.wrap(cx, g, fd, path, flags, false)))
                })
            }
            $( switch_one!($name, ($($arg : $ty),*), $ret); )*
        }
    };
}

/// One fop of the switch: written by hand, bound to a generation, or sent to the current one.
macro_rules! switch_one {
    (lease, $($rest:tt)*) => {
        fn lease<'a>(
            &'a self,
            cx: &'a Ctx,
            fd: &'a Fd,
            cmd: u32,
            ttl_ms: u32,
            holder: &'a str,
        ) -> Fut<'a, kiln_layer::LeaseState> {
            Box::pin(async move {
                let mut h = self.bind(fd).await?;
                let s = loop {
                    match h.gen.top.lease(cx, inner(&h), cmd, ttl_ms, holder).await {
                        Err(errno::EMOVED) => h = self.relocate(fd, &h).await?,
                        r => break r?,
                    }
                };
                // Remembered for the handles reopened on later generations.
                let path = fd.get::<SwitchFd>()?.0.path.locked().clone();
                let mut leases = self.leases.locked();
                match cmd {
                    kiln_proto::ops::LEASE_ACQUIRE if s.granted => {
                        leases.insert(path, (holder.to_owned(), ttl_ms));
                    }
                    kiln_proto::ops::LEASE_RELEASE => {
                        leases.remove(&path);
                    }
                    _ => {}
                }
                Ok(s)
            })
        }
    };
    (open, $($rest:tt)*) => {
        fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
            Box::pin(async move {
                let (g, fd) = self
                    .past_moves(|| {
                        Box::pin(async move {
                            let g = self.current();
                            let fd = g.top.open(cx, path, flags).await?;
                            self.carry_lease(cx, &g, path, &fd).await;
                            Ok((g, fd))
                        })
                    })
                    .await?;
                Ok(self.wrap(cx, g, fd, path, flags, false))
            })
        }
    };
    (heal_open, $($rest:tt)*) => {
        fn heal_open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
            Box::pin(async move {
                let g = self.current();
                let fd = g.top.heal_open(cx, path, flags).await?;
                Ok(self.wrap(cx, g, fd, path, flags, true))
            })
        }
    };
    (create, $($rest:tt)*) => {
        fn create<'a>(
            &'a self,
            cx: &'a Ctx,
            path: &'a str,
            flags: u32,
            mode: u32,
        ) -> Fut<'a, (Fd, kiln_layer::Attr)> {
            Box::pin(async move {
                let (g, (fd, a)) = self
                    .past_moves(|| {
                        Box::pin(async move {
                            let g = self.current();
                            let r = g.top.create(cx, path, flags, mode).await?;
                            Ok((g, r))
                        })
                    })
                    .await?;
                Ok((self.wrap(cx, g, fd, path, flags, false), a))
            })
        }
    };
    (release, $($rest:tt)*) => {
        fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
            Box::pin(async move {
                let o = fd.get::<SwitchFd>()?.0.clone();
                drop(fd);
                let held = o.bound.locked().clone();
                drop(o);
                // The last user: release now and say how it went. Otherwise a fop still runs
                // on it, and the handle goes when that is done.
                match Arc::try_unwrap(held) {
                    Ok(mut h) => {
                        let fd = h.fd.take().ok_or(errno::EBADF)?;
                        h.gen.top.release(cx, fd).await
                    }
                    Err(_) => Ok(()),
                }
            })
        }
    };
    (rename, $($rest:tt)*) => {
        fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
            Box::pin(async move {
                let r = self
                    .past_moves(|| {
                        Box::pin(async move {
                            let g = self.current();
                            g.top.rename(cx, from, to, flags).await
                        })
                    })
                    .await;
                if r.is_ok() {
                    self.renamed(from, to);
                }
                r
            })
        }
    };
    (read, $($rest:tt)*) => {
        fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
            Box::pin(self.read_moving(cx, fd, offset, dst))
        }
    };
    (write, $($rest:tt)*) => {
        switch_write!(write, ());
    };
    (write_marked, $($rest:tt)*) => {
        switch_write!(write_marked, (missed: u32));
    };
    ($name:ident, (fh : $t:ty $(, $arg:ident : $ty:ty)*), $ret:ty) => {
        switch_fop!($name, fh, ($($arg : $ty),*), $ret);
    };
    ($name:ident, (fd : $t:ty $(, $arg:ident : $ty:ty)*), $ret:ty) => {
        switch_fop!($name, fd, ($($arg : $ty),*), $ret);
    };
    ($name:ident, ($($arg:ident : $ty:ty),*), $ret:ty) => {
        fn $name<'a>(&'a self, cx: &'a Ctx, $($arg: $ty),*) -> Fut<'a, $ret> {
            Box::pin(self.past_moves(move || {
                Box::pin(async move {
                    let g = self.current();
                    g.top.$name(cx, $($arg),*).await
                })
            }))
        }
    };
}

kiln_layer::for_each_fop!(switch_layer);

/// What [`watch`] needs: where to ask, how often, and how to build a generation from a graph
/// (keeping the connections of the current one that it can).
pub(crate) struct Watch {
    /// The kilnd the volume came from (`tcp:HOST:PORT`).
    pub server: String,
    /// The volume.
    pub volume: String,
    /// Other members of its pool, asked when `server` does not answer.
    pub others: Vec<String>,
    /// The graph the switch runs now.
    pub last: Volfile,
    /// How long between two questions.
    pub every: Duration,
    /// Builds a generation of a graph at a version over the current one.
    pub build: Builder,
}

/// Builds a generation of a graph at a version, keeping what it can of the current one.
pub(crate) type Builder = Box<dyn Fn(&Volfile, u64, &Gen) -> io::Result<Gen> + Send>;

/// How often a client asks for its volume's graph version by default; `KILN_GRAPH_POLL_MS`
/// changes it.
pub const DEFAULT_POLL: Duration = Duration::from_secs(1);

/// The poll interval: `KILN_GRAPH_POLL_MS`, else [`DEFAULT_POLL`].
pub(crate) fn poll_interval() -> Duration {
    std::env::var("KILN_GRAPH_POLL_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map_or(DEFAULT_POLL, Duration::from_millis)
}

/// Asks for the volume's graph every `w.every` and installs each newer version, until the
/// switch is shut down or dropped.
pub(crate) fn watch(switch: &Arc<Switch>, mut w: Watch) -> io::Result<()> {
    let weak = Arc::downgrade(switch);
    let name = format!("kiln-graph-{}", w.volume);
    std::thread::Builder::new().name(name).spawn(move || {
        let mut failing = false;
        let mut seen = switch_version(&weak);
        loop {
            std::thread::sleep(w.every);
            let Some(sw) = weak.upgrade() else { return };
            if sw.closed.load(Relaxed) {
                return;
            }
            let cur = sw.current();
            match fetch_any(&w) {
                Ok(g) => {
                    if failing {
                        tracing::info!("volume {}: its graph answers again", w.volume);
                        failing = false;
                    }
                    if !g.servers.is_empty() {
                        w.others = g.servers;
                    }
                    // A newer definition with the same graph (an option the bricks read, a
                    // state change) needs nothing.
                    if g.version <= seen || g.volfile == w.last {
                        seen = seen.max(g.version);
                        continue;
                    }
                    match (w.build)(&g.volfile, g.version, &cur) {
                        Ok(next) => {
                            sw.install(next);
                            seen = g.version;
                            w.last = g.volfile;
                        }
                        Err(e) => tracing::warn!(
                            "volume {}: cannot build graph version {} ({e}); staying on {}",
                            w.volume,
                            g.version,
                            cur.version
                        ),
                    }
                }
                Err(e) if !failing => {
                    tracing::warn!(
                        "volume {}: cannot ask for its graph ({e}); staying on version {}",
                        w.volume,
                        cur.version
                    );
                    failing = true;
                }
                Err(_) => {}
            }
        }
    })?;
    Ok(())
}

fn switch_version(w: &Weak<Switch>) -> u64 {
    w.upgrade().map_or(0, |s| s.current().version)
}

/// The graph from `w.server`, else from the first other member that answers.
fn fetch_any(w: &Watch) -> io::Result<crate::mgmt::Graph> {
    let mut first = None;
    let all = std::iter::once(&w.server).chain(w.others.iter().filter(|s| **s != w.server));
    for s in all {
        match crate::mgmt::fetch_graph(s, &w.volume) {
            Ok(g) => return Ok(g),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    Err(first.unwrap_or_else(|| io::Error::other("no server to ask")))
}
