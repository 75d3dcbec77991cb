//! Waiting without a runtime: deadlines and signals for fops that must wait for something
//! other than a reply (a brick to come back, a quorum to return).
//!
//! [`sleep_until`] is served by one timer thread per process, started on first use; it holds
//! the wakers of pending deadlines in a heap and sleeps until the earliest. [`Signal`] is a
//! counter with wakers: [`Signal::notify`] bumps it and wakes every waiter, and
//! [`Signal::changed`] resolves once the counter moved past the value a waiter saw. Both
//! cost nothing until something waits, which is only while a brick is away.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use kiln_proto::sync::MutexExt as _;

struct Entry {
    at: Instant,
    seq: u64,
    waker: Waker,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

struct Timers {
    heap: Mutex<(BinaryHeap<Reverse<Entry>>, u64)>,
    cv: Condvar,
}

fn timers() -> &'static Timers {
    static T: OnceLock<&'static Timers> = OnceLock::new();
    T.get_or_init(|| {
        let t: &'static Timers = Box::leak(Box::new(Timers {
            heap: Mutex::new((BinaryHeap::new(), 0)),
            cv: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("kiln-timer".into())
            .spawn(move || run(t))
            .expect("the timer thread starts");
        t
    })
}

fn run(t: &'static Timers) {
    let mut g = t.heap.locked();
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        while g.0.peek().is_some_and(|Reverse(e)| e.at <= now) {
            due.push(g.0.pop().expect("peeked").0.waker);
        }
        if !due.is_empty() {
            drop(g);
            due.into_iter().for_each(Waker::wake);
            g = t.heap.locked();
            continue;
        }
        g = match g.0.peek().map(|Reverse(e)| e.at) {
            Some(at) => {
                let wait = at.saturating_duration_since(now);
                t.cv.wait_timeout(g, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => t.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
        };
    }
}

/// A future that resolves at `at`.
pub struct Sleep {
    at: Instant,
    armed: bool,
}

/// Resolves at `at` (at once if it has passed).
pub fn sleep_until(at: Instant) -> Sleep {
    Sleep { at, armed: false }
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.at {
            return Poll::Ready(());
        }
        // One registration per poll is harmless (a stale wake finds the task done or
        // re-polls it); register only once unless the waker changed.
        if !self.armed {
            let t = timers();
            let mut g = t.heap.locked();
            g.1 += 1;
            let seq = g.1;
            g.0.push(Reverse(Entry {
                at: self.at,
                seq,
                waker: cx.waker().clone(),
            }));
            drop(g);
            t.cv.notify_one();
            self.get_mut().armed = true;
        }
        Poll::Pending
    }
}

/// Runs `fut` until `deadline`: its output, or `None` if it had not finished by then.
pub async fn within<F: Future>(deadline: Instant, fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    let mut timeout = sleep_until(deadline);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Some(v));
        }
        Pin::new(&mut timeout).poll(cx).map(|()| None)
    })
    .await
}

/// A counter that waiters watch (see the module text).
#[derive(Default)]
pub struct Signal {
    epoch: AtomicU64,
    wakers: Mutex<Vec<Waker>>,
}

impl Signal {
    /// The value to wait past.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Moves the counter on and wakes every waiter.
    pub fn notify(&self) {
        let wakers = {
            let mut g = self.wakers.locked();
            self.epoch.fetch_add(1, Ordering::AcqRel);
            std::mem::take(&mut *g)
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Resolves once the counter is past `seen`, or at `deadline`; true if it moved.
    pub async fn changed(&self, seen: u64, deadline: Instant) -> bool {
        let mut timeout = sleep_until(deadline);
        std::future::poll_fn(|cx| {
            if self.epoch() != seen {
                return Poll::Ready(true);
            }
            {
                let mut g = self.wakers.locked();
                // Checked again under the lock `notify` takes: a notify cannot slip between.
                if self.epoch() != seen {
                    return Poll::Ready(true);
                }
                if !g.iter().any(|w| w.will_wake(cx.waker())) {
                    g.push(cx.waker().clone());
                }
            }
            match Pin::new(&mut timeout).poll(cx) {
                Poll::Ready(()) => Poll::Ready(self.epoch() != seen),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::block_on;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn sleeps_until_its_deadline_not_before() {
        let start = Instant::now();
        let at = start + Duration::from_millis(30);
        block_on(sleep_until(at));
        assert!(Instant::now() >= at);
    }

    #[test]
    fn many_deadlines_fire_in_any_order_of_arming() {
        let start = Instant::now();
        let hs: Vec<_> = [50u64, 10, 30, 20, 40]
            .into_iter()
            .map(|ms| {
                std::thread::spawn(move || {
                    let at = start + Duration::from_millis(ms);
                    block_on(sleep_until(at));
                    assert!(Instant::now() >= at);
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
    }

    #[test]
    fn a_signal_wakes_its_waiter_before_the_deadline() {
        let s = Arc::new(Signal::default());
        let seen = s.epoch();
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            block_on(s2.changed(seen, Instant::now() + Duration::from_secs(60)))
        });
        // The waiter may or may not have registered yet: both orders must end in `true`.
        s.notify();
        assert!(t.join().unwrap());
    }

    #[test]
    fn within_gives_up_on_a_future_that_never_ends() {
        let dl = Instant::now() + Duration::from_millis(20);
        assert_eq!(block_on(within(dl, std::future::pending::<u8>())), None);
        assert!(Instant::now() >= dl);
        assert_eq!(block_on(within(dl, async { 7 })), Some(7));
    }

    #[test]
    fn a_quiet_signal_times_out() {
        let s = Signal::default();
        let dl = Instant::now() + Duration::from_millis(20);
        assert!(!block_on(s.changed(s.epoch(), dl)));
        assert!(Instant::now() >= dl);
    }
}
