//! Running a fop to completion without a runtime: the task is polled by whoever wakes it.
//!
//! Callers that want a callback, not a future (the C ABI, the FUSE daemon, the NBD export),
//! start the stack's future with [`spawn`]. It is polled at once on the calling thread — sending
//! the request — and then again by the thread that wakes it: for a remote fop, the connection's
//! receive thread, right after the reply landed. The completion therefore runs where the data
//! arrived, without a hop to another thread (a cross-CPU wake-up costs tens of microseconds here).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

struct Inline {
    fut: Mutex<Option<Task>>,
    /// Set by every wake; the poller clears it before polling and re-polls if it was set
    /// meanwhile, so a wake that found the task busy is never lost.
    woken: AtomicBool,
}

impl Inline {
    fn run(self: &Arc<Self>) {
        // Release/Acquire: a wake's writes (the completion it delivers) happen before the poll
        // that observes `woken`.
        self.woken.store(true, Ordering::Release);
        loop {
            let Ok(mut slot) = self.fut.try_lock() else {
                // Another thread is polling; it will see `woken` and poll again.
                return;
            };
            if !self.woken.swap(false, Ordering::AcqRel) {
                return;
            }
            let Some(fut) = slot.as_mut() else {
                return;
            };
            let waker = Waker::from(self.clone());
            let mut cx = Context::from_waker(&waker);
            if let Poll::Ready(()) = fut.as_mut().poll(&mut cx) {
                *slot = None;
                return;
            }
            drop(slot);
            if !self.woken.load(Ordering::Acquire) {
                return;
            }
        }
    }
}

impl Wake for Inline {
    fn wake(self: Arc<Self>) {
        self.run();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.run();
    }
}

/// Runs `fut` to completion: polled now on this thread, later on the waking thread.
pub fn spawn(fut: impl Future<Output = ()> + Send + 'static) {
    let task = Arc::new(Inline {
        fut: Mutex::new(Some(Box::pin(fut))),
        woken: AtomicBool::new(false),
    });
    task.run();
}

/// Blocks the calling thread until `fut` completes (the blocking API's bridge).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    block_on_noting(fut, || {})
}

/// [`block_on`], calling `parking` once, the first time the thread is about to wait (never
/// when `fut` completes at its first poll).
pub fn block_on_noting<F: Future>(fut: F, parking: impl FnOnce()) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    let mut parking = Some(parking);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        if let Some(f) = parking.take() {
            f();
        }
        std::thread::park();
    }
}

/// Runs futures side by side; resolves to their outputs, in order, when all are done.
/// `None` entries stay `None`.
pub fn join_all<F: Future + Unpin>(futs: Vec<Option<F>>) -> JoinAll<F> {
    let out = futs.iter().map(|_| None).collect();
    JoinAll { futs, out }
}

/// The future of [`join_all`].
pub struct JoinAll<F: Future> {
    futs: Vec<Option<F>>,
    out: Vec<Option<F::Output>>,
}

// The outputs are never pinned: only the futures are polled in place, and they are `Unpin`.
impl<F: Future + Unpin> Unpin for JoinAll<F> {}

impl<F: Future + Unpin> Future for JoinAll<F> {
    type Output = Vec<Option<F::Output>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut pending = false;
        for (f, o) in this.futs.iter_mut().zip(this.out.iter_mut()) {
            if let Some(fut) = f {
                match Pin::new(fut).poll(cx) {
                    Poll::Ready(v) => {
                        *o = Some(v);
                        *f = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(std::mem::take(&mut this.out))
        }
    }
}

/// Runs two futures side by side.
pub async fn join2<A: std::future::Future, B: std::future::Future>(
    a: A,
    b: B,
) -> (A::Output, B::Output) {
    let mut a = std::pin::pin!(a);
    let mut b = std::pin::pin!(b);
    let (mut ra, mut rb) = (None, None);
    std::future::poll_fn(|cx| {
        if ra.is_none() {
            if let std::task::Poll::Ready(v) = a.as_mut().poll(cx) {
                ra = Some(v);
            }
        }
        if rb.is_none() {
            if let std::task::Poll::Ready(v) = b.as_mut().poll(cx) {
                rb = Some(v);
            }
        }
        if ra.is_some() && rb.is_some() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    (ra.expect("ready"), rb.expect("ready"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A future completed from another thread runs its continuation there, exactly once.
    #[test]
    fn completes_on_waking_thread() {
        for _ in 0..200 {
            let (tx, rx) = mpsc::channel();
            let slot: Arc<Mutex<(Option<u32>, Option<Waker>)>> = Arc::default();
            let s2 = slot.clone();
            spawn(async move {
                let v = std::future::poll_fn(|cx| {
                    let mut g = s2.lock().unwrap();
                    match g.0.take() {
                        Some(v) => Poll::Ready(v),
                        None => {
                            g.1 = Some(cx.waker().clone());
                            Poll::Pending
                        }
                    }
                })
                .await;
                tx.send((v, std::thread::current().id())).unwrap();
            });
            let t = std::thread::spawn(move || {
                let w = {
                    let mut g = slot.lock().unwrap();
                    g.0 = Some(7);
                    g.1.take()
                };
                if let Some(w) = w {
                    w.wake();
                }
                std::thread::current().id()
            });
            let waker_thread = t.join().unwrap();
            let (v, ran_on) = rx.recv().unwrap();
            assert_eq!(v, 7);
            assert_eq!(ran_on, waker_thread);
            assert!(rx.try_recv().is_err(), "completion ran twice");
        }
    }
}
