//! How a request ends: its completion, where it is delivered, and a refusal.

use std::any::Any;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Poll, Waker};

use kiln_proto::errno;
use kiln_proto::sync::MutexExt as _;

use super::Errno;

/// A successful reply: its encoded arguments and how many payload bytes landed in the sink.
#[derive(Debug, Default)]
pub struct ReplyData {
    /// The reply's encoded arguments.
    pub args: Vec<u8>,
    /// Payload bytes written into the request's sink vectors.
    pub payload_len: usize,
    /// Descriptors that came with the reply ([`kiln_proto::frame::FLAG_FDS`]).
    pub fds: Vec<std::os::fd::OwnedFd>,
}

/// What a request completes with. `keep` returns whatever the submitter asked the connection to
/// hold until completion (owned buffers).
pub struct Completion {
    /// The reply, or the errno it failed with.
    pub result: Result<ReplyData, Errno>,
    /// The object given to [`Conn::submit`] as `keep`.
    pub keep: Option<Box<dyn Any + Send>>,
    /// Set when the connection ended instead of the brick answering.
    pub lost: Option<Lost>,
}

/// How a request without a reply was lost with its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// Its frame never fully left: the brick cannot have run it.
    Unsent,
    /// Its frame left: the brick may or may not have run it.
    InDoubt,
}

/// A request [`Conn::submit`] did not take, with what it was to keep.
pub struct Refused {
    /// Why: `EMSGSIZE` for a frame over the limits, the connection's error once it is dead.
    pub errno: Errno,
    /// The `keep` given to `submit`, handed back.
    pub keep: Option<Box<dyn Any + Send>>,
}

impl From<Refused> for Errno {
    fn from(r: Refused) -> Errno {
        r.errno
    }
}

impl Refused {
    /// True when the request was refused because the connection is gone (it may be sent
    /// again on a new one).
    pub fn lost(&self) -> bool {
        self.errno != errno::EMSGSIZE
    }
}

/// A callback run on the receive thread when a request completes. It must not block for long:
/// every other reply on the connection waits behind it.
pub type Callback = Box<dyn FnOnce(Completion) + Send>;

/// Where a completion goes.
pub enum Done {
    /// Stored in a slot that a thread or future waits on.
    Slot(Arc<Slot>),
    /// Handed to a callback on the receive thread.
    Callback(Callback),
}

/// A single-use completion cell for a waiting thread or future.
#[derive(Default)]
pub struct Slot {
    state: Mutex<SlotState>,
    cv: Condvar,
}

#[derive(Default)]
struct SlotState {
    done: Option<Completion>,
    waker: Option<Waker>,
    /// A thread is blocked in [`Slot::wait`]: only then is the condition variable signalled
    /// (signalling it is a futex system call even with nobody waiting, on every request a
    /// future waits for).
    blocked: bool,
}

impl Slot {
    fn complete(&self, c: Completion) {
        let (waker, blocked) = {
            let mut s = self.state.locked();
            s.done = Some(c);
            (s.waker.take(), s.blocked)
        };
        if blocked {
            self.cv.notify_all();
        }
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Blocks the calling thread until the completion arrives.
    pub fn wait(&self) -> Completion {
        let mut s = self.state.locked();
        loop {
            if let Some(c) = s.done.take() {
                return c;
            }
            // Set under the lock that `complete` takes before it reads it: a completion after
            // this point sees it and signals.
            s.blocked = true;
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Polls for the completion from a future.
    pub fn poll(&self, waker: &Waker) -> Poll<Completion> {
        let mut s = self.state.locked();
        match s.done.take() {
            Some(c) => Poll::Ready(c),
            None => {
                if !s.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                    s.waker = Some(waker.clone());
                }
                Poll::Pending
            }
        }
    }
}

pub(super) fn deliver(done: Done, c: Completion) {
    match done {
        Done::Slot(s) => s.complete(c),
        Done::Callback(cb) => cb(c),
    }
}
