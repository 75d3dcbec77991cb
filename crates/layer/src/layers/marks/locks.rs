//! Heal locks and changes in flight: a lock waits for the writes under it, a write waits for
//! a lock over it; namespace changes wait the same way on their names.

use std::time::Instant;

use kiln_proto::stamp::Stamp;

use crate::marks::{self as m};
use crate::{fail, Ctx, Fd, FopResult, Fut};

use super::*;

pub(super) fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

pub(super) fn span(offset: u64, len: u64) -> (u64, u64) {
    if len == m::WHOLE {
        (offset, u64::MAX)
    } else {
        (offset, offset.saturating_add(len).max(offset + 1))
    }
}

/// `[start, end)` as (offset, len) for a [`RangeSet`].
pub(super) fn len_of(start: u64, end: u64) -> u64 {
    if end == u64::MAX {
        m::WHOLE
    } else {
        end - start
    }
}

/// A lock request waiting for changes in flight, counted in [`FileState::lockers`] until
/// dropped.
pub(super) struct Locker<'a>(pub(super) &'a FileKey);

impl Drop for Locker<'_> {
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.lockers = st.lockers.saturating_sub(1);
    }
}

/// A change registered in flight; leaves when dropped (also when its future is dropped).
pub(super) struct Entered<'a> {
    pub(super) key: &'a FileKey,
    pub(super) id: u64,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        Marks::leave(self.key, self.id);
    }
}

impl Entered<'_> {
    /// Leaves, recording the stamped change `[start, end)` that ran ([`super::ran`]) in the
    /// same hold of the file's state: a barrier that waits for the change finds it recorded.
    pub(super) fn leave_noting(self, s: &Stamp, start: u64, end: u64) {
        Marks::leave_noting(self.key, self.id, Some((s, start, end)));
        // Left already: the guard's own leave must not run again.
        std::mem::forget(self);
    }
}

impl Marks {
    /// Takes a heal lock, waiting for writes in flight and other connections' locks.
    pub(super) async fn lock(&self, owner: u64, path: &str, start: u64, end: u64) -> FopResult<()> {
        let key = self.key(path);
        loop {
            let notified = key.changed.notified();
            let (wait, busy) = {
                let mut st = key.state();
                let now = Instant::now();
                st.locks.retain(|l| l.expires > now);
                // A heal at work on the file (waiting for a lock counts) keeps its session.
                for s in st.sessions.iter_mut().filter(|s| s.owner == owner) {
                    s.expires = s.expires.max(now + m::LOCK_LEASE);
                }
                let blocked_by = st
                    .locks
                    .iter()
                    .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                    .map(|l| l.expires)
                    .min();
                let busy = st
                    .inflight
                    .iter()
                    .any(|w| w.owner != owner && overlap((w.start, w.end), (start, end)));
                if blocked_by.is_none() && !busy {
                    st.locks.push(Lock {
                        owner,
                        start,
                        end,
                        expires: now + m::LOCK_LEASE,
                    });
                    return Ok(());
                }
                if busy {
                    // Counted (under the mutex, so no leave is missed): writes in flight wake
                    // us as they leave.
                    st.lockers += 1;
                }
                let wait = blocked_by.map_or(m::LOCK_LEASE, |e| e.saturating_duration_since(now));
                (wait, busy)
            };
            let _counted = busy.then_some(Locker(&key));
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    pub(super) fn unlock(&self, owner: u64, path: &str, start: u64, end: u64) {
        let key = self.key(path);
        key.state()
            .locks
            .retain(|l| !(l.owner == owner && l.start == start && l.end == end));
        key.changed.notify_waiters();
        self.forget(path, &key);
    }

    /// Waits until `[start, end)` of the file is not locked by another connection (nor being
    /// written by another connection's heal), then registers a client change in flight there
    /// and records it in the file's heal sessions. Returns its id.
    pub(super) async fn enter(key: &FileKey, owner: u64, start: u64, end: u64) -> FopResult<u64> {
        Marks::enter_as(key, owner, start, end, true, None, 0).await
    }

    /// [`Marks::enter`] for a change through a client handle (`fd`, the id and connection of
    /// its [`MarkFd`]), which also adds the range to the handle's recent changes
    /// ([`super::recent`]) under the same mutex.
    pub(super) async fn enter_fd(
        key: &FileKey,
        owner: u64,
        fd: (u64, u64),
        start: u64,
        end: u64,
    ) -> FopResult<u64> {
        Marks::enter_as(key, owner, start, end, true, Some(fd), 0).await
    }

    /// A change of a name or of attributes (no bytes) that touches `aspects` ([`aspect`]):
    /// waits for heal's locks on the path and registers in flight (so a lock waits for it);
    /// other connections' heal sessions on the path record the aspects, not bytes.
    pub(super) async fn enter_ns(key: &FileKey, owner: u64, aspects: u32) -> FopResult<u64> {
        Marks::enter_as(key, owner, 0, u64::MAX, false, None, aspects).await
    }

    pub(super) async fn enter_as(
        key: &FileKey,
        owner: u64,
        start: u64,
        end: u64,
        record: bool,
        fd: Option<(u64, u64)>,
        aspects: u32,
    ) -> FopResult<u64> {
        loop {
            let notified = key.changed.notified();
            let wait = {
                let mut st = key.state();
                let mut wait = None;
                if key.moved.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(crate::errno::EMOVED);
                }
                if !st.locks.is_empty() || !st.sessions.is_empty() {
                    if Marks::frozen_for(&st, owner) {
                        return Err(crate::errno::EMOVED);
                    }
                    let now = Instant::now();
                    st.locks.retain(|l| l.expires > now);
                    st.sessions.retain(|s| s.expires > now);
                    wait = st
                        .locks
                        .iter()
                        .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                        .map(|l| l.expires.saturating_duration_since(now))
                        .min();
                    let healing = st.inflight.iter().any(|w| {
                        w.heal && w.owner != owner && overlap((w.start, w.end), (start, end))
                    });
                    if wait.is_none() && healing {
                        // Woken when the heal write leaves.
                        wait = Some(m::LOCK_LEASE);
                    }
                }
                if record && st.freeze.is_some() {
                    // Recorded even when a heal lock holds the change back too: it may have
                    // run on a replica frozen later.
                    if let Some(b) = st.barrier(owner, start, end) {
                        wait = Some(wait.map_or(b, |w: std::time::Duration| w.min(b)));
                    }
                }
                if record && st.sealed {
                    // The brick is stopping and kept the file's dirty records: the change
                    // waits for the end, unrecorded nowhere (its client sends it again to
                    // the brick's next run).
                    wait = Some(std::time::Duration::from_secs(3600));
                }
                match wait {
                    Some(w) => w,
                    None => {
                        if record {
                            st.admit_change(owner, start, end)?;
                        }
                        st.next += 1;
                        let id = st.next;
                        st.inflight.push(Inflight {
                            id,
                            owner,
                            start,
                            end,
                            heal: false,
                            ns: !record,
                        });
                        for s in st.sessions.iter_mut().filter(|s| s.owner != owner) {
                            if record {
                                s.written.add(start, len_of(start, end));
                            }
                            s.touched |= aspects;
                        }
                        if let Some((fd, fd_owner)) = fd {
                            super::recent::note(&mut st, fd, fd_owner, start, end);
                        }
                        return Ok(id);
                    }
                }
            };
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    /// Waits until `[start, end)` is not locked by another connection, then registers a heal
    /// write there and returns its id and the parts of the range no client changed since
    /// `owner`'s session began (the others are added to the session's skipped list). With
    /// `cut` (a size change from `start` on) it is all or nothing: `EAGAIN` if a client
    /// changed anything from `start` on. `ETIMEDOUT` without a live session.
    pub(super) async fn enter_heal(
        key: &FileKey,
        owner: u64,
        start: u64,
        end: u64,
        cut: bool,
    ) -> FopResult<(u64, Vec<(u64, u64)>)> {
        loop {
            let notified = key.changed.notified();
            let wait = {
                let mut st = key.state();
                let now = Instant::now();
                st.locks.retain(|l| l.expires > now);
                st.sessions.retain(|s| s.expires > now);
                let wait = st
                    .locks
                    .iter()
                    .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                    .map(|l| l.expires.saturating_duration_since(now))
                    .min();
                let wait = match (wait, st.barrier(owner, start, end)) {
                    (Some(w), Some(b)) => Some(w.min(b)),
                    (w, b) => w.or(b),
                };
                if wait.is_none() {
                    let st = &mut *st;
                    let Some(s) = st.sessions.iter_mut().find(|s| s.owner == owner) else {
                        return Err(ETIMEDOUT);
                    };
                    s.expires = now + m::LOCK_LEASE;
                    let len = len_of(start, end);
                    let keep = if cut {
                        if s.written.overlaps(start, m::WHOLE) {
                            return Err(EAGAIN);
                        }
                        vec![(start, len)]
                    } else {
                        for (o, l) in s.written.inside(start, len) {
                            s.skipped.add(o, l);
                        }
                        s.written.outside(start, len)
                    };
                    st.next += 1;
                    let id = st.next;
                    st.note_delta(start, end);
                    st.inflight.push(Inflight {
                        id,
                        owner,
                        start,
                        end,
                        heal: true,
                        ns: false,
                    });
                    return Ok((id, keep));
                }
                wait.unwrap_or(m::LOCK_LEASE)
            };
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    pub(super) fn leave(key: &FileKey, id: u64) {
        Marks::leave_noting(key, id, None);
    }

    /// [`Marks::leave`], recording first, if given, the stamped change that ran.
    pub(super) fn leave_noting(key: &FileKey, id: u64, ran: Option<(&Stamp, u64, u64)>) {
        let mut st = key.state();
        if let Some((s, start, end)) = ran {
            st.ran.note(s, start, end, Instant::now());
        }
        let mut heal = false;
        if let Some(i) = st.inflight.iter().position(|w| w.id == id) {
            heal = st.inflight.swap_remove(i).heal;
        }
        if heal || st.lockers > 0 || !st.locks.is_empty() {
            drop(st);
            key.changed.notify_waiters();
        }
    }

    /// Runs a change to `[start, end)` of an open file under the lock rules.
    pub(super) fn gated<'a, T: Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        start: u64,
        end: u64,
        call: impl FnOnce(&'a Fd) -> Fut<'a, T> + Send + 'a,
    ) -> Fut<'a, T> {
        let mfd = match unwrap(fd) {
            Ok(f) => f,
            Err(e) => return fail(e),
        };
        Box::pin(async move {
            let id = Marks::enter_fd(&mfd.key, cx.owner, (mfd.id, mfd.owner), start, end).await?;
            let entered = Entered { key: &mfd.key, id };
            let r = call(&mfd.inner).await;
            match (&r, &cx.change) {
                // Recorded while still in flight: a barrier raised meanwhile waits for it.
                (Ok(_), Some(s)) => entered.leave_noting(s, start, end),
                _ => drop(entered),
            }
            r
        })
    }

    /// Runs a change of names or attributes of `path` (and `also`: a rename's other name)
    /// once no other connection's heal lock holds them, registered in flight meanwhile (a heal
    /// lock waits for it). Costs, without locks, what a write's gate costs.
    ///
    /// `aspects` ([`aspect`]) is what the change touches. A heal's change within its
    /// session on the path is skipped with [`m::SKIPPED`] when a client touched any of them
    /// since the session began ([`super::sessions`]).
    pub(super) fn named<'a, T: Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        also: Option<&'a str>,
        aspects: u32,
        call: impl FnOnce() -> Fut<'a, T> + Send + 'a,
    ) -> Fut<'a, T> {
        self.note_names(cx.owner, path, also);
        Box::pin(async move {
            let key = self.key(path);
            let other = also.map(|p| (p, self.key(p)));
            let id = Marks::enter_ns(&key, cx.owner, aspects).await?;
            let first = Entered { key: &key, id };
            let second = match &other {
                Some((_, k)) => Some(Entered {
                    key: k,
                    id: Marks::enter_ns(k, cx.owner, aspects).await?,
                }),
                None => None,
            };
            let touched = Marks::touched(&key, cx.owner)
                | other
                    .as_ref()
                    .map_or(0, |(_, k)| Marks::touched(k, cx.owner));
            let r = if touched & aspects != 0 {
                Err(m::SKIPPED)
            } else {
                call().await
            };
            drop(second);
            drop(first);
            self.forget(path, &key);
            if let Some((p, k)) = &other {
                self.forget(p, k);
            }
            r
        })
    }
}
