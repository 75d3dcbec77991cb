//! The vhost-user-blk device: virtqueues served from the image through Kiln's client stack.
//!
//! Each virtqueue has a worker thread of its own (no lock is shared between queues). A worker
//! pops every request the guest made available, then starts each one without waiting: a read
//! or write hands the request's guest buffers, as host vectors, to the stack's raw vectored
//! fop, and its completion — on whichever thread finished it — writes the status byte, puts the
//! chain on the used ring and notifies the guest if it asked to be (event index). So many
//! requests per queue are in flight at once, and a read's payload goes from the brick's socket
//! into the guest's own pages with no buffer in between (`bytes_copied` stays 0).
//!
//! Guest memory stays mapped while a request uses it: each request holds the mapping it was
//! parsed against. When QEMU stops a ring (`GET_VRING_BASE`: a reset, a migration, a
//! disconnect), `stop_vring` waits for that queue's requests to complete first.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use kiln_client::{Fd, Volume};
use kiln_proto::sync::{MutexExt as _, RwLockExt as _};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk::*;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::{self, SECTOR};
use crate::request::{Kind, Malformed, Mem, Request};

/// The image the device serves.
pub struct Image {
    /// The client stack.
    pub vol: Arc<Volume>,
    /// The open image.
    pub fd: Fd,
    /// Its size in bytes (the device's capacity).
    pub size: u64,
    /// Refuse writes.
    pub read_only: bool,
    /// The serial number `GET_ID` answers (20 bytes, zero padded).
    pub id: [u8; 20],
}

/// What the device did, for the log and the tests.
#[derive(Default)]
pub struct Stats {
    /// Reads completed, and their bytes.
    pub reads: AtomicU64,
    /// Bytes read into guest memory.
    pub read_bytes: AtomicU64,
    /// Writes completed.
    pub writes: AtomicU64,
    /// Bytes written from guest memory.
    pub write_bytes: AtomicU64,
    /// Flushes completed.
    pub flushes: AtomicU64,
    /// Discards completed.
    pub discards: AtomicU64,
    /// Write-zeroes completed.
    pub zeroes: AtomicU64,
    /// Requests answered with an error status.
    pub errors: AtomicU64,
}

/// Requests in flight on one queue.
#[derive(Default)]
struct Inflight {
    n: Mutex<u32>,
    idle: Condvar,
}

struct Inner {
    image: Image,
    queues: usize,
    config: Vec<u8>,
    mem: RwLock<Option<GuestMemoryAtomic<GuestMemoryMmap>>>,
    event_idx: AtomicBool,
    inflight: Vec<Inflight>,
    /// Set by [`Blk::stop`]: the queues' workers start nothing more.
    stopping: AtomicBool,
    stats: Stats,
}

/// The device (cheap to clone: one per vhost-user connection shares it).
#[derive(Clone)]
pub struct Blk(Arc<Inner>);

/// What a sampled request's waterfall shows of the device: the guest's kick (when the queue's
/// worker woke to it) and the request's completion on the used ring (the guest notified).
pub const KICK: &str = "vhost: guest kick";
/// See [`KICK`].
pub const USED: &str = "vhost: used ring";

thread_local! {
    /// The queue this thread is starting a batch of requests on, and how many of them
    /// completed meanwhile (a read served from the brick's file on this host completes at
    /// once): the used ring gets each, and the guest one notification for the batch — an
    /// interrupt per request costs the guest dearly. A completion of another queue that
    /// happens to run here (a woken task) notifies as usual. `None`: not starting a batch.
    static BATCH: std::cell::Cell<Option<(usize, u32)>> = const { std::cell::Cell::new(None) };
}

/// `VIRTIO_BLK_S_*` as the status byte.
fn status(code: u32) -> u8 {
    code as u8
}

impl Blk {
    /// A device serving `image` on `queues` virtqueues.
    pub fn new(image: Image, queues: u16) -> Blk {
        let config = config::config_space(image.size, queues);
        Blk(Arc::new(Inner {
            image,
            queues: queues.into(),
            config,
            mem: RwLock::new(None),
            event_idx: AtomicBool::new(false),
            inflight: (0..queues).map(|_| Inflight::default()).collect(),
            stopping: AtomicBool::new(false),
            stats: Stats::default(),
        }))
    }

    /// What the device did so far.
    pub fn stats(&self) -> &Stats {
        &self.0.stats
    }

    /// The image.
    pub fn image(&self) -> &Image {
        &self.0.image
    }

    /// Waits until no request is in flight on any queue, then forgets the guest's memory
    /// (QEMU went away: its RAM need not stay mapped here).
    pub fn drain(&self) {
        for q in 0..self.0.queues {
            self.drain_queue(q);
        }
        *self.0.mem.write_locked() = None;
    }

    /// Stops for a restart: the queues start no more requests, and this waits until those
    /// started have completed; returns how many were in flight. What the guest made available
    /// meanwhile stays on its rings, where QEMU hands it to the next backend (it rewinds a
    /// ring to the last request used when the connection breaks, and every request started
    /// before that is used by then).
    pub fn stop(&self) -> u32 {
        self.0.stopping.store(true, SeqCst);
        let mut was = 0;
        for q in 0..self.0.queues {
            // A worker counts what it pops under this lock, after it looked at `stopping`:
            // either it saw it set, or its requests are counted here.
            was += *self.0.inflight[q].n.locked();
            self.drain_queue(q);
        }
        was
    }

    /// Waits until queue `q` has no request in flight, saying every 10 s that it waits.
    fn drain_queue(&self, q: usize) {
        while !self.wait_idle(q, Duration::from_secs(10)) {
            tracing::warn!(queue = q, "waiting for requests in flight to end");
        }
    }

    fn wait_idle(&self, q: usize, limit: Duration) -> bool {
        let f = &self.0.inflight[q];
        let n = f.n.locked();
        let (n, _) = f
            .idle
            .wait_timeout_while(n, limit, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        *n == 0
    }

    fn memory(&self) -> Option<Mem> {
        let m = self.0.mem.read_locked();
        m.as_ref().map(|a| a.memory().into_inner())
    }

    /// Every request the guest made available on queue `q`, started.
    fn process(&self, vring: &VringRwLock, q: usize) -> io::Result<()> {
        let Some(mem) = self.memory() else {
            return Ok(());
        };
        let event_idx = self.0.event_idx.load(Relaxed);
        loop {
            let kick_ns = kiln_layer::trace::now_ns();
            let chains: Vec<_> = {
                let mut st = vring.get_mut();
                // Counted before the ring's lock goes (stop_vring and stop wait for them),
                // and not popped at all once the device stops.
                let mut n = self.0.inflight[q].n.locked();
                if self.0.stopping.load(SeqCst) {
                    return Ok(());
                }
                if event_idx {
                    st.disable_notification().map_err(io::Error::other)?;
                }
                let mut v = Vec::new();
                while let Some(c) = st.get_queue_mut().pop_descriptor_chain(mem.clone()) {
                    v.push(c);
                }
                *n += v.len() as u32;
                v
            };
            // Started with the ring unlocked: a completion takes its lock.
            BATCH.with(|b| b.set(Some((q, 0))));
            for chain in chains {
                let head = chain.head_index();
                let descs: Vec<_> = chain.collect();
                self.start(vring, q, &mem, (head, kick_ns), &descs);
            }
            if BATCH.with(|b| b.take()).is_some_and(|(_, n)| n > 0) {
                let mut st = vring.get_mut();
                if st.needs_notification().unwrap_or(true) {
                    let _ = st.signal_used_queue();
                }
            }
            if !event_idx
                || !vring
                    .get_mut()
                    .enable_notification()
                    .map_err(io::Error::other)?
            {
                return Ok(());
            }
        }
    }

    /// Starts one request; it completes now or from the thread that finishes its I/O.
    fn start(
        &self,
        vring: &VringRwLock,
        q: usize,
        mem: &Mem,
        (head, kick_ns): (u16, u64),
        descs: &[virtio_queue::desc::split::Descriptor],
    ) {
        let req = match Request::parse(head, descs, mem) {
            Ok(r) => r,
            Err(Malformed(why)) => {
                tracing::warn!(queue = q, head, "malformed request: {why}");
                self.0.stats.errors.fetch_add(1, Relaxed);
                self.used(vring, q, head, 0);
                return;
            }
        };
        let done = Done {
            blk: self.clone(),
            vring: vring.clone(),
            q,
            mem: mem.clone(),
            head,
            status: req.status,
            trace: None,
        };
        let img = &self.0.image;
        let at = req.sector.checked_mul(SECTOR);
        let len = req.len();
        let inside = at
            .and_then(|a| a.checked_add(len))
            .is_some_and(|e| e <= img.size);
        match req.kind {
            Kind::Read | Kind::Write if !inside => done.finish(VIRTIO_BLK_S_IOERR, 0),
            Kind::Write if img.read_only => done.finish(VIRTIO_BLK_S_IOERR, 0),
            Kind::Read | Kind::Write => self.read_write(req, done, kick_ns, (at.unwrap_or(0), len)),
            Kind::Flush => {
                let vol = img.vol.clone();
                let fd = img.fd.clone();
                kiln_layer::exec::spawn(async move {
                    let r = vol.fsync(&fd, false).await;
                    if r.is_ok() {
                        done.blk.0.stats.flushes.fetch_add(1, Relaxed);
                    }
                    done.after(r.is_ok(), 0);
                });
            }
            Kind::GetId => {
                // Into the first buffer only, as much of the 20 bytes as it holds.
                let (ok, n) = match req.data.first() {
                    Some((a, l)) => {
                        let n = (*l as usize).min(20);
                        (mem.write_slice(&img.id[..n], *a).is_ok(), n)
                    }
                    None => (false, 0),
                };
                done.after(ok, n as u32);
            }
            Kind::Discard | Kind::WriteZeroes if img.read_only => {
                done.finish(VIRTIO_BLK_S_IOERR, 0)
            }
            Kind::Discard | Kind::WriteZeroes => self.zero(req, done),
            Kind::Unsupported(t) => {
                tracing::debug!(queue = q, "request type {t} not supported");
                done.finish(VIRTIO_BLK_S_UNSUPP, 0);
            }
        }
    }

    /// A read into, or a write from, the guest's buffers, in place.
    fn read_write(&self, req: Request, mut done: Done, kick_ns: u64, (at, len): (u64, u64)) {
        let iov = match req.vectors(&done.mem) {
            Ok(v) => v,
            Err(Malformed(why)) => {
                tracing::warn!(queue = done.q, "bad request: {why}");
                return done.finish(VIRTIO_BLK_S_IOERR, 0);
            }
        };
        if len >= u64::from(u32::MAX) {
            // The used ring counts a chain's bytes in 32 bits.
            return done.finish(VIRTIO_BLK_S_IOERR, 0);
        }
        let img = &self.0.image;
        // A sampled request's waterfall starts at the kick and ends on the used ring.
        let cx = img.vol.ctx();
        if let Some(t) = &cx.trace {
            t.stamp_at(kick_ns, KICK);
            t.expect_part();
            done.trace = Some(t.clone());
        }
        let read = req.kind == Kind::Read;
        let cb = Box::new(move |r: Result<usize, u32>| {
            let ok = r.is_ok_and(|n| n as u64 == len);
            let st = &done.blk.0.stats;
            if ok && read {
                st.reads.fetch_add(1, Relaxed);
                st.read_bytes.fetch_add(len, Relaxed);
            } else if ok {
                st.writes.fetch_add(1, Relaxed);
                st.write_bytes.fetch_add(len, Relaxed);
            }
            if let Err(e) = r {
                tracing::warn!(at, len, read, "I/O failed: errno {e}");
            }
            // A read's bytes are in guest memory now, the status byte after them.
            done.after(ok, if read { len as u32 } else { 0 });
        });
        // SAFETY: the vectors point into guest memory mapped by `done.mem`, which `cb` owns
        // and so keeps mapped until the fop has stopped using them; the guest does not touch a
        // request's buffers before the device puts it on the used ring, which happens in `cb`.
        unsafe {
            if read {
                img.vol.preadv_raw_in(cx, &img.fd, &iov, at, cb)
            } else {
                img.vol.pwritev_raw_in(cx, &img.fd, &iov, at, cb)
            }
        }
    }

    /// DISCARD (holes) and WRITE_ZEROES (zero range, or holes when the guest allows unmap).
    fn zero(&self, req: Request, done: Done) {
        let segs = match req.segments(&done.mem) {
            Ok(s) if !s.is_empty() && s.len() <= config::SEGS_MAX as usize => s,
            _ => return done.finish(VIRTIO_BLK_S_IOERR, 0),
        };
        let unmap_ok = req.kind == Kind::Discard;
        let (vol, fd, size) = (
            self.0.image.vol.clone(),
            self.0.image.fd.clone(),
            self.0.image.size,
        );
        kiln_layer::exec::spawn(async move {
            let mut ok = true;
            for (sector, n, flags) in segs {
                let (at, len) = (sector.saturating_mul(SECTOR), u64::from(n) * SECTOR);
                let unmap = flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
                // A discard takes no flags; a write-zeroes only "unmap".
                let known = if unmap_ok {
                    0
                } else {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                };
                if flags & !known != 0 {
                    return done.finish(VIRTIO_BLK_S_UNSUPP, 0);
                }
                if at.checked_add(len).is_none_or(|e| e > size) {
                    ok = false;
                    break;
                }
                let r = if unmap_ok || unmap {
                    vol.discard(&fd, at, len).await
                } else {
                    let mode = (libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE) as u32;
                    vol.fallocate(&fd, mode, at, len).await
                };
                if r.is_err() {
                    ok = false;
                    break;
                }
            }
            if ok {
                let st = &done.blk.0.stats;
                let n = if unmap_ok { &st.discards } else { &st.zeroes };
                n.fetch_add(1, Relaxed);
            }
            done.after(ok, 0);
        });
    }

    /// Puts chain `head` on the used ring (`len` bytes written into it), notifies the guest if
    /// it wants to be, and counts the request out of queue `q`.
    fn used(&self, vring: &VringRwLock, q: usize, head: u16, len: u32) {
        {
            let mut st = vring.get_mut();
            if let Err(e) = st.add_used(head, len) {
                tracing::warn!(
                    queue = q,
                    head,
                    "cannot put a request on the used ring: {e}"
                );
            }
            let batched = BATCH.with(|b| match b.get() {
                Some((bq, n)) if bq == q => {
                    b.set(Some((bq, n + 1)));
                    true
                }
                _ => false,
            });
            if !batched && st.needs_notification().unwrap_or(true) {
                let _ = st.signal_used_queue();
            }
        }
        let f = &self.0.inflight[q];
        let mut n = f.n.locked();
        *n = n.saturating_sub(1);
        if *n == 0 {
            f.idle.notify_all();
        }
    }
}

/// How a started request completes.
struct Done {
    blk: Blk,
    vring: VringRwLock,
    q: usize,
    mem: Mem,
    head: u16,
    status: GuestAddress,
    /// A sampled request's trace: stamped once the request is on the used ring.
    trace: Option<Arc<kiln_layer::trace::Trace>>,
}

impl Done {
    /// Completes with `VIRTIO_BLK_S_OK` (`ok`, `n` data bytes written into the chain) or
    /// `VIRTIO_BLK_S_IOERR`.
    fn after(self, ok: bool, n: u32) {
        if ok {
            self.finish(VIRTIO_BLK_S_OK, n)
        } else {
            self.finish(VIRTIO_BLK_S_IOERR, 0)
        }
    }

    /// Writes the status byte after `n` data bytes and completes.
    fn finish(self, code: u32, n: u32) {
        if code != VIRTIO_BLK_S_OK {
            self.blk.0.stats.errors.fetch_add(1, Relaxed);
        }
        if self.mem.write_obj(status(code), self.status).is_err() {
            tracing::warn!(queue = self.q, "the status byte is outside guest memory");
        }
        self.blk
            .used(&self.vring, self.q, self.head, n.saturating_add(1));
        if let Some(t) = self.trace {
            t.stamp(USED);
            t.part_done();
        }
    }
}

impl VhostUserBackend for Blk {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        self.0.queues
    }

    fn max_queue_size(&self) -> usize {
        config::QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        config::features(self.0.image.read_only)
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.0.event_idx.store(enabled, Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config::config_slice(&self.0.config, offset, size)
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemoryMmap>) -> io::Result<()> {
        *self.0.mem.write_locked() = Some(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // A worker thread per queue: queues share no lock.
        (0..self.0.queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread: usize) -> Option<(EventConsumer, EventNotifier)> {
        // A new pair each time: every connection's workers get their own.
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue: u32) -> io::Result<()> {
        // Every request popped must be on the used ring before QEMU reads where the ring
        // stands: a request answered later would land in a ring set up anew. They all end
        // (a brick away fails them once the client's patience runs out).
        self.drain_queue(queue as usize);
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event {evset:?}")));
        }
        let vring = vrings
            .get(usize::from(device_event))
            .ok_or_else(|| io::Error::other(format!("no vring {device_event}")))?;
        // Large reads from the brick's file on this host are copied here, not on the copy
        // thread, so that they complete within the batch: one notification for all of them.
        kiln_client::shortcut::copy_inline_on_this_thread();
        // One queue per worker thread: the thread's index is the queue's. An error would
        // end the queue's worker for good (the guest would hang on it): say it, go on.
        if let Err(e) = self.process(vring, thread_id) {
            tracing::warn!(queue = thread_id, "cannot serve the queue now: {e}");
        }
        Ok(())
    }
}
