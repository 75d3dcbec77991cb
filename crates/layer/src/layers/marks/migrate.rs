//! Migration sessions: the brick's side of a rebalance moving a file to another subvolume
//! while clients keep it open.
//!
//! The mover (a rebalance's own connection) begins a session with [`m::SESSION_MIGRATE`]. Like
//! a heal session it records the ranges other connections change from then on (and those in
//! flight as it begins); unlike one, it never makes the mover's own changes skip what clients
//! touched. The mover copies the file to its new place, then asks for what clients changed
//! meanwhile ([`m::SESSION_DIRTY`], then HEAL_INFO) and copies that again, until little is
//! left. Then it freezes the file ([`m::SESSION_FREEZE`]): from then on every fop of another
//! connection on the file — through a handle, or by its name — fails with `EMOVED`, and the
//! freeze is answered once the changes already in flight have finished, so the last hand-over
//! after it is complete. The mover copies that, puts the copy in place, removes the name here
//! and marks the file moved for good ([`m::SESSION_MOVED`]): handles still open on it fail with
//! `EMOVED` for ever, and their clients reopen the file where it is now.
//!
//! For a while after a move ([`MOVED_NAMES_FOR`]) a lookup of the name here says `EMOVED`
//! rather than `ENOENT`: a client that looked on the destination just before the copy was
//! renamed into place, and here just after the name went, is told to look again instead of
//! being told the file does not exist. A name made here anew is forgotten at once.
//!
//! A change of the name itself (removed, renamed, replaced) while the move runs makes the freeze
//! and the mark fail with `ESTALE`: the copy is not of the file the name holds now.
//!
//! A freeze lives only as long as its session: a mover that dies lets its lease lapse, and the
//! file works here again as before.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::time::{Duration, Instant};

use crate::marks::{self as m};
use crate::{errno, FopResult};
use kiln_proto::sync::MutexExt as _;

use super::locks::Locker;
use super::*;

/// Stale: the name changed under a move.
const ESTALE: u32 = libc::ESTALE as u32;

/// How long a lookup of a moved name says `EMOVED`.
pub(super) const MOVED_NAMES_FOR: Duration = Duration::from_secs(10);

/// Names moved away lately, and until when a lookup of them says so.
#[derive(Default)]
pub(super) struct MovedNames {
    any: AtomicBool,
    names: Mutex<HashMap<String, Instant>>,
}

impl MovedNames {
    fn add(&self, path: &str) {
        let mut n = self.names.locked();
        n.insert(path.to_owned(), Instant::now() + MOVED_NAMES_FOR);
        self.any.store(true, SeqCst);
    }

    /// Whether `path` moved away lately. One relaxed load when nothing moved.
    pub(super) fn has(&self, path: &str) -> bool {
        if !self.any.load(Relaxed) {
            return false;
        }
        let mut n = self.names.locked();
        let now = Instant::now();
        n.retain(|_, until| *until > now);
        if n.is_empty() {
            self.any.store(false, SeqCst);
        }
        n.contains_key(path)
    }

    /// `path` names a file here again.
    pub(super) fn forget(&self, path: &str) {
        if self.any.load(Relaxed) {
            let mut n = self.names.locked();
            n.remove(path);
        }
    }
}

impl Marks {
    /// `Err(EMOVED)` when `owner` may not use the file now: it moved, or another connection's
    /// session froze it. One relaxed load when neither ever happened.
    pub(super) fn stopped(key: &FileKey, owner: u64) -> FopResult<()> {
        if key.moved.load(Relaxed) {
            return Err(errno::EMOVED);
        }
        if key.frozen.load(Relaxed) && Marks::frozen_for(&key.state(), owner) {
            return Err(errno::EMOVED);
        }
        Ok(())
    }

    /// Whether a live migration session of a connection other than `owner` is on the file.
    pub(super) fn moving(key: &FileKey, owner: u64) -> bool {
        let now = Instant::now();
        key.state()
            .sessions
            .iter()
            .any(|s| s.migrate && s.owner != owner && s.expires > now)
    }

    /// Whether a live session of a connection other than `owner` freezes the file.
    pub(super) fn frozen_for(st: &FileState, owner: u64) -> bool {
        let now = Instant::now();
        st.sessions
            .iter()
            .any(|s| s.frozen && s.owner != owner && s.expires > now)
    }

    /// SESSION_DIRTY: what clients changed since the last hand-over goes to the list HEAL_INFO
    /// returns.
    pub(super) fn dirty(&self, owner: u64, path: &str) -> FopResult<()> {
        let key = self.key(path);
        let mut st = key.state();
        let now = Instant::now();
        st.sessions.retain(|s| s.expires > now);
        let s = st
            .sessions
            .iter_mut()
            .find(|s| s.owner == owner && s.migrate)
            .ok_or(ETIMEDOUT)?;
        s.expires = now + m::LOCK_LEASE;
        for (o, l) in std::mem::take(&mut s.written).iter() {
            s.skipped.add(o, l);
        }
        Ok(())
    }

    /// SESSION_FREEZE: refuses other connections' fops on the file from now on, and waits for
    /// their changes in flight to finish.
    pub(super) async fn freeze(&self, owner: u64, path: &str) -> FopResult<()> {
        let key = self.key(path);
        {
            let mut st = key.state();
            let now = Instant::now();
            st.sessions.retain(|s| s.expires > now);
            let s = st
                .sessions
                .iter_mut()
                .find(|s| s.owner == owner && s.migrate)
                .ok_or(ETIMEDOUT)?;
            if s.touched & aspect::ENTRY != 0 {
                // Renamed, removed or replaced since the move began: not the file it copied.
                return Err(ESTALE);
            }
            s.expires = now + m::LOCK_LEASE;
            s.frozen = true;
            key.frozen.store(true, SeqCst);
        }
        loop {
            let notified = key.changed.notified();
            {
                let mut st = key.state();
                let busy = st.inflight.iter().any(|w| w.owner != owner && !w.heal);
                if !busy {
                    // What was in flight is recorded in the session: the next hand-over has it.
                    return Ok(());
                }
                // Counted, so that each change leaving wakes us (see `Marks::leave`).
                st.lockers += 1;
            }
            let _counted = Locker(&key);
            let _ = tokio::time::timeout(m::LOCK_LEASE, notified).await;
        }
    }

    /// SESSION_MOVED: the file is somewhere else now; its handles here fail from now on. The
    /// name no longer leads to this state (a file made anew under it is another file). Only
    /// under the caller's live freeze, the name untouched since the move began: a freeze that
    /// lapsed let clients change the file again, and the copy is not it any more.
    pub(super) fn moved(&self, owner: u64, path: &str) -> FopResult<()> {
        let key = self.key(path);
        {
            let mut st = key.state();
            let now = Instant::now();
            st.sessions.retain(|s| s.expires > now);
            let s = st
                .sessions
                .iter()
                .find(|s| s.owner == owner && s.migrate && s.frozen)
                .ok_or(ETIMEDOUT)?;
            if s.touched & aspect::ENTRY != 0 {
                return Err(ESTALE);
            }
            key.moved.store(true, SeqCst);
            st.sessions.retain(|s| s.owner != owner);
        }
        key.changed.notify_waiters();
        let mut files = self.files.locked();
        if files.get(path).is_some_and(|k| Arc::ptr_eq(k, &key)) {
            files.remove(path);
        }
        drop(files);
        self.moved.add(path);
        tracing::info!(
            "{}: {path} moved to another subvolume; its open handles here are told so",
            self.dir.display()
        );
        Ok(())
    }
}
