//! What a VM image asks of its brick beyond I/O: an exclusive lease and dirty records.
//!
//! **Lease** (an image's exclusive lock, [`kiln_proto::ops::LeaseReq`]): a holder — a name
//! unique per process, the asker — takes the lease on a file through its connections; from
//! then on, changes of the file's bytes (writes, truncation, fallocate, discard) made through
//! any *other* connection fail with `EBUSY` at the gate every change passes
//! ([`Marks::enter_as`]), until the lease is released: by the holder, or when the holder's
//! last connection hangs up. A holder that keeps its connections but stops renewing (a
//! partitioned process) keeps the lease until it lapses; then the next asker takes it, and
//! from that moment the old holder's connections are refused like any other: no write they
//! send later, queued or retried, lands after the new holder's first one. The takeover waits
//! for the old connections' changes already past the gate to finish, so none of them is still
//! running when the new holder hears it was granted. The same holder asking through another
//! connection (it reconnected; its client moved to a new graph) adds that connection, so a
//! brick restart or a graph change does not cost the holder its lease. Only the holder knows
//! its whole name: others are shown it up to its last `#`. Leases live in memory: a brick that
//! restarts has none until their holders renew (the old connections are gone with it, so
//! nothing they sent can land).
//!
//! **Dirty records** ([`kiln_proto::ops::DirtyReq`]): under a name, the ranges of a file that
//! changes reached since the record started — what an incremental backup must copy. Recorded at
//! the same gate, under the file's mutex, before the change runs (a change that then fails is
//! still counted: a backup copies a little more, never less). Heal's writes are not recorded
//! (they copy what a recorded write already changed). Records live in memory: after a brick
//! restart the name is unknown (`ENOENT`), which a backup must take as "everything changed".

use std::time::{Duration, Instant};

use kiln_proto::ops::{
    DirtyReq, ExtentList, LeaseState, DIRTY_GET, DIRTY_MAX, DIRTY_START, DIRTY_STOP, LEASE_ACQUIRE,
    LEASE_QUERY, LEASE_RELEASE, LEASE_TTL_MAX,
};
use kiln_proto::sync::MutexExt as _;

use crate::marks::{self as m, RangeSet};
use crate::{errno, FopResult};

use super::locks::Locker;
use super::{FileKey, FileState, Marks};

/// A file's lease.
pub(super) struct Lease {
    holder: String,
    /// The holder's connections (it asked through each): the only ones whose changes pass.
    owners: Vec<u64>,
    token: u64,
    expires: Instant,
}

/// The next lease token: starts at the wall clock (microseconds), so a restarted brick never
/// hands out a token it gave before.
static NEXT_TOKEN: std::sync::LazyLock<std::sync::atomic::AtomicU64> =
    std::sync::LazyLock::new(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_micros() as u64);
        std::sync::atomic::AtomicU64::new(now)
    });

/// `EBUSY`: another holder's lease keeps this change out.
pub(super) const EBUSY: u32 = libc::EBUSY as u32;

impl FileState {
    /// Whether a change of bytes through connection `owner` may pass the lease; if so, the
    /// range is added to every dirty record.
    pub(super) fn admit_change(&mut self, owner: u64, start: u64, end: u64) -> FopResult<()> {
        if self
            .lease
            .as_ref()
            .is_some_and(|l| !l.owners.contains(&owner))
        {
            return Err(EBUSY);
        }
        for (_, r) in &mut self.dirty {
            r.add(start, super::locks::len_of(start, end));
        }
        self.note_delta(start, end);
        Ok(())
    }

    /// The lease as its reply tells it to the asker `holder` (`fresh`: granted just now). To
    /// anyone else the holder's name is shown up to its last `#`: what follows is the holder's
    /// secret, which alone lets a connection move the lease to itself.
    fn lease_state(&self, holder: &str, now: Instant, fresh: bool) -> LeaseState {
        match &self.lease {
            Some(l) => {
                let granted = l.holder == holder;
                let shown = match l.holder.rsplit_once('#') {
                    Some((public, _)) if !granted => public.trim_end(),
                    _ => &l.holder,
                };
                LeaseState {
                    granted,
                    holder: shown.to_owned(),
                    remaining_ms: l.expires.saturating_duration_since(now).as_millis() as u32,
                    token: l.token,
                    fresh: granted && fresh,
                }
            }
            None => LeaseState::default(),
        }
    }
}

impl Marks {
    /// LEASE on `key` through connection `owner`.
    pub(super) async fn lease_req(
        key: &FileKey,
        owner: u64,
        cmd: u32,
        ttl_ms: u32,
        holder: &str,
        path: &str,
    ) -> FopResult<LeaseState> {
        if holder.is_empty() || holder.len() > 256 || ttl_ms == 0 || ttl_ms > LEASE_TTL_MAX {
            return Err(errno::EINVAL);
        }
        let ttl = Duration::from_millis(ttl_ms.into());
        match cmd {
            LEASE_QUERY => Ok(key.state().lease_state(holder, Instant::now(), false)),
            LEASE_RELEASE => {
                let mut st = key.state();
                if st.lease.as_ref().is_some_and(|l| l.holder == holder) {
                    st.lease = None;
                    tracing::info!(path, holder, "lease released");
                }
                let mut s = st.lease_state(holder, Instant::now(), false);
                s.granted = st.lease.is_none() || !s.granted;
                Ok(s)
            }
            LEASE_ACQUIRE => Marks::acquire(key, owner, ttl, holder, path).await,
            _ => Err(errno::EINVAL),
        }
    }

    /// Takes or renews the lease. A new grant fences first — from that moment other
    /// connections' changes are refused — then waits for those already past the gate to
    /// finish, and only then answers. The holder asking through another connection of its own
    /// (it reconnected, or its client moved to a new graph) adds that connection: its writes
    /// on either pass, and the lease goes when its last connection does.
    async fn acquire(
        key: &FileKey,
        owner: u64,
        ttl: Duration,
        holder: &str,
        path: &str,
    ) -> FopResult<LeaseState> {
        let fresh = {
            let mut st = key.state();
            let now = Instant::now();
            match st.lease.as_mut() {
                Some(l) if l.holder == holder => {
                    l.expires = now + ttl;
                    if !l.owners.contains(&owner) {
                        tracing::info!(
                            path,
                            holder,
                            "lease shared with the holder's new connection"
                        );
                        l.owners.push(owner);
                    }
                    return Ok(st.lease_state(holder, now, false));
                }
                Some(l) if l.expires > now => return Ok(st.lease_state(holder, now, false)),
                old => {
                    if let Some(old) = old {
                        tracing::warn!(path, holder, old = old.holder, "lease lapsed: taken over");
                    }
                    let token = NEXT_TOKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    st.lease = Some(Lease {
                        holder: holder.to_owned(),
                        owners: vec![owner],
                        token,
                        expires: now + ttl,
                    });
                    true
                }
            }
        };
        loop {
            let notified = key.changed.notified();
            let busy = {
                let mut st = key.state();
                if st.lease.as_ref().is_none_or(|l| l.holder != holder) {
                    // Released meanwhile (its connection hung up): ask again.
                    return Ok(st.lease_state(holder, Instant::now(), false));
                }
                let busy = st
                    .inflight
                    .iter()
                    .any(|w| !w.heal && !w.ns && w.owner != owner);
                if !busy {
                    return Ok(st.lease_state(holder, Instant::now(), fresh));
                }
                st.lockers += 1;
                busy
            };
            // Counted: changes leaving wake us.
            let _counted = busy.then_some(Locker(key));
            let _ = tokio::time::timeout(m::LOCK_LEASE, notified).await;
        }
    }

    /// The file at `path` (or, for a directory, every file under it) was replaced, removed or
    /// moved: its dirty records no longer describe what is there (asking one answers
    /// `ENOENT`: copy everything).
    pub(super) fn forget_dirty(&self, path: &str) {
        let files = self.files.locked();
        // A directory's name too: a record is kept by path, and a file made later at an old
        // path must not take over the record of the one that moved away.
        let under = format!("{}/", path.trim_end_matches('/'));
        for (p, k) in files.iter() {
            if p == path || p.starts_with(&under) {
                k.state().dirty.clear();
            }
        }
    }

    /// Drops the leases held, and lifts the barriers raised, through connection `owner` (it
    /// hung up).
    pub(super) fn drop_leases(&self, owner: u64) {
        let files = self.files.locked();
        for (path, key) in files.iter() {
            let mut st = key.state();
            if st.lift_barrier(owner) {
                tracing::info!(path, "snapshot barrier lifted: its connection is gone");
                key.changed.notify_waiters();
            }
            if let Some(l) = st.lease.as_mut() {
                l.owners.retain(|o| *o != owner);
                if l.owners.is_empty() {
                    let l = st.lease.take().expect("checked");
                    tracing::info!(
                        path,
                        holder = l.holder,
                        "lease released: its connections are gone"
                    );
                }
            }
        }
    }

    /// DIRTY on `key`.
    pub(super) fn dirty_req(key: &FileKey, req: &DirtyReq) -> FopResult<ExtentList> {
        if req.name.is_empty() || req.name.len() > 256 {
            return Err(errno::EINVAL);
        }
        let mut st = key.state();
        if st.sealed && req.cmd != DIRTY_GET {
            return Err(errno::ENOTCONN);
        }
        let at = st.dirty.iter().position(|(n, _)| *n == req.name);
        match (req.cmd, at) {
            (DIRTY_START, Some(i)) => st.dirty[i].1 = RangeSet::default(),
            (DIRTY_START, None) if st.dirty.len() >= DIRTY_MAX => return Err(libc::ENOSPC as u32),
            (DIRTY_START, None) => st.dirty.push((req.name.clone(), RangeSet::default())),
            (DIRTY_STOP, Some(i)) => {
                st.dirty.remove(i);
            }
            (DIRTY_GET, Some(i)) => return Ok(st.dirty[i].1.runs(req.offset, req.len)),
            (DIRTY_STOP | DIRTY_GET, None) => return Err(errno::ENOENT),
            _ => return Err(errno::EINVAL),
        }
        Ok(ExtentList::default())
    }
}
