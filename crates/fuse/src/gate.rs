//! How many FUSE threads wait on the kernel for the next request: two, whatever `--threads`.
//!
//! The kernel hands a request to the thread that has waited longest for one. With 16 threads
//! waiting, each request of a serial reader (`find | xargs cat`: LOOKUP, OPEN, RELEASE, one
//! after another) wakes a thread that has not run for a while, while the one that just answered
//! goes to sleep; or the answering thread finds the next request first and the woken one sleeps
//! again for nothing. A cold tree read made 7 context switches per file that way, against 4
//! with 2 threads.
//!
//! The threads are there so that requests waiting on a brick (a lookup, a write) do not hold
//! up the others. So a thread *holds a place* while it waits on the kernel or works on a
//! request, and gives it up when it is about to wait on a brick ([`block_on`], [`waiting`]),
//! waking a parked thread if no other waits on the kernel. A thread that has answered parks
//! (its answer sent) while another waits on the kernel and [`READERS`] hold places (see
//! [`State::parks`]). A serial workload then has two threads waiting on the kernel; a burst
//! (writes in flight, where every holder is at work) still gets up to `--threads` requests
//! waiting on bricks at once.
//!
//! A parked thread also goes back to the kernel after a second, and every parked thread does as
//! soon as any FUSE thread ends: at unmount they must see the session end too.

use std::cell::RefCell;
use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use kiln_proto::sync::MutexExt as _;

/// Threads holding places (waiting on the kernel, or working without waiting on a brick)
/// past which one that has answered parks.
pub(crate) const READERS: usize = 2;
/// A parked thread's longest sleep: it then waits on the kernel anyway.
const PARKED_MAX: Duration = Duration::from_secs(1);

/// One mount's places.
pub(crate) struct Gate {
    state: Mutex<State>,
    freed: Condvar,
}

struct State {
    /// Threads holding a place.
    held: usize,
    /// Of those, the ones working on a request (the others wait on the kernel).
    busy: usize,
    /// A FUSE thread ended (the session is over): nobody parks from now on.
    ended: bool,
}

impl State {
    /// A thread without a place parks while another waits on the kernel for the next request
    /// and `READERS` hold places: when none waits there (every holder is at work, as in a
    /// burst of writes), it goes back to the kernel, as without the gate.
    fn parks(&self) -> bool {
        self.held > self.busy && self.held >= READERS && !self.ended
    }
}

/// The FUSE thread's mount and whether it holds a place there; none on other threads.
struct Mine {
    gate: Arc<Gate>,
    holds: bool,
}

impl Drop for Mine {
    /// A FUSE thread ends only when the session does: the parked ones must go and see.
    fn drop(&mut self) {
        let mut s = self.gate.state();
        s.ended = true;
        self.gate.freed.notify_all();
    }
}

thread_local! {
    static MINE: RefCell<Option<Mine>> = const { RefCell::new(None) };
}

impl Gate {
    /// A gate for `threads` FUSE threads, all waiting on the kernel at first.
    pub fn new(threads: usize) -> Arc<Gate> {
        Arc::new(Gate {
            state: Mutex::new(State {
                held: threads,
                busy: 0,
                ended: false,
            }),
            freed: Condvar::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    /// A FUSE request starts on this thread; when the returned guard drops (its answer sent),
    /// the thread goes back to the kernel, or parks while enough others wait there.
    pub fn enter(self: &Arc<Self>) -> Entered {
        MINE.with(|m| {
            let mut m = m.borrow_mut();
            if m.is_none() {
                // First request on this thread: it held a place since it started.
                *m = Some(Mine {
                    gate: self.clone(),
                    holds: true,
                });
            }
        });
        self.state().busy += 1;
        Entered(())
    }

    /// This thread is about to wait on a brick; `held`: it gives its place up (it may have
    /// done so for an earlier wait of the same request). A parked thread is woken to take it
    /// only when no other thread waits on the kernel: waking one while another waits there
    /// would cost a context switch for nothing in a serial workload.
    fn blocks(&self, held: bool) {
        if !held {
            return;
        }
        let mut s = self.state();
        s.held = s.held.saturating_sub(1);
        s.busy = s.busy.saturating_sub(1);
        if s.held == s.busy {
            self.freed.notify_one();
        }
    }

    /// A thread has answered its request; `holds`: whether it holds a place. It goes back to
    /// the kernel, or parks first (see [`State::parks`]).
    fn settle(&self, holds: bool) {
        let mut s = self.state();
        if holds {
            s.busy = s.busy.saturating_sub(1);
            s.held -= 1; // taken again below, unless it parks
        }
        while s.parks() {
            let (next, waited) = self
                .freed
                .wait_timeout(s, PARKED_MAX)
                .unwrap_or_else(|e| e.into_inner());
            s = next;
            if waited.timed_out() {
                break;
            }
        }
        s.held += 1;
    }
}

/// A FUSE request in progress on this thread (see [`Gate::enter`]).
pub(crate) struct Entered(());

impl Drop for Entered {
    fn drop(&mut self) {
        let mine = MINE.with(|m| {
            let mut m = m.borrow_mut();
            let mine = m.as_mut()?;
            Some((mine.gate.clone(), std::mem::replace(&mut mine.holds, true)))
        });
        // The answer is sent: parking here holds nothing up.
        if let Some((gate, holds)) = mine {
            gate.settle(holds);
        }
    }
}

/// [`kiln_client::block_on`] on a FUSE thread: if `fut` has to wait, this thread gives its
/// place up first (see [`Gate::blocks`]), so the kernel's next request need not wait for it.
pub(crate) fn block_on<F: Future>(fut: F) -> F::Output {
    kiln_client::block_on_noting(fut, give_up)
}

/// This FUSE thread is about to wait on a brick and gives its place up, if it still holds
/// one (see [`Gate::blocks`]); nothing on other threads.
fn give_up() {
    MINE.with(|m| {
        if let Some(mine) = m.borrow_mut().as_mut() {
            mine.gate.blocks(std::mem::replace(&mut mine.holds, false));
        }
    })
}

/// Runs `wait`, which waits on a brick (a blocking write), having given this thread's place
/// up as [`block_on`] does.
pub(crate) fn waiting<T>(wait: impl FnOnce() -> T) -> T {
    give_up();
    wait()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a thread that acts as a FUSE thread of `gate` (its first request entered).
    fn fuse_thread<T: Send + 'static>(
        gate: &Arc<Gate>,
        f: impl FnOnce(&Arc<Gate>) -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let gate = gate.clone();
        std::thread::spawn(move || f(&gate))
    }

    /// A future pending until `go` is set (and its waker woken).
    fn until(
        go: Arc<(
            Mutex<Option<std::task::Waker>>,
            std::sync::atomic::AtomicBool,
        )>,
    ) -> impl Future<Output = ()> {
        std::future::poll_fn(move |cx| {
            if go.1.load(std::sync::atomic::Ordering::Acquire) {
                return std::task::Poll::Ready(());
            }
            *go.0.lock().unwrap() = Some(cx.waker().clone());
            if go.1.load(std::sync::atomic::Ordering::Acquire) {
                return std::task::Poll::Ready(());
            }
            std::task::Poll::Pending
        })
    }

    #[test]
    fn a_parked_thread_takes_over_when_none_is_left_on_the_kernel() {
        let gate = Gate::new(READERS + 1);
        // One thread too many: the first to answer parks.
        let (tx, rx) = std::sync::mpsc::channel();
        let parked = fuse_thread(&gate, move |g| {
            drop(g.enter());
            tx.send(()).unwrap();
        });
        // It stays parked while READERS hold places (well under PARKED_MAX).
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        assert_eq!(gate.state().held, READERS);
        // The READERS others wait on bricks, one after another: while one is still on the
        // kernel nobody is woken; when the last gives its place up, the parked thread takes it.
        let mut waiters = Vec::new();
        for left in (0..READERS).rev() {
            let go = Arc::new((Mutex::new(None), std::sync::atomic::AtomicBool::new(false)));
            let g = go.clone();
            let t = fuse_thread(&gate, move |gate| {
                let _e = gate.enter();
                block_on(until(g));
            });
            waiters.push((go, t));
            if left > 0 {
                while gate.state().held != left {
                    std::thread::yield_now();
                }
                assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
            }
        }
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the parked thread took the place given up");
        parked.join().unwrap();
        for (go, t) in waiters {
            go.1.store(true, std::sync::atomic::Ordering::Release);
            if let Some(k) = go.0.lock().unwrap().take() {
                k.wake();
            }
            t.join().unwrap();
        }
    }

    #[test]
    fn while_every_other_holder_is_at_work_nobody_parks() {
        // One more holder than READERS: one answering would park if another waited on the
        // kernel.
        let gate = Gate::new(READERS + 1);
        // READERS threads work on requests (not waiting on a brick) until told to answer.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let wait = Arc::new(Mutex::new(wait));
        let workers: Vec<_> = (0..READERS)
            .map(|_| {
                let w = wait.clone();
                fuse_thread(&gate, move |g| {
                    let _e = g.enter();
                    let _ = w.lock().unwrap().recv();
                })
            })
            .collect();
        while gate.state().busy != READERS {
            std::thread::yield_now();
        }
        // A burst: nobody waits on the kernel, so one answering goes straight back there.
        let t = std::time::Instant::now();
        fuse_thread(&gate, |g| drop(g.enter())).join().unwrap();
        assert!(t.elapsed() < PARKED_MAX / 2, "it did not park");
        for _ in &workers {
            go.send(()).unwrap();
        }
        for w in workers {
            w.join().unwrap();
        }
    }

    #[test]
    fn an_ended_fuse_thread_releases_the_parked_ones() {
        let gate = Gate::new(READERS + 2);
        let parked: Vec<_> = (0..2)
            .map(|_| fuse_thread(&gate, |g| drop(g.enter())))
            .collect();
        // A FUSE thread that ran a request ends, as at unmount.
        fuse_thread(&gate, |g| drop(g.enter())).join().unwrap();
        let t = std::time::Instant::now();
        for p in parked {
            p.join().unwrap();
        }
        assert!(
            t.elapsed() < PARKED_MAX,
            "released at once, not by the timeout"
        );
    }

    #[test]
    fn a_future_ready_at_once_keeps_the_place() {
        let gate = Gate::new(READERS);
        fuse_thread(&gate, |g| {
            let _e = g.enter();
            block_on(async {});
            assert!(MINE.with(|m| m.borrow().as_ref().unwrap().holds));
        })
        .join()
        .unwrap();
        assert_eq!(gate.state().held, READERS);
    }
}
