//! Large direct reads run on a copy thread, not on the caller's.
//!
//! A direct read of 128 KiB is a 10–15 µs copy. Done on the caller's thread, it serialises
//! with everything else that thread does: the NBD export, whose one runtime thread also parses
//! requests and writes replies, served 128k QD32 reads at 0.61× the speed of reads through the
//! brick (whose copy runs on the connection's receive thread, beside the export). So reads of
//! [`LARGE`] bytes or more are copied by one thread per process, and complete there, as reads
//! through a brick complete on its receive thread; small reads stay inline, where a hop would
//! cost more than the copy.

use std::cell::Cell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::mpsc::{channel, SendError, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

use kiln_layer::IoBufs;
use kiln_proto::sync::MutexExt as _;

use super::Grant;

thread_local! {
    /// True where copies run inline: on the copy thread (a copy asked for there, by a
    /// completion that reads again and perhaps waits for it, is never queued behind itself)
    /// and on threads that asked for it ([`copy_inline_on_this_thread`]).
    static INLINE: Cell<bool> = const { Cell::new(false) };
}

/// Large direct reads asked for on this thread run on it, inline, as small ones do. For a
/// thread that starts many reads at once and completes them together: a vhost-user queue
/// worker notifies the guest once for a batch whose reads completed while it started them,
/// where a hop to the copy thread would complete, and notify, each one alone.
pub fn copy_inline_on_this_thread() {
    INLINE.with(|c| c.set(true));
}

/// Reads at least this long go to the copy thread.
pub const LARGE: usize = 64 << 10;

type Job = Box<dyn FnOnce() + Send>;

/// What a copy leaves for its future: the bytes read (`None`: stale), and the buffers back.
type Out = (Option<usize>, IoBufs);

#[derive(Default)]
struct Shared {
    out: Option<Out>,
    waker: Option<Waker>,
}

/// The future of a copy on the copy thread.
pub struct Copy(Arc<Mutex<Shared>>);

/// The copy thread's queue, started on first use; `None` if the thread could not start.
fn worker() -> Option<&'static Sender<Job>> {
    static W: OnceLock<Option<Sender<Job>>> = OnceLock::new();
    W.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("kiln-copy".into())
            .spawn(move || {
                INLINE.with(|c| c.set(true));
                for job in rx {
                    // A completion that panics must not take the other copies with it.
                    if catch_unwind(AssertUnwindSafe(job)).is_err() {
                        tracing::error!("a completion run after a direct read panicked");
                    }
                }
            });
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::warn!("no copy thread ({e}): large direct reads run inline");
                None
            }
        }
    })
    .as_ref()
}

/// Reads into `bufs` at `offset` through `g` on the copy thread (inline if there is none, if
/// this is it, or if this thread asked for inline copies); the read's completion runs there
/// too.
/// The buffers travel with the job, so they outlive the copy even if the future is dropped.
pub fn copy(g: Arc<Grant>, bufs: IoBufs, offset: u64) -> Copy {
    let shared = Arc::new(Mutex::new(Shared::default()));
    let s = shared.clone();
    let job: Job = Box::new(move || {
        // SAFETY: `bufs` is the caller's writable memory (the read's destination), held by
        // this job until the copy is over.
        let n = unsafe { g.read(bufs.iov(), offset) };
        let waker = {
            let mut s = s.locked();
            s.out = Some((n, bufs));
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    });
    match worker().filter(|_| !INLINE.with(|c| c.get())) {
        Some(tx) => {
            if let Err(SendError(job)) = tx.send(job) {
                job();
            }
        }
        None => job(),
    }
    Copy(shared)
}

impl Future for Copy {
    type Output = Out;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Out> {
        let mut s = self.0.locked();
        match s.out.take() {
            Some(out) => Poll::Ready(out),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::{FromRawFd, OwnedFd};

    use super::super::Table;
    use super::*;

    fn memfd(bytes: &[u8]) -> OwnedFd {
        // SAFETY: a NUL-terminated name and no flags; the result is checked before it is owned.
        let fd = unsafe { libc::memfd_create(c"kiln-copier-test".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        f.write_all(bytes).unwrap();
        f.into()
    }

    /// A current grant (its slot holds its generation, 0) on a file holding `bytes`.
    fn grant(bytes: &[u8]) -> Arc<Grant> {
        let table = Table::map(memfd(&[0u8; 64])).unwrap();
        Arc::new(Grant::new(memfd(bytes), None, table, 0, 0, 0))
    }

    fn read(c: Copy) -> Vec<u8> {
        let (n, bufs) = kiln_layer::exec::block_on(c);
        assert_eq!(n, Some(LARGE));
        bufs.into_owned::<Vec<u8>>().unwrap().remove(0)
    }

    #[test]
    fn a_thread_that_asked_has_its_large_reads_copied_before_they_return() {
        let data: Vec<u8> = (0..LARGE).map(|i| (i % 251) as u8).collect();
        let g = grant(&data);
        let want = data.clone();
        std::thread::spawn(move || {
            // Another thread's read goes to the copy thread, and arrives whole.
            let c = copy(g.clone(), IoBufs::owned(vec![vec![0u8; LARGE]]), 0);
            assert!(read(c) == want);
            copy_inline_on_this_thread();
            let c = copy(g, IoBufs::owned(vec![vec![0u8; LARGE]]), 0);
            assert!(c.0.locked().out.is_some(), "copied before copy() returned");
            assert!(read(c) == want);
        })
        .join()
        .unwrap();
    }
}
