//! A volume as a client sees it: the client stack, built from a volume graph, and the API that
//! applications call on its top layer.
//!
//! The default stack is `io-stats` (named `client`) over one `protocol-client`. Requests can be
//! sampled for waterfalls: every Nth carries a trace, and its timeline goes to the process's
//! [`TraceLog`](kiln_layer::trace::TraceLog) when it completes.
//!
//! Completions of the callback API run on the thread that finished the request — for a remote
//! read, the connection's receive thread right after the payload landed (see
//! [`kiln_layer::exec`]).

use std::io::{self, IoSlice};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// The layer crate the stack is built from (for front-ends that need its types: `IoBufs`,
/// `exec`, `metrics`).
pub use kiln_layer as layer;
pub use kiln_layer::volfile::{LayerKind, ProtocolClientConfig, Volfile};
use kiln_layer::{
    exec, Attr, Ctx, Errno, Fd, IoBufs, LayerRef, Opened, RawIov, ReadDst, ReadOut, SetAttrs,
    StatfsReply,
};
use kiln_proto::codec::Wire;
use kiln_proto::ops::{Changes, DirEntry, Extent, ExtentList, LeaseState};
use kiln_proto::{Cred, Error};

mod raw;
mod trees;

pub use trees::{is_snapshot_name, TreeReport};

use crate::client::{errno_error, Client};
use crate::graph::{Gen, Switch};
use crate::protocol::ProtocolClient;

/// How long [`Volume::end`] waits for the bricks to answer its goodbye.
pub const BYE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

/// A client stack, used on behalf of one caller: the process itself (root on the bricks) or,
/// from [`Volume::on_behalf_of`], a user whose credentials travel with every name and
/// metadata fop, so the bricks check access and assign ownership as that user. Clones share
/// the stack.
#[derive(Clone)]
pub struct Volume {
    stack: Arc<Stack>,
    cred: Option<Arc<Cred>>,
}

/// What a brick pushed ([`Volume::watch`]).
pub enum Pushed<'a> {
    /// Changes other clients made (`all`: anything may have changed).
    Changes(&'a Changes),
    /// The brick's pushes stopped (its connection failed, or it would not push again): until
    /// a later [`Pushed::Changes`] with `all`, changes may go unpushed.
    Lost,
}

/// What every view of a volume shares.
struct Stack {
    top: LayerRef,
    graph: Graph,
    trace_every: AtomicU64,
    seq: AtomicU64,
}

/// The graph under a stack: built once, or followed across versions by a [`Switch`] on top.
enum Graph {
    Fixed(Arc<Gen>),
    Switched(Arc<Switch>),
}

impl Stack {
    fn new(graph: Graph) -> Stack {
        let top = match &graph {
            Graph::Fixed(g) => g.top.clone(),
            Graph::Switched(s) => s.clone() as LayerRef,
        };
        Stack {
            top,
            graph,
            trace_every: AtomicU64::new(0),
            seq: AtomicU64::new(0),
        }
    }

    /// The generation in use now.
    fn gen(&self) -> Arc<Gen> {
        match &self.graph {
            Graph::Fixed(g) => g.clone(),
            Graph::Switched(s) => s.current(),
        }
    }
}

/// Label stamped when a request enters the volume API.
pub const SUBMIT: &str = "submit";
/// Label stamped when its completion is delivered.
pub const COMPLETE: &str = "completion";

/// Where a front-end (a mount, an NBD export, libkiln) gets its volume from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A volfile on disk: the whole client stack, protocol-clients included.
    Volfile(PathBuf),
    /// A server address (`HOST`, `HOST:PORT`, `tcp:HOST:PORT`, `unix:PATH`) and a volume name:
    /// a kilnd that keeps volume definitions (its management port, by default
    /// [`crate::mgmt::DEFAULT_MGMT_PORT`]) hands out the volume's volfile; a plain brick (which
    /// does not manage volumes, or is reached over a Unix socket) is used with the default
    /// stack ([`Volume::connect`]).
    Server {
        /// The server's address.
        server: String,
        /// The volume's name.
        volume: String,
    },
}

impl Source {
    /// Parses `SERVER:/VOL` (split at the last `:/`, so a socket path may contain one).
    pub fn parse(spec: &str) -> Result<Source, Error> {
        match spec.rfind(":/") {
            Some(i) if i > 0 && spec.len() > i + 2 => Ok(Source::Server {
                server: spec[..i].to_owned(),
                volume: spec[i + 2..].trim_matches('/').to_owned(),
            }),
            _ => Err(Error::invalid(format!(
                "bad volume {spec:?}: want SERVER:/VOL, e.g. 127.0.0.1:24100:/vol"
            ))),
        }
    }

    /// A volfile path, or else `SERVER:/VOL`.
    pub fn new(spec: &str, volfile: Option<&Path>) -> Result<Source, Error> {
        match volfile {
            Some(p) => Ok(Source::Volfile(p.to_owned())),
            None => Source::parse(spec),
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Volfile(p) => write!(f, "volfile {}", p.display()),
            Source::Server { server, volume } => write!(f, "{server}:/{volume}"),
        }
    }
}

impl Volume {
    /// The default client stack for the brick at `addr`.
    pub fn default_volfile(addr: &str) -> Volfile {
        Volfile::linear(vec![
            ("client".into(), LayerKind::IoStats {}),
            (
                "brick".into(),
                LayerKind::ProtocolClient(ProtocolClientConfig::to(addr)),
            ),
        ])
    }

    /// Connects the default stack to the brick at `addr` (see [`Client::connect`] for address
    /// forms and the secret).
    pub fn connect(addr: &str) -> io::Result<Volume> {
        Volume::from_volfile(&Volume::default_volfile(addr))
    }

    /// Builds a client stack, connecting every protocol-client (with the secret from
    /// `KILN_SECRET_FILE`, if set). A protocol-client's `remote` may list alternatives,
    /// comma-separated, tried in order: a volume's graph offers a brick's Unix socket before
    /// its TCP address, and the socket is used only when that TCP address is on this host.
    pub fn from_volfile(v: &Volfile) -> io::Result<Volume> {
        Volume::from_volfile_with_secret(v, None)
    }

    /// Builds a client stack whose bricks want `secret` (`None`: as [`Client::connect`]).
    ///
    /// A brick that cannot be reached when the stack is built does not stop it while another
    /// brick can be: its protocol-client starts down (what replicate and heal see as a replica
    /// that is away) and reconnects in the background. When no brick can be reached, the
    /// first brick's error is returned.
    pub fn from_volfile_with_secret(v: &Volfile, secret: Option<&[u8]>) -> io::Result<Volume> {
        let gen = build(v, secret, 0, None)?;
        Ok(Volume::of(Graph::Fixed(Arc::new(gen))))
    }

    /// [`Volume::from_volfile`] under the graph switch that a stack following a managed
    /// volume's graph has on top (see [`crate::graph`]), never given another graph: what
    /// following costs the data path, for `kiln bench --switch`.
    pub fn from_volfile_switched(v: &Volfile) -> io::Result<Volume> {
        let first = build(v, None, 1, None)?;
        let top = v.layers.first().map_or("volume", |l| l.name.as_str());
        Ok(Volume::of(Graph::Switched(Arc::new(Switch::new(
            top, first,
        )))))
    }

    fn of(graph: Graph) -> Volume {
        Volume {
            stack: Arc::new(Stack::new(graph)),
            cred: None,
        }
    }

    /// The version of the graph the stack runs now (0: a graph from a file or a brick, which
    /// never changes).
    pub fn graph_version(&self) -> u64 {
        self.stack.gen().version
    }

    /// The top layer, for fops this type has no wrapper for.
    pub fn top(&self) -> &LayerRef {
        &self.stack.top
    }

    /// The connections of the stack's protocol-clients, as they are now.
    pub fn clients(&self) -> Vec<Arc<Client>> {
        self.stack.gen().links.iter().map(|l| l.client()).collect()
    }

    /// Samples every `n`th request for a waterfall (0: none).
    pub fn set_trace_every(&self, n: u64) {
        self.stack.trace_every.store(n, Relaxed);
    }

    /// The same stack used on behalf of `cred` (None: the process itself). Cheap: one
    /// reference count.
    pub fn on_behalf_of(&self, cred: Option<Arc<Cred>>) -> Volume {
        Volume {
            stack: self.stack.clone(),
            cred,
        }
    }

    /// A context for the next request: this view's caller, traced when sampled.
    pub fn ctx(&self) -> Ctx {
        let every = self.stack.trace_every.load(Relaxed);
        if every == 0 || !self.stack.seq.fetch_add(1, Relaxed).is_multiple_of(every) {
            return Ctx::NONE.with_cred(self.cred.clone());
        }
        let cx = Ctx::traced().with_cred(self.cred.clone());
        cx.stamp(|| SUBMIT.into());
        cx
    }

    /// Stamps a traced request's completion and logs its timeline.
    fn finish(cx: &Ctx) {
        if let Some(t) = &cx.trace {
            t.stamp(COMPLETE);
            t.part_done();
        }
    }

    /// Runs `f`, holding back frames submitted meanwhile so they leave together.
    pub fn batch<R>(&self, f: impl FnOnce() -> R) -> R {
        // Over the protocol-clients themselves: no list of connections built per batch.
        fn nest<R>(ls: &[Arc<ProtocolClient>], f: Box<dyn FnOnce() -> R + '_>) -> R {
            match ls.split_first() {
                None => f(),
                Some((l, rest)) => l.client().batch(|| nest(rest, f)),
            }
        }
        nest(&self.stack.gen().links, Box::new(f))
    }

    /// Attributes of `path`.
    pub async fn lookup(&self, path: &str) -> io::Result<Attr> {
        let cx = self.ctx();
        let r = self.stack.top.lookup(&cx, path).await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Opens an existing file.
    pub async fn open(&self, path: &str, flags: i32) -> io::Result<Fd> {
        let cx = self.ctx();
        let r = self.stack.top.open(&cx, path, flags as u32).await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Has every brick push the changes other clients make to `sink` (called on a receiving
    /// thread: it must not block), for as long as the volume lives, across reconnects (a lost
    /// connection is [`Pushed::Lost`]; after a reconnect `sink` is told everything may have
    /// changed) and graph changes. Fails with the
    /// first brick's error, if any could not be asked (it is asked again when it comes back).
    pub async fn watch(&self, sink: Arc<dyn Fn(Pushed<'_>) + Send + Sync>) -> io::Result<()> {
        let raw: crate::conn::PushSink = Arc::new(move |args: &[u8]| {
            if args.is_empty() {
                return sink(Pushed::Lost);
            }
            match Changes::from_wire(args) {
                Ok(c) => sink(Pushed::Changes(&c)),
                Err(e) => {
                    tracing::warn!("malformed push from a brick ({e}): dropping every cache");
                    sink(Pushed::Changes(&Changes {
                        all: true,
                        changes: kiln_proto::codec::Seq(Vec::new()),
                    }))
                }
            }
        });
        let mut first = None;
        for l in &self.stack.gen().links {
            if let Err(e) = l.watch(raw.clone()).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Opens an existing file; a read-only open of a file of at most `max` bytes may give
    /// its whole content instead, in the same round trip, with nothing to close (see
    /// [`Opened`]).
    pub async fn open_small(&self, path: &str, flags: i32, max: u32) -> io::Result<Opened> {
        let cx = self.ctx();
        let r = self
            .stack
            .top
            .open_small(&cx, path, flags as u32, max)
            .await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Creates (or opens) a file.
    pub async fn create(&self, path: &str, flags: i32, mode: u32) -> io::Result<(Fd, Attr)> {
        let cx = self.ctx();
        let r = self.stack.top.create(&cx, path, flags as u32, mode).await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Closes a file.
    pub async fn close(&self, fd: Fd) -> io::Result<()> {
        self.stack
            .top
            .release(&Ctx::NONE, fd)
            .await
            .map_err(errno_error)
    }

    /// A read-only descriptor of the brick file under `fd`, pinned on its brick while `fd` is
    /// open, where reading it directly is as good as reading through the stack (see
    /// [`kiln_layer::Layer::pin_local`]; FUSE passthrough).
    pub async fn pin_local(&self, fd: &Fd) -> io::Result<std::os::fd::OwnedFd> {
        self.stack
            .top
            .pin_local(&Ctx::NONE, fd)
            .await
            .map_err(errno_error)
    }

    /// Flushes a file to stable storage on every brick that holds it.
    pub async fn fsync(&self, fd: &Fd, datasync: bool) -> io::Result<()> {
        let cx = self.ctx();
        let r = self.stack.top.fsync(&cx, fd, datasync).await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Reads at `offset` into `bufs`, in order, straight from the socket. Returns the bytes
    /// read (fewer only at end of file) and the buffers (empty after an error). Dropping the
    /// future early is safe: the buffers are freed once the data has stopped moving.
    pub async fn preadv<B>(&self, fd: &Fd, bufs: Vec<B>, offset: u64) -> (io::Result<usize>, Vec<B>)
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        let cx = self.ctx();
        let r = self
            .stack
            .top
            .read(&cx, fd, offset, ReadDst::Into(IoBufs::owned(bufs)))
            .await;
        Volume::finish(&cx);
        match r {
            Ok(ReadOut::Into { n, bufs }) => (Ok(n), bufs.into_owned().unwrap_or_default()),
            Ok(_) => (Err(errno_error(kiln_layer::errno::EIO)), Vec::new()),
            Err(e) => (Err(errno_error(e)), Vec::new()),
        }
    }

    /// Writes `bufs`, in order, at `offset`, sent straight from them. Returns the bytes
    /// written and the buffers (empty after an error).
    pub async fn pwritev<B>(
        &self,
        fd: &Fd,
        bufs: Vec<B>,
        offset: u64,
    ) -> (io::Result<usize>, Vec<B>)
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        let cx = self.ctx();
        let r = self
            .stack
            .top
            .write(&cx, fd, offset, IoBufs::owned(bufs))
            .await;
        Volume::finish(&cx);
        match r {
            Ok(w) => (Ok(w.n), w.bufs.into_owned().unwrap_or_default()),
            Err(e) => (Err(errno_error(e)), Vec::new()),
        }
    }
}

/// Runs one fop on the top layer with a (possibly sampled) context: `$cx => call`.
macro_rules! fop {
    ($self:ident, $cx:ident => $call:expr) => {{
        let $cx = $self.ctx();
        let r = $call.await;
        Volume::finish(&$cx);
        r.map_err(errno_error)
    }};
}

/// What the front-ends (FUSE, NBD, libkiln) need beyond the data path.
impl Volume {
    /// Builds the stack `src` names: the volfile's, or the server's for the volume (the
    /// default stack for a brick that keeps no volume definitions).
    pub fn from_source(src: &Source) -> io::Result<Volume> {
        match src {
            Source::Volfile(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
                let v = Volfile::parse(&text).map_err(|e| {
                    io::Error::new(io::ErrorKind::InvalidInput, format!("{}: {e}", p.display()))
                })?;
                Volume::from_volfile(&v)
            }
            Source::Server { server, volume } => Volume::from_server(server, volume),
        }
    }

    /// The volume `volume` as the kilnd at `server` describes it, or the brick at `server`.
    fn from_server(server: &str, volume: &str) -> io::Result<Volume> {
        if server.starts_with("unix:") {
            // Management is TCP only: a Unix socket is a brick's.
            return Volume::connect(server);
        }
        let hostport = server.strip_prefix("tcp:").unwrap_or(server);
        let has_port = hostport
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        let mgmt_addr = if has_port {
            format!("tcp:{hostport}")
        } else {
            crate::mgmt::parse_volume_spec(&format!("{hostport}:/{volume}"))?.0
        };
        let fetched = crate::mgmt::fetch_graph(&mgmt_addr, volume);
        match fetched {
            Ok(g) => Volume::following(mgmt_addr, volume, g),
            // A brick does not manage volumes (ENOSYS), or wants its secret before anything
            // but HELLO (EACCES): use it as a brick. Any other answer is the server's word.
            Err(e)
                if has_port
                    && matches!(
                        e.kind(),
                        io::ErrorKind::Unsupported | io::ErrorKind::PermissionDenied
                    ) =>
            {
                tracing::debug!("{server} gave no volfile ({e}); using it as a brick");
                Volume::connect(server)
            }
            Err(e) => Err(e),
        }
    }

    /// A stack over graph `g` of `volume` from the kilnd at `server`, which moves to each new
    /// version of the graph the pool's members hand out (see [`crate::graph`]).
    fn following(server: String, volume: &str, g: crate::mgmt::Graph) -> io::Result<Volume> {
        let secret = match crate::mgmt::secret_file(volume, None) {
            Some(p) => Some(crate::mgmt::read_secret(&p)?),
            None => None,
        };
        tracing::info!("volume {volume}: graph version {} from {server}", g.version);
        let first = build(&g.volfile, secret.as_deref(), g.version, None)?;
        let switch = Arc::new(Switch::new(volume, first));
        crate::graph::watch(
            &switch,
            crate::graph::Watch {
                server,
                volume: volume.to_owned(),
                others: g.servers,
                last: g.volfile,
                every: crate::graph::poll_interval(),
                build: Box::new(move |v, version, cur| {
                    build(v, secret.as_deref(), version, Some(cur))
                }),
            },
        )?;
        Ok(Volume::of(Graph::Switched(switch)))
    }

    /// Ends the volume cleanly: with no request in flight on any brick, tells every brick this
    /// client is done ([`kiln_proto::Op::Bye`]: nothing it changed is in doubt, so its
    /// connections leave no suspect marks for heal), waiting at most [`BYE_PATIENCE`] for
    /// them; then [`Self::shutdown`]. With anything in flight it only shuts down: what the
    /// connections changed lately stays suspect, as for a client that died.
    pub fn end(&self) {
        let links = match &self.stack.graph {
            Graph::Fixed(g) => g.links.clone(),
            Graph::Switched(s) => s.links(),
        };
        let clients: Vec<_> = links.iter().map(|l| l.client()).collect();
        if clients.iter().all(|c| c.idle()) {
            let (tx, rx) = std::sync::mpsc::channel();
            // A brick of a build before BYE (no PING either) would only log an unknown op.
            for c in clients
                .into_iter()
                .filter(|c| !c.is_dead() && c.speaks_bye())
            {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let r = crate::block_on(c.bye());
                    let _ = tx.send((c.server().to_owned(), r));
                });
            }
            drop(tx);
            let end = std::time::Instant::now() + BYE_PATIENCE;
            while let Ok((brick, r)) =
                rx.recv_timeout(end.saturating_duration_since(std::time::Instant::now()))
            {
                if let Err(e) = r {
                    tracing::debug!(brick, "goodbye not answered: {e}");
                }
            }
        } else {
            tracing::debug!("requests in flight: closing without a goodbye");
        }
        self.shutdown();
    }

    /// Shuts every connection down for good: requests in flight and later ones fail, and no
    /// protocol-client reconnects.
    pub fn shutdown(&self) {
        match &self.stack.graph {
            Graph::Fixed(g) => g.links.iter().for_each(|l| l.shutdown()),
            Graph::Switched(s) => s.shutdown(),
        }
    }

    /// Attributes of an open file.
    pub async fn fstat(&self, fd: &Fd) -> io::Result<Attr> {
        fop!(self, cx => self.stack.top.fstat(&cx, fd))
    }

    /// Changes attributes of `path`.
    pub async fn setattr(&self, path: &str, attrs: SetAttrs) -> io::Result<Attr> {
        fop!(self, cx => self.stack.top.setattr(&cx, path, &attrs))
    }

    /// Changes attributes of an open file.
    pub async fn fsetattr(&self, fd: &Fd, attrs: SetAttrs) -> io::Result<Attr> {
        fop!(self, cx => self.stack.top.fsetattr(&cx, fd, &attrs))
    }

    /// Removes a file.
    pub async fn unlink(&self, path: &str) -> io::Result<()> {
        fop!(self, cx => self.stack.top.unlink(&cx, path))
    }

    /// Makes a directory.
    pub async fn mkdir(&self, path: &str, mode: u32) -> io::Result<Attr> {
        fop!(self, cx => self.stack.top.mkdir(&cx, path, mode))
    }

    /// Makes a FIFO, socket or device node (`mode` gives the type; `rdev` the device).
    pub async fn mknod(&self, path: &str, mode: u32, rdev: u64) -> io::Result<Attr> {
        fop!(self, cx => self.stack.top.mknod(&cx, path, mode, rdev))
    }

    /// Removes an empty directory.
    pub async fn rmdir(&self, path: &str) -> io::Result<()> {
        fop!(self, cx => self.stack.top.rmdir(&cx, path))
    }

    /// Renames (`flags`: `RENAME_NOREPLACE` and friends).
    pub async fn rename(&self, from: &str, to: &str, flags: u32) -> io::Result<()> {
        fop!(self, cx => self.stack.top.rename(&cx, from, to, flags))
    }

    /// The whole listing of a directory (without `.` and `..`), page by page.
    pub async fn readdir(&self, path: &str) -> io::Result<Vec<DirEntry>> {
        let mut out = Vec::new();
        loop {
            // As many as a brick sends in one reply (it stops short at the reply's size limit).
            let r = fop!(self, cx => self.stack.top.readdir(&cx, path, out.len() as u64, 4096))?;
            let got = r.entries.0.len();
            out.extend(r.entries.0);
            if r.eof || got == 0 {
                return Ok(out);
            }
        }
    }

    /// Makes `path` a symlink to `target`.
    pub async fn symlink(&self, target: &str, path: &str) -> io::Result<Attr> {
        fop!(self, cx => self.stack.top.symlink(&cx, target, path))
    }

    /// A symlink's target.
    pub async fn readlink(&self, path: &str) -> io::Result<String> {
        fop!(self, cx => self.stack.top.readlink(&cx, path))
    }

    /// Makes `path` a hard link to `existing`.
    pub async fn link(&self, existing: &str, path: &str) -> io::Result<Attr> {
        fop!(self, cx => self.stack.top.link(&cx, existing, path))
    }

    /// Makes a directory's entries durable on every brick that holds it (what was created,
    /// renamed or removed in it survives a crash of the brick's host).
    pub async fn syncdir(&self, path: &str) -> io::Result<()> {
        fop!(self, cx => self.stack.top.syncdir(&cx, path))
    }

    /// File system statistics.
    pub async fn statfs(&self, path: &str) -> io::Result<StatfsReply> {
        fop!(self, cx => self.stack.top.statfs(&cx, path))
    }

    /// An extended attribute's value.
    pub async fn getxattr(&self, path: &str, name: &str) -> io::Result<Vec<u8>> {
        fop!(self, cx => self.stack.top.getxattr(&cx, path, name))
    }

    /// Sets an extended attribute.
    pub async fn setxattr(
        &self,
        path: &str,
        name: &str,
        value: &[u8],
        flags: u32,
    ) -> io::Result<()> {
        fop!(self, cx => self.stack.top.setxattr(&cx, path, name, value, flags))
    }

    /// Extended attribute names.
    pub async fn listxattr(&self, path: &str) -> io::Result<Vec<String>> {
        fop!(self, cx => self.stack.top.listxattr(&cx, path))
    }

    /// Removes an extended attribute.
    pub async fn removexattr(&self, path: &str, name: &str) -> io::Result<()> {
        fop!(self, cx => self.stack.top.removexattr(&cx, path, name))
    }

    /// Allocates or zeroes a range (`mode`: Linux `fallocate` flags).
    pub async fn fallocate(&self, fd: &Fd, mode: u32, offset: u64, len: u64) -> io::Result<()> {
        fop!(self, cx => self.stack.top.fallocate(&cx, fd, mode, offset, len))
    }

    /// Punches a hole, keeping the size.
    pub async fn discard(&self, fd: &Fd, offset: u64, len: u64) -> io::Result<()> {
        fop!(self, cx => self.stack.top.discard(&cx, fd, offset, len))
    }

    /// The runs of data and holes from `offset`, covering at most `len` bytes: consecutive,
    /// at least one unless `len` is 0, possibly fewer than the range needs (ask again from
    /// where they end). A layer that cannot tell says data.
    pub async fn extents(&self, fd: &Fd, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let l: io::Result<ExtentList> =
            fop!(self, cx => self.stack.top.extents(&cx, fd, offset, len));
        Ok(l?.runs.0)
    }

    /// The image's exclusive lease ([`kiln_proto::ops::LeaseReq`]): `cmd` is a `LEASE_*`;
    /// `holder` names this process (unique per image), `ttl_ms` how long a grant lasts
    /// unless renewed. `granted` false says who holds it and for how long yet.
    pub async fn lease(
        &self,
        fd: &Fd,
        cmd: u32,
        ttl_ms: u32,
        holder: &str,
    ) -> io::Result<LeaseState> {
        fop!(self, cx => self.stack.top.lease(&cx, fd, cmd, ttl_ms, holder))
    }

    /// A dirty record of the file ([`kiln_proto::ops::DirtyReq`]): `cmd` is a `DIRTY_*`;
    /// for `DIRTY_GET`, the runs from `offset` (at most `len` bytes) written since the record
    /// started (data) or not (holes), possibly fewer than the range needs (ask again from
    /// where they end). `ENOENT`: the record is not known (take everything as written).
    pub async fn dirty(
        &self,
        fd: &Fd,
        cmd: u32,
        name: &str,
        offset: u64,
        len: u64,
    ) -> io::Result<Vec<Extent>> {
        let l: io::Result<ExtentList> =
            fop!(self, cx => self.stack.top.dirty(&cx, fd, cmd, name, offset, len));
        Ok(l?.runs.0)
    }

    /// A snapshot step on the file ([`kiln_proto::ops::SnapReq`]): `cmd` is a `SNAP_*`.
    /// [`Volume::snapshot`] and [`Volume::clone_snapshot`] run the whole of each.
    pub async fn snap(
        &self,
        fd: &Fd,
        cmd: u32,
        name: &str,
        to: &str,
        ttl_ms: u32,
    ) -> io::Result<Vec<Extent>> {
        // As the bricks take a path: no empty, `.` or leading components.
        let to = crate::client::wire_path(to);
        let r: io::Result<kiln_layer::SnapReply> =
            fop!(self, cx => self.stack.top.snap(&cx, fd, cmd, name, &to, ttl_ms));
        Ok(r?.blocked.runs.0)
    }

    /// Snapshot `name` of the file at `path`, crash-consistent on every replica: a first
    /// reflink copy with writers running (it writes back the file's dirty pages, the slow
    /// part), then a write barrier on the file (`ttl_ms` at most, lifted as soon as the copies
    /// are brought up to it) under which only the ranges changed since are copied again.
    /// Returns the bytes whose copies heal then makes alike (changes that waited at the
    /// barrier on some replica) and how long writers were held at the barrier.
    pub async fn snapshot(
        &self,
        path: &str,
        name: &str,
        ttl_ms: u32,
    ) -> io::Result<(u64, std::time::Duration)> {
        // A barrier holds writers back: the bricks let only a writer raise one.
        let fd = self.open(path, libc::O_RDWR).await?;
        let files = [trees::Taken {
            rel: String::new(),
            fd,
        }];
        let (r, held, _) = self.barrier_copy(name, None, &files, ttl_ms).await;
        let [f] = files;
        let _ = self.close(f.fd).await;
        Ok((r?, held))
    }

    /// Makes `to` a clone of snapshot `name` of the file at `path`: a new file sharing the
    /// snapshot's blocks, beside it on every replica. `EAGAIN` while heal is still making the
    /// snapshot's copies alike.
    pub async fn clone_snapshot(&self, path: &str, name: &str, to: &str) -> io::Result<()> {
        let fd = self.open(path, libc::O_RDWR).await?;
        let r = self
            .snap(&fd, kiln_proto::ops::SNAP_CLONE, name, to, 0)
            .await;
        let _ = self.close(fd).await;
        r.map(|_| ())
    }

    /// Writes borrowed slices at `offset`, sent straight from them; blocks the calling thread
    /// until the stack has answered.
    pub fn pwritev_blocking(
        &self,
        fd: &Fd,
        bufs: &[IoSlice<'_>],
        offset: u64,
    ) -> io::Result<usize> {
        let iov: Vec<RawIov> = bufs
            .iter()
            .map(|b| RawIov {
                base: b.as_ptr() as usize,
                len: b.len(),
            })
            .collect();
        // SAFETY: `block_on` returns only once the write has completed, and `bufs` stays
        // borrowed (unchanged) until then.
        let data = unsafe { IoBufs::raw(iov) };
        let r =
            exec::block_on(async { fop!(self, cx => self.stack.top.write(&cx, fd, offset, data)) });
        r.map(|w| w.n)
    }

    /// Reads into borrowed slices at `offset`, straight from the socket; blocks until done.
    pub fn preadv_blocking(
        &self,
        fd: &Fd,
        bufs: &mut [io::IoSliceMut<'_>],
        offset: u64,
    ) -> io::Result<usize> {
        let iov: Vec<RawIov> = bufs
            .iter_mut()
            .map(|b| RawIov {
                base: b.as_mut_ptr() as usize,
                len: b.len(),
            })
            .collect();
        // SAFETY: as in `pwritev_blocking`; `bufs` is borrowed exclusively until completion.
        let dst = unsafe { IoBufs::raw(iov) };
        let r = exec::block_on(async {
            fop!(self, cx => self.stack.top.read(&cx, fd, offset, ReadDst::Into(dst)))
        });
        r.map(|o| o.len())
    }

    /// Writes `data` at `offset` (memory the caller describes: owned buffers, or raw vectors
    /// such as static memory); returns the bytes written.
    pub async fn write_bufs(&self, fd: &Fd, data: IoBufs, offset: u64) -> io::Result<usize> {
        fop!(self, cx => self.stack.top.write(&cx, fd, offset, data)).map(|w| w.n)
    }

    /// Flushes a file; `cb` runs on the thread that completed the request.
    pub fn fsync_raw(
        &self,
        fd: &Fd,
        datasync: bool,
        cb: Box<dyn FnOnce(Result<(), Errno>) + Send>,
    ) {
        let (top, fd, cx) = (self.stack.top.clone(), fd.clone(), self.ctx());
        exec::spawn(async move {
            let r = top.fsync(&cx, &fd, datasync).await;
            Volume::finish(&cx);
            cb(r);
        });
    }
}

/// Builds the stack of `v` as generation `version`, connecting every protocol-client (with
/// `secret`, else as [`Client::connect`]) — except those `prev` has for the same brick, which
/// it keeps. See [`Volume::from_volfile_with_secret`] for bricks that do not answer.
fn build(v: &Volfile, secret: Option<&[u8]>, version: u64, prev: Option<&Gen>) -> io::Result<Gen> {
    let mut links = Vec::new();
    let mut err = None;
    let mut reached = 0usize;
    let connect_one = |remote: &str| match secret {
        Some(s) => Client::connect_with_secret(remote, Some(s)),
        None => Client::connect(remote),
    };
    let connect = |remote: &str| connect_first(remote, connect_one);
    let replicas = v.below_replicate();
    let top = v.build(&mut |def, _kids| match &def.kind {
        LayerKind::ProtocolClient(ProtocolClientConfig {
            remote,
            timeout,
            short_circuit,
            ping_timeout,
        }) => {
            // The process's word (KILN_PING_TIMEOUT_MS), else the graph's, else the default:
            // a graph that no longer says (the option reset) brings the default back.
            if std::env::var("KILN_PING_TIMEOUT_MS").is_err() {
                let t = ping_timeout.map_or(crate::conn::DEFAULT_PING_TIMEOUT, |ms| {
                    Duration::from_millis(ms.into())
                });
                crate::conn::set_ping_timeout((!t.is_zero()).then_some(t));
            }
            // The graph's word, else the process's (KILN_SHORT_CIRCUIT=off), else on.
            let short_circuit = short_circuit.unwrap_or_else(|| {
                std::env::var("KILN_SHORT_CIRCUIT").map_or(true, |v| v != "off")
            });
            if let Some(pc) = prev.and_then(|g| g.reusable(&def.name, remote, *timeout)) {
                pc.set_short_circuit(short_circuit);
                reached += 1;
                links.push((pc.clone(), remote.clone(), *timeout));
                return Ok(pc as LayerRef);
            }
            let c = match connect(remote) {
                Ok(c) => {
                    reached += 1;
                    c
                }
                // Only a brick that does not answer starts down; a refusal (bad secret,
                // allow-list, TLS) is an error to show now.
                Err(e) if is_unreachable(&e) => {
                    tracing::warn!(
                        "{}: {e}; starting without it and reconnecting in the background",
                        def.name
                    );
                    let tls = kiln_tls::client_config_from_env().ok().flatten();
                    let last = remote.rsplit(',').next().unwrap_or(remote).trim();
                    let down = Client::unreachable(last, secret, tls);
                    err.get_or_insert(e);
                    down?
                }
                Err(e) => {
                    let typed = Error::new(kiln_proto::Kind::of_io(&e), e.to_string());
                    err = Some(e);
                    return Err(typed);
                }
            };
            let c = Arc::new(c);
            let patience = match timeout {
                Some(s) => Duration::from_secs((*s).into()),
                None if replicas.contains(&def.name) => Duration::ZERO,
                None => crate::protocol::DEFAULT_PATIENCE,
            };
            let pc = Arc::new(ProtocolClient::new(&def.name, c).with_patience(patience));
            pc.set_short_circuit(short_circuit);
            // A new brick of a volume this process watches is watched too.
            if let Some(sink) = prev.and_then(Gen::push_sink) {
                if let Err(e) = crate::block_on(pc.watch(sink)) {
                    tracing::warn!("{}: cannot watch for changes: {e}", def.name);
                }
            }
            links.push((pc.clone(), remote.clone(), *timeout));
            Ok(pc as LayerRef)
        }
        other => Err(Error::invalid(format!(
            "layer {:?}: a {} layer cannot run in a client",
            def.name,
            other.type_name()
        ))),
    });
    match (top, err) {
        // No brick answered: the first one's error.
        (Ok(_), Some(e)) if reached == 0 => Err(e),
        (Ok(top), _) => Ok(Gen::new(version, top, links)),
        (Err(msg), err) => {
            // Connections made for this build and not kept by anyone close as they drop.
            Err(err.unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, msg)))
        }
    }
}

/// Connects to the first alternative in `remotes` (comma-separated) that answers. A `unix:`
/// alternative is tried only when a TCP alternative names an address of this host: it is then
/// the same brick's local socket (a path on another host would mean nothing here).
/// True for errors that say a brick is not there (down, restarting, not yet listening), as
/// opposed to one that answered and refused.
fn is_unreachable(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | TimedOut
            | NotFound
            | HostUnreachable
            | NetworkUnreachable
            | AddrNotAvailable
            | UnexpectedEof
    )
}

fn connect_first(
    remotes: &str,
    connect: impl Fn(&str) -> io::Result<Client>,
) -> io::Result<Client> {
    let alts: Vec<&str> = remotes.split(',').map(str::trim).collect();
    if alts.len() == 1 {
        return connect(alts[0]);
    }
    let here = alts
        .iter()
        .any(|a| !a.starts_with("unix:") && crate::protocol::is_local_address(a));
    let mut last = None;
    for a in alts {
        if a.starts_with("unix:") && !here {
            continue;
        }
        match connect(a) {
            Ok(c) => return Ok(c),
            Err(e) => {
                tracing::debug!("{a}: {e}; trying the next address");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("no usable address in {remotes:?}"),
        )
    }))
}
