//! The transmission phase: NBD requests in, Kiln requests out, replies back in any order.
//!
//! # Flow
//! The reader task takes requests off the NBD socket and submits each to the brick without
//! waiting for it. Requests that arrived together are submitted inside one
//! [`kiln_client::Volume::batch`], so they leave for the bricks in one `sendmsg` per
//! connection. READ, WRITE and FLUSH use the stack's callback API: the completion runs on the
//! Kiln connection's receive thread and hands the finished reply straight to the writer's
//! channel, with no task wake-up in between. TRIM and WRITE_ZEROES (rare, and possibly several Kiln calls) run as small
//! tokio tasks. One writer task drains the channel and sends every reply that is ready in one
//! vectored write.
//!
//! # Zero copy
//! A READ's buffer is allocated with room for the reply header in front; the brick's payload is
//! received from the Kiln socket straight into it, the header is filled in, and the same buffer
//! is written to the NBD socket. WRITE payload is read from the NBD socket into a buffer that
//! the Kiln client sends from (only the part that came in with the request header is copied,
//! and counted).
//!
//! # Limits
//! READ and WRITE are capped at [`MAX_BLOCK`] (advertised) and split into Kiln requests of at
//! most `kiln_proto::MAX_PAYLOAD_LEN`. The bytes in flight per connection are bounded by a
//! semaphore, so a client that sends requests without reading replies stalls itself, not the
//! server.

use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use kiln_client::{Errno, Fd, RawIov, Volume};
use kiln_proto::sync::MutexExt as _;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::metrics::Metrics;
use crate::proto::{
    self, cflag, cmd, err, Request, MAX_BLOCK, OFFSET_DATA_HEAD_LEN, REQUEST_LEN, SIMPLE_REPLY_LEN,
};
use crate::reader::Reader;
use crate::status;

/// Largest Kiln request payload.
const KILN_MAX: usize = kiln_proto::MAX_PAYLOAD_LEN as usize;
/// Bytes that may be in flight per NBD connection (requests accepted, replies not yet sent).
pub const IN_FLIGHT_BYTES: usize = 256 << 20;
/// The semaphore counts in units of this many bytes.
pub const PERMIT_UNIT: usize = 4096;
/// Replies gathered into one vectored write at most.
const MAX_BATCH: usize = 64;
/// Refused requests logged at `warn` per connection; later ones at `debug`.
const WARN_LIMIT: u64 = 20;

/// Zeros to write from when the brick cannot zero a range by itself.
static ZEROES: [u8; 1 << 20] = [0; 1 << 20];

/// Linux `fallocate` modes used for WRITE_ZEROES.
const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
const FALLOC_FL_ZERO_RANGE: u32 = 0x10;

/// A reply ready to send: an inline head (simple reply or `NONE` chunk) and/or a body (a READ
/// buffer with its header in front, or an error chunk).
pub struct Reply {
    head: [u8; proto::CHUNK_HEADER_LEN],
    head_len: u8,
    body: Vec<u8>,
    /// Released once the reply has been written: it bounds the bytes in flight.
    _permit: Option<OwnedSemaphorePermit>,
}

/// What one NBD connection's requests share.
pub struct Ctx {
    /// The export's client stack.
    pub vol: Arc<Volume>,
    /// The image, open through it.
    pub fd: Fd,
    /// Export size, fixed at the handshake.
    pub size: u64,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The metadata contexts selected (see [`crate::status`]).
    pub contexts: status::Contexts,
    /// Writes are refused.
    pub read_only: bool,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Who this is, for logs.
    pub peer: String,
    /// The writer's channel. Every request in flight holds an `Arc<Ctx>`, so the channel closes
    /// (and the writer ends) exactly when the reader has stopped and the last reply is queued.
    tx: UnboundedSender<Reply>,
    warned: AtomicU64,
}

impl Ctx {
    /// Builds the context (`agreed`: structured replies, metadata contexts); replies go to
    /// `tx`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vol: Arc<Volume>,
        fd: Fd,
        size: u64,
        (structured, contexts): (bool, status::Contexts),
        read_only: bool,
        metrics: Arc<Metrics>,
        peer: String,
        tx: UnboundedSender<Reply>,
    ) -> Ctx {
        Ctx {
            vol,
            fd,
            size,
            structured,
            contexts,
            read_only,
            metrics,
            peer,
            tx,
            warned: AtomicU64::new(0),
        }
    }

    fn send(&self, r: Reply) {
        // The writer only goes away after every sender has; a send cannot fail while we hold
        // one, but if it ever did the reply would just be dropped with its permit.
        let _ = self.tx.send(r);
    }

    /// Completes request `req`: `Ok(())` or an NBD error with a message.
    fn reply(
        &self,
        req: &Request,
        result: Result<(), (u32, String)>,
        permit: Option<OwnedSemaphorePermit>,
    ) {
        self.metrics.finish(req.cmd, result.is_ok());
        let mut r = Reply {
            head: [0; proto::CHUNK_HEADER_LEN],
            head_len: 0,
            body: Vec::new(),
            _permit: permit,
        };
        match result {
            Ok(()) if self.structured && req.cmd == cmd::READ => {
                // A zero-length read: no data chunk is possible, so just end the reply.
                r.head = proto::none_chunk(req.handle);
                r.head_len = proto::CHUNK_HEADER_LEN as u8;
            }
            Ok(()) => {
                proto::simple_reply(&mut r.head, 0, req.handle);
                r.head_len = SIMPLE_REPLY_LEN as u8;
            }
            Err((e, msg)) if self.structured => {
                r.body = proto::error_chunk(req.handle, e, &msg);
            }
            Err((e, _)) => {
                proto::simple_reply(&mut r.head, e, req.handle);
                r.head_len = SIMPLE_REPLY_LEN as u8;
            }
        }
        self.send(r);
    }

    /// Completes request `req` with a whole structured reply made elsewhere.
    fn reply_chunk(&self, req: &Request, body: Vec<u8>, permit: OwnedSemaphorePermit) {
        self.metrics.finish(req.cmd, true);
        self.send(Reply {
            head: [0; proto::CHUNK_HEADER_LEN],
            head_len: 0,
            body,
            _permit: Some(permit),
        });
    }

    /// Completes a request with the errno the brick returned.
    fn reply_errno(
        &self,
        req: &Request,
        what: &str,
        e: Errno,
        permit: Option<OwnedSemaphorePermit>,
    ) {
        let msg = format!(
            "{what} of {} bytes at {} failed on the brick: {}",
            req.len,
            req.offset,
            io::Error::from_raw_os_error(e as i32)
        );
        tracing::debug!(peer = %self.peer, "{msg}");
        self.reply(req, Err((proto::nbd_error(e), msg)), permit);
    }

    fn refuse(&self, req: &Request, e: u32, msg: String) {
        self.metrics.bad_requests.fetch_add(1, Relaxed);
        if self.warned.fetch_add(1, Relaxed) < WARN_LIMIT {
            tracing::warn!(peer = %self.peer, handle = req.handle, "refused {}: {msg}", proto::cmd_name(req.cmd));
        } else {
            tracing::debug!(peer = %self.peer, handle = req.handle, "refused {}: {msg}", proto::cmd_name(req.cmd));
        }
        self.reply(req, Err((e, msg)), None);
    }

    /// Checks a request against the export; `Err` is the NBD error and a message.
    fn check(&self, req: &Request) -> Result<(), (u32, String)> {
        check_request(req, self.size, self.structured, self.read_only)
    }
}

/// Checks request `req` against an export of `size` bytes (pure, so it can be tested and
/// fuzzed on its own): the command, its flags (`DF` only with `structured` replies), writes to a
/// `read_only` export, the block size and the range. `Err` is the NBD error and a message.
pub fn check_request(
    req: &Request,
    size: u64,
    structured: bool,
    read_only: bool,
) -> Result<(), (u32, String)> {
    let allowed = match req.cmd {
        cmd::READ => cflag::FUA | if structured { cflag::DF } else { 0 },
        cmd::WRITE | cmd::FLUSH | cmd::TRIM => cflag::FUA,
        cmd::WRITE_ZEROES => cflag::FUA | cflag::NO_HOLE | cflag::FAST_ZERO,
        cmd::BLOCK_STATUS if structured => cflag::REQ_ONE,
        c => return Err((err::EINVAL, format!("unknown command {c}"))),
    };
    if req.flags & !allowed != 0 {
        return Err((
            err::EINVAL,
            format!("unsupported command flags {:#x}", req.flags & !allowed),
        ));
    }
    let writes = matches!(req.cmd, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
    if writes && read_only {
        return Err((err::EPERM, "the export is read-only".into()));
    }
    if matches!(req.cmd, cmd::READ | cmd::WRITE) && req.len > MAX_BLOCK {
        return Err((
            err::EINVAL,
            format!(
                "{} bytes exceed the maximum block size {MAX_BLOCK}",
                req.len
            ),
        ));
    }
    if req.cmd != cmd::FLUSH {
        let end = req.offset.checked_add(req.len as u64);
        if end.is_none_or(|e| e > size) {
            let e = if matches!(req.cmd, cmd::WRITE | cmd::WRITE_ZEROES) {
                err::ENOSPC
            } else {
                err::EINVAL
            };
            return Err((
                e,
                format!(
                    "{} bytes at {} lie beyond the end of the export ({} bytes)",
                    req.len, req.offset, size
                ),
            ));
        }
    }
    Ok(())
}

/// How the reader stopped.
#[derive(Debug)]
pub enum End {
    /// `NBD_CMD_DISC`.
    Disconnect,
    /// The client closed the socket.
    Eof,
    /// The server is shutting down.
    Shutdown,
    /// The stream broke or the client broke the framing.
    Error(io::Error),
}

/// Permits a request holds while in flight (its bytes, in [`PERMIT_UNIT`]s). Never more than
/// the whole budget ([`IN_FLIGHT_BYTES`] / [`PERMIT_UNIT`]), whatever the client asks for, or
/// the request would wait for ever.
pub fn cost(req: &Request) -> u32 {
    let bytes = match req.cmd {
        cmd::READ | cmd::WRITE => (req.len.min(MAX_BLOCK)) as usize,
        _ => 0,
    };
    1 + (bytes / PERMIT_UNIT) as u32
}

/// Reads and submits requests until the client leaves or `shutdown` turns true. Dropping `ctx`
/// on return lets the writer finish once the requests in flight have been answered.
pub async fn read_requests<R: AsyncRead + Unpin>(
    rd: &mut Reader<R>,
    ctx: Arc<Ctx>,
    shutdown: &mut watch::Receiver<bool>,
) -> End {
    let budget = Arc::new(Semaphore::new(IN_FLIGHT_BYTES / PERMIT_UNIT));
    loop {
        if rd.buffered().len() < REQUEST_LEN {
            if *shutdown.borrow() {
                return End::Shutdown;
            }
            let got = tokio::select! {
                r = rd.fill_to(REQUEST_LEN) => r,
                _ = shutdown.changed() => return End::Shutdown,
            };
            match got {
                Ok(true) => {}
                Ok(false) => return End::Eof,
                Err(e) => return End::Error(e),
            }
        }
        // Everything already here in full goes to the brick in one batch.
        match ctx.vol.batch(|| submit_buffered(rd, &ctx, &budget)) {
            Fast::Drained => continue,
            Fast::Disconnect => return End::Disconnect,
            Fast::Lost => return End::Error(lost()),
            Fast::Slow => {}
        }
        // The next request needs waiting: for its payload or for room in the budget.
        let mut hdr = [0u8; REQUEST_LEN];
        hdr.copy_from_slice(&rd.buffered()[..REQUEST_LEN]);
        let Some(req) = Request::parse(&hdr) else {
            return End::Error(lost());
        };
        rd.consume(REQUEST_LEN);
        let mut payload = Vec::new();
        if req.cmd == cmd::WRITE {
            if let Err((e, msg)) = ctx.check(&req) {
                // Keep the stream in step: the payload follows whatever we think of it.
                ctx.metrics.start(req.cmd, req.len as u64);
                if let Err(e) = rd.skip(req.len as u64).await {
                    return End::Error(e);
                }
                ctx.refuse(&req, e, msg);
                continue;
            }
        }
        // Room in the budget first, then the payload buffer: memory stays bounded.
        let permit = match budget.clone().acquire_many_owned(cost(&req)).await {
            Ok(p) => p,
            Err(_) => return End::Error(io::Error::other("budget closed")),
        };
        if req.cmd == cmd::WRITE {
            payload = vec![0u8; req.len as usize];
            if let Err(e) = rd.read_exact_into(&mut payload).await {
                return End::Error(e);
            }
        }
        submit(&ctx, req, payload, permit);
    }
}

fn lost() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "bad request magic: the client broke the framing",
    )
}

enum Fast {
    /// Less than a request header is buffered.
    Drained,
    /// The next request needs an `await` (payload not all here, or no budget).
    Slow,
    Disconnect,
    Lost,
}

/// Submits every request that is completely in the reader's buffer and fits the budget.
fn submit_buffered<R: AsyncRead + Unpin>(
    rd: &mut Reader<R>,
    ctx: &Arc<Ctx>,
    budget: &Arc<Semaphore>,
) -> Fast {
    loop {
        let b = rd.buffered();
        if b.len() < REQUEST_LEN {
            return Fast::Drained;
        }
        let hdr: &[u8; REQUEST_LEN] = b[..REQUEST_LEN].try_into().expect("28 bytes");
        let Some(req) = Request::parse(hdr) else {
            return Fast::Lost;
        };
        if req.cmd == cmd::DISC {
            rd.consume(REQUEST_LEN);
            return Fast::Disconnect;
        }
        let payload_len = if req.cmd == cmd::WRITE {
            req.len as usize
        } else {
            0
        };
        if b.len() - REQUEST_LEN < payload_len {
            return Fast::Slow;
        }
        let Ok(permit) = budget.clone().try_acquire_many_owned(cost(&req)) else {
            return Fast::Slow;
        };
        rd.consume(REQUEST_LEN);
        let mut payload = Vec::new();
        if payload_len > 0 {
            payload = rd.buffered()[..payload_len].to_vec();
            rd.copied += payload_len as u64;
            rd.consume(payload_len);
        }
        submit(ctx, req, payload, permit);
    }
}

/// Checks one request and sends it on its way; never waits.
fn submit(ctx: &Arc<Ctx>, req: Request, payload: Vec<u8>, permit: OwnedSemaphorePermit) {
    ctx.metrics.start(
        req.cmd,
        if matches!(req.cmd, cmd::FLUSH) {
            0
        } else {
            req.len as u64
        },
    );
    if let Err((e, msg)) = ctx.check(&req) {
        drop(permit);
        ctx.refuse(&req, e, msg);
        return;
    }
    match req.cmd {
        cmd::READ if req.len == 0 => ctx.reply(&req, Ok(()), Some(permit)),
        cmd::READ => submit_read(ctx, req, permit),
        cmd::WRITE if req.len == 0 => ctx.reply(&req, Ok(()), Some(permit)),
        cmd::WRITE => submit_write(ctx, req, payload, permit),
        cmd::FLUSH => flush_then_reply(ctx.clone(), req, Some(permit)),
        cmd::TRIM | cmd::WRITE_ZEROES => {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let r = if req.cmd == cmd::TRIM {
                    trim(&ctx, &req).await
                } else {
                    write_zeroes(&ctx, &req).await
                };
                let r = match r {
                    Ok(()) if req.flags & cflag::FUA != 0 => {
                        ctx.vol.fsync(&ctx.fd, true).await.map_err(|e| {
                            (
                                proto::nbd_error(e.raw_os_error().unwrap_or(libc::EIO) as u32),
                                format!("fsync after {}: {e}", proto::cmd_name(req.cmd)),
                            )
                        })
                    }
                    r => r,
                };
                ctx.reply(&req, r, Some(permit));
            });
        }
        cmd::BLOCK_STATUS => {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                match status::block_status(&ctx.vol, &ctx.fd, &ctx.contexts, &req).await {
                    Ok(chunk) => ctx.reply_chunk(&req, chunk, permit),
                    Err(e) => ctx.reply(&req, Err(e), Some(permit)),
                }
            });
        }
        // check() lets no other command through; refuse rather than trust that blindly.
        c => ctx.refuse(&req, err::EINVAL, format!("unknown command {c}")),
    }
}

/// One READ or WRITE, possibly split into several Kiln requests that share one buffer.
struct Job {
    ctx: Arc<Ctx>,
    req: Request,
    state: Mutex<JobState>,
}

struct JobState {
    parts_left: usize,
    error: Option<Errno>,
    /// READ: header room + data; WRITE: the payload. Nothing touches it while parts are in
    /// flight: the brick connection reads into it or sends from it through raw vectors.
    /// A READ's buffer is not zeroed first (measured: `memset` was 21% of the export's CPU at
    /// 128k QD32): its length stays 0 until every byte of its capacity has been written —
    /// by the reads, and with zeros past a short read — see [`Job::part_done`].
    buf: Vec<u8>,
    /// Header room in front of a READ's data (0 for a WRITE).
    head: usize,
    permit: Option<OwnedSemaphorePermit>,
}

/// Splits `len` bytes into Kiln-sized `(offset, len)` parts.
fn parts(len: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len)
        .step_by(KILN_MAX)
        .map(move |o| (o, (len - o).min(KILN_MAX)))
}

impl Job {
    fn new(
        ctx: &Arc<Ctx>,
        req: Request,
        buf: Vec<u8>,
        head: usize,
        permit: OwnedSemaphorePermit,
    ) -> Arc<Job> {
        Arc::new(Job {
            ctx: ctx.clone(),
            req,
            state: Mutex::new(JobState {
                parts_left: parts(req.len as usize).count(),
                error: None,
                buf,
                head,
                permit: Some(permit),
            }),
        })
    }

    /// Records the completion of the part at `off` (`want` bytes); the last one finishes the
    /// request.
    fn part_done(self: &Arc<Self>, r: Result<usize, Errno>, off: usize, want: usize) {
        let finished = {
            let mut s = self.state.locked();
            match r {
                Err(e) => {
                    s.error.get_or_insert(e);
                }
                Ok(n) if n < want && self.req.cmd == cmd::WRITE => {
                    s.error.get_or_insert(libc::EIO as Errno);
                }
                Ok(n) if n < want => {
                    // The file shrank under the export: the rest of the part reads as zeros, as
                    // a read beyond the end of a sparse file would give.
                    tracing::debug!(peer = %self.ctx.peer, "short read: {n} of {want} bytes");
                    let at = s.head + off + n;
                    debug_assert!(at + (want - n) <= s.buf.capacity());
                    // SAFETY: the part's range lies inside the buffer's capacity (see
                    // submit_read), and no read is writing to it any more.
                    unsafe { s.buf.as_mut_ptr().add(at).write_bytes(0, want - n) };
                }
                Ok(_) => {}
            }
            s.parts_left -= 1;
            if s.parts_left > 0 {
                return;
            }
            (std::mem::take(&mut s.buf), s.head, s.error, s.permit.take())
        };
        let (mut buf, head, error, permit) = finished;
        let (ctx, req) = (&self.ctx, &self.req);
        match (req.cmd, error) {
            (cmd::READ, None) => {
                ctx.metrics.finish(req.cmd, true);
                // SAFETY: the first `head + len` bytes are initialised: the header room at
                // allocation, each part by its read (and zeros past a short one).
                unsafe { buf.set_len(head + req.len as usize) };
                if ctx.structured {
                    proto::offset_data_head(&mut buf, req.handle, req.offset, req.len);
                } else {
                    proto::simple_reply(&mut buf, 0, req.handle);
                }
                ctx.send(Reply {
                    head: [0; proto::CHUNK_HEADER_LEN],
                    head_len: 0,
                    body: buf,
                    _permit: permit,
                });
            }
            (cmd::READ, Some(e)) => ctx.reply_errno(req, "read", e, permit),
            (_, Some(e)) => ctx.reply_errno(req, "write", e, permit),
            (_, None) if req.flags & cflag::FUA != 0 => {
                drop(buf);
                flush_then_reply(ctx.clone(), *req, permit);
            }
            (_, None) => ctx.reply(req, Ok(()), permit),
        }
    }
}

fn submit_read(ctx: &Arc<Ctx>, req: Request, permit: OwnedSemaphorePermit) {
    let head = if ctx.structured {
        OFFSET_DATA_HEAD_LEN
    } else {
        SIMPLE_REPLY_LEN
    };
    let mut buf = Vec::<u8>::with_capacity(head + req.len as usize);
    // SAFETY: `head` bytes are within the capacity just reserved.
    unsafe { buf.as_mut_ptr().write_bytes(0, head) };
    // The heap block does not move when `buf` moves into the job below.
    let base = buf.as_mut_ptr() as usize + head;
    let job = Job::new(ctx, req, buf, head, permit);
    for (off, len) in parts(req.len as usize) {
        let j = job.clone();
        let iov = [RawIov {
            base: base + off,
            len,
        }];
        // SAFETY: the vector points into the job's buffer, which the job owns and keeps alive
        // (every callback holds the job) and which nothing reads or writes until the last
        // part's completion has run; parts cover disjoint ranges of it.
        unsafe {
            ctx.vol.preadv_raw(
                &ctx.fd,
                &iov,
                req.offset + off as u64,
                Box::new(move |r| j.part_done(r, off, len)),
            )
        };
    }
}

fn submit_write(ctx: &Arc<Ctx>, req: Request, payload: Vec<u8>, permit: OwnedSemaphorePermit) {
    let base = payload.as_ptr() as usize;
    let job = Job::new(ctx, req, payload, 0, permit);
    for (off, len) in parts(req.len as usize) {
        let j = job.clone();
        let iov = [RawIov {
            base: base + off,
            len,
        }];
        // SAFETY: as in `submit_read`: the job owns the payload and leaves it untouched until
        // the last part's completion.
        unsafe {
            ctx.vol.pwritev_raw(
                &ctx.fd,
                &iov,
                req.offset + off as u64,
                Box::new(move |r| j.part_done(r, off, len)),
            )
        };
    }
}

/// FLUSH, or the durability half of a FUA request: `fdatasync` on the brick, then the reply.
/// `fdatasync` persists the data and the metadata needed to read it back, which is what a disk
/// cache flush promises. It covers every write already answered, from any connection: the brick
/// syncs the whole file.
fn flush_then_reply(ctx: Arc<Ctx>, req: Request, permit: Option<OwnedSemaphorePermit>) {
    let c = ctx.clone();
    ctx.vol.fsync_raw(
        &ctx.fd,
        true,
        Box::new(move |r| match r {
            Ok(()) => c.reply(&req, Ok(()), permit),
            Err(e) => c.reply_errno(&req, "flush", e, permit),
        }),
    );
}

fn io_errno(e: &io::Error) -> Errno {
    e.raw_os_error().unwrap_or(libc::EIO) as Errno
}

async fn trim(ctx: &Ctx, req: &Request) -> Result<(), (u32, String)> {
    if req.len == 0 {
        return Ok(());
    }
    match ctx.vol.discard(&ctx.fd, req.offset, req.len as u64).await {
        Ok(()) => Ok(()),
        // TRIM is a hint; a brick file system that cannot punch holes just keeps the data.
        Err(e) if io_errno(&e) == libc::EOPNOTSUPP as Errno => Ok(()),
        Err(e) => Err((
            proto::nbd_error(io_errno(&e)),
            format!("trim failed on the brick: {e}"),
        )),
    }
}

/// WRITE_ZEROES: a hole where allowed, else an allocated zero range, else written zeros.
async fn write_zeroes(ctx: &Ctx, req: &Request) -> Result<(), (u32, String)> {
    if req.len == 0 {
        return Ok(());
    }
    let (off, len) = (req.offset, req.len as u64);
    let modes: &[u32] = if req.flags & cflag::NO_HOLE != 0 {
        &[FALLOC_FL_ZERO_RANGE]
    } else {
        &[
            FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            FALLOC_FL_ZERO_RANGE,
        ]
    };
    for &mode in modes {
        match ctx.vol.fallocate(&ctx.fd, mode, off, len).await {
            Ok(()) => return Ok(()),
            Err(e) if io_errno(&e) == libc::EOPNOTSUPP as Errno => continue,
            Err(e) => {
                return Err((
                    proto::nbd_error(io_errno(&e)),
                    format!("zeroing failed on the brick: {e}"),
                ))
            }
        }
    }
    if req.flags & cflag::FAST_ZERO != 0 {
        // The client asked to hear "slow" rather than wait for written zeros.
        return Err((
            err::ENOTSUP,
            "the brick cannot zero this range quickly".into(),
        ));
    }
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(KILN_MAX as u64) as usize;
        let iov: Vec<RawIov> = (0..n)
            .step_by(ZEROES.len())
            .map(|o| RawIov {
                base: ZEROES.as_ptr() as usize,
                len: (n - o).min(ZEROES.len()),
            })
            .collect();
        // SAFETY: static memory, valid forever and never written.
        let data = unsafe { kiln_client::volume::layer::IoBufs::raw(iov) };
        let r = ctx.vol.write_bufs(&ctx.fd, data, off + done).await;
        match r {
            Ok(w) if w == n => done += n as u64,
            Ok(w) => return Err((err::EIO, format!("short write of zeros: {w} of {n} bytes"))),
            Err(e) => {
                return Err((
                    proto::nbd_error(io_errno(&e)),
                    format!("writing zeros failed on the brick: {e}"),
                ))
            }
        }
    }
    Ok(())
}

/// The writer: sends replies as they come, every ready one in one vectored write. After a
/// write error it keeps draining (so requests in flight can finish and release their buffers)
/// and returns the error at the end.
pub async fn write_replies<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: UnboundedReceiver<Reply>,
    metrics: Arc<Metrics>,
) -> io::Result<()> {
    let mut batch: Vec<Reply> = Vec::with_capacity(MAX_BATCH);
    let mut failed: Option<io::Error> = None;
    while let Some(r) = rx.recv().await {
        batch.push(r);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        if failed.is_none() {
            match write_batch(&mut w, &batch).await {
                Ok(calls) => {
                    metrics.replies.fetch_add(batch.len() as u64, Relaxed);
                    metrics.write_calls.fetch_add(calls, Relaxed);
                }
                Err(e) => failed = Some(e),
            }
        }
        batch.clear();
    }
    match failed {
        Some(e) => Err(e),
        None => w.shutdown().await,
    }
}

/// Writes the whole batch; returns the number of system calls it took.
async fn write_batch<W: AsyncWrite + Unpin>(w: &mut W, batch: &[Reply]) -> io::Result<u64> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 2);
    for r in batch {
        if r.head_len > 0 {
            slices.push(IoSlice::new(&r.head[..r.head_len as usize]));
        }
        if !r.body.is_empty() {
            slices.push(IoSlice::new(&r.body));
        }
    }
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    let mut calls = 0;
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        calls += 1;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_exactly() {
        assert_eq!(parts(0).count(), 0);
        assert_eq!(parts(4096).collect::<Vec<_>>(), vec![(0, 4096)]);
        assert_eq!(parts(KILN_MAX).collect::<Vec<_>>(), vec![(0, KILN_MAX)]);
        assert_eq!(
            parts(MAX_BLOCK as usize).collect::<Vec<_>>(),
            vec![(0, KILN_MAX), (KILN_MAX, KILN_MAX)]
        );
        assert_eq!(
            parts(KILN_MAX + 1).collect::<Vec<_>>(),
            vec![(0, KILN_MAX), (KILN_MAX, 1)]
        );
    }

    #[test]
    fn costs_fit_the_budget() {
        let r = |cmd, len| Request {
            flags: 0,
            cmd,
            handle: 0,
            offset: 0,
            len,
        };
        assert_eq!(cost(&r(cmd::FLUSH, 0)), 1);
        assert_eq!(cost(&r(cmd::TRIM, u32::MAX)), 1);
        assert_eq!(cost(&r(cmd::READ, 4096)), 2);
        assert!((cost(&r(cmd::WRITE, u32::MAX)) as usize) < IN_FLIGHT_BYTES / PERMIT_UNIT);
    }
}
