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

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use kiln_layer::volfile::{LayerKind, Volfile};
use kiln_layer::{exec, Attr, Ctx, Errno, Fd, IoBufs, LayerRef, RawIov, ReadDst, ReadOut};

use crate::client::{errno_error, Client};
use crate::protocol::ProtocolClient;

/// A client stack.
pub struct Volume {
    top: LayerRef,
    clients: Vec<Arc<Client>>,
    trace_every: AtomicU64,
    seq: AtomicU64,
}

/// Label stamped when a request enters the volume API.
pub const SUBMIT: &str = "submit";
/// Label stamped when its completion is delivered.
pub const COMPLETE: &str = "completion";

impl Volume {
    /// The default client stack for the brick at `addr`.
    pub fn default_volfile(addr: &str) -> Volfile {
        Volfile::linear(vec![
            ("client".into(), LayerKind::IoStats {}),
            (
                "brick".into(),
                LayerKind::ProtocolClient {
                    remote: addr.into(),
                },
            ),
        ])
    }

    /// Connects the default stack to the brick at `addr` (see [`Client::connect`] for address
    /// forms and the secret).
    pub fn connect(addr: &str) -> io::Result<Volume> {
        Volume::from_volfile(&Volume::default_volfile(addr))
    }

    /// Builds a client stack, connecting every protocol-client.
    pub fn from_volfile(v: &Volfile) -> io::Result<Volume> {
        let mut clients = Vec::new();
        let mut err = None;
        let top = v.build(&mut |def, _kids| match &def.kind {
            LayerKind::ProtocolClient { remote } => match Client::connect(remote) {
                Ok(c) => {
                    let c = Arc::new(c);
                    clients.push(c.clone());
                    Ok(Arc::new(ProtocolClient::new(&def.name, c)) as LayerRef)
                }
                Err(e) => {
                    let msg = e.to_string();
                    err = Some(e);
                    Err(msg)
                }
            },
            other => Err(format!(
                "layer {:?}: a {} layer cannot run in a client",
                def.name,
                other.type_name()
            )),
        });
        match top {
            Ok(top) => Ok(Volume {
                top,
                clients,
                trace_every: AtomicU64::new(0),
                seq: AtomicU64::new(0),
            }),
            Err(msg) => {
                Err(err.unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, msg)))
            }
        }
    }

    /// The top layer, for fops this type has no wrapper for.
    pub fn top(&self) -> &LayerRef {
        &self.top
    }

    /// The connections of the stack's protocol-clients.
    pub fn clients(&self) -> &[Arc<Client>] {
        &self.clients
    }

    /// Samples every `n`th request for a waterfall (0: none).
    pub fn set_trace_every(&self, n: u64) {
        self.trace_every.store(n, Relaxed);
    }

    /// A context for the next request: traced when sampled.
    pub fn ctx(&self) -> Ctx {
        let every = self.trace_every.load(Relaxed);
        if every == 0 || !self.seq.fetch_add(1, Relaxed).is_multiple_of(every) {
            return Ctx::NONE;
        }
        let cx = Ctx::traced();
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
        fn nest<R>(cs: &[Arc<Client>], f: Box<dyn FnOnce() -> R + '_>) -> R {
            match cs.split_first() {
                None => f(),
                Some((c, rest)) => c.batch(|| nest(rest, f)),
            }
        }
        nest(&self.clients, Box::new(f))
    }

    /// Attributes of `path`.
    pub async fn lookup(&self, path: &str) -> io::Result<Attr> {
        let cx = self.ctx();
        let r = self.top.lookup(&cx, path).await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Opens an existing file.
    pub async fn open(&self, path: &str, flags: i32) -> io::Result<Fd> {
        let cx = self.ctx();
        let r = self.top.open(&cx, path, flags as u32).await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Creates (or opens) a file.
    pub async fn create(&self, path: &str, flags: i32, mode: u32) -> io::Result<(Fd, Attr)> {
        let cx = self.ctx();
        let r = self.top.create(&cx, path, flags as u32, mode).await;
        Volume::finish(&cx);
        r.map_err(errno_error)
    }

    /// Closes a file.
    pub async fn close(&self, fd: Fd) -> io::Result<()> {
        self.top.release(&Ctx::NONE, fd).await.map_err(errno_error)
    }

    /// Flushes a file to stable storage on every brick that holds it.
    pub async fn fsync(&self, fd: &Fd, datasync: bool) -> io::Result<()> {
        let cx = self.ctx();
        let r = self.top.fsync(&cx, fd, datasync).await;
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
        let r = self.top.write(&cx, fd, offset, IoBufs::owned(bufs)).await;
        Volume::finish(&cx);
        match r {
            Ok(w) => (Ok(w.n), w.bufs.into_owned().unwrap_or_default()),
            Err(e) => (Err(errno_error(e)), Vec::new()),
        }
    }

    /// Reads into raw vectors; `cb` gets the byte count or the errno, on the thread that
    /// completed the request.
    ///
    /// # Safety
    /// The vectors' memory must stay valid and untouched until `cb` has been called.
    pub unsafe fn preadv_raw(
        &self,
        fd: &Fd,
        iov: &[RawIov],
        offset: u64,
        cb: Box<dyn FnOnce(Result<usize, Errno>) + Send>,
    ) {
        let (top, fd, cx) = (self.top.clone(), fd.clone(), self.ctx());
        // SAFETY: forwarded to the caller.
        let bufs = unsafe { IoBufs::raw(iov.to_vec()) };
        exec::spawn(async move {
            let r = top.read(&cx, &fd, offset, ReadDst::Into(bufs)).await;
            Volume::finish(&cx);
            cb(r.map(|o| o.len()));
        });
    }

    /// Writes from raw vectors; `cb` gets the byte count or the errno.
    ///
    /// # Safety
    /// The vectors' memory must stay valid and unchanged until `cb` has been called.
    pub unsafe fn pwritev_raw(
        &self,
        fd: &Fd,
        iov: &[RawIov],
        offset: u64,
        cb: Box<dyn FnOnce(Result<usize, Errno>) + Send>,
    ) {
        let (top, fd, cx) = (self.top.clone(), fd.clone(), self.ctx());
        // SAFETY: forwarded to the caller.
        let bufs = unsafe { IoBufs::raw(iov.to_vec()) };
        exec::spawn(async move {
            let r = top.write(&cx, &fd, offset, bufs).await;
            Volume::finish(&cx);
            cb(r.map(|w| w.n));
        });
    }
}
