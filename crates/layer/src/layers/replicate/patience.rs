//! Riding out replicas that are away: no error reaches the application while a quorum can
//! still be had within the layer's timeout.
//!
//! A change goes first to every replica that is up. When fewer than a quorum took it and the
//! others failed only because they could not be reached (down, restarting, a connection lost
//! mid-request), the layer waits — polling the replicas' state every 50 ms, which keeps their
//! reconnects going — until enough are back, sends the change again to the ones that missed
//! it, and repeats until it has a quorum or its timeout (default 30 s, like an NFS hard
//! mount) has passed; then the caller sees `ENOTCONN`. A change that already has its quorum
//! never waits: a replica that is away is marked as having missed it, and heal brings it up
//! to date later. Reads and lookups that find no replica at all wait the same way.
//!
//! Sending a change again is safe: writes and attribute changes are idempotent at their
//! offset, and the protocol-client repeats name changes by the rules in
//! `kiln_client::replay`. A replica that answers the repeat with an error (a name change
//! that landed the first time: `ENOENT`, `EEXIST`) counts as having missed it and is healed.

use std::time::{Duration, Instant};

use super::{bit, Replicate};
use crate::exec::join_all;
use crate::timer::sleep_until;
use crate::{errno, Errno, FopResult, Fut};

/// How long a change waits for a quorum by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a waiting fop looks at its replicas again.
const POLL: Duration = Duration::from_millis(50);

/// True for an errno that says "could not reach the replica", not "the replica refused".
pub(super) fn unreachable(e: Errno) -> bool {
    e == errno::ENOTCONN || e == super::ESTALE || e == errno::ECONNRESET
}

impl Replicate {
    /// Sets how long a change waits for a quorum to come back (`None`: the default, 30 s).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Replicate {
        self.timeout = timeout.unwrap_or(DEFAULT_TIMEOUT);
        self
    }

    /// Waits until `done` (a set of replicas) and — unless `only_done` — the replicas that
    /// are up make `need`, or `deadline` passes; true if they do.
    async fn wait_for(&self, done: u32, only_done: bool, need: usize, deadline: Instant) -> bool {
        loop {
            // A new brick counts for nothing until it is rebuilt.
            let have = (0..self.kids.len())
                .filter(|i| done & bit(*i) != 0 || (!only_done && self.kids[*i].up()))
                .filter(|i| !self.kids[*i].joining())
                .count();
            if have >= need {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            sleep_until((now + POLL).min(deadline)).await;
        }
    }

    /// Runs a change with `run` (replica index → its fop) on every replica that is up, then
    /// again on those that could not be reached, while a quorum is missing and time is left.
    /// A replica that took the change while this client still knows it as new (its rebuild
    /// ended, and the graph counting it came, before the client asked it again) counts once
    /// the client learns it is a member: the change waits for that too.
    /// Each replica's last outcome (`None`: never reached).
    pub(super) async fn on_quorum<'b, T: Send + 'b>(
        &'b self,
        run: &(dyn Fn(usize) -> Fut<'b, T> + Send + Sync),
    ) -> Vec<Option<FopResult<T>>> {
        let futs = (0..self.kids.len())
            .map(|i| self.kids[i].up().then(|| run(i)))
            .collect();
        let mut res = join_all(futs).await;
        let mut deadline = None;
        let mut last_ok = 0;
        let mut rounds = 0;
        loop {
            let took = ok_set(&res);
            let ok = took & !self.joining_set();
            let lost: Vec<usize> = (0..res.len())
                .filter(|i| match &res[*i] {
                    None => true,
                    Some(Err(e)) => unreachable(*e),
                    Some(Ok(_)) => false,
                })
                .collect();
            // With none to send again, only the replicas that took it can make the quorum.
            let only_took = lost.is_empty();
            if ok.count_ones() as usize >= self.quorum
                || (only_took && (took == ok || (took.count_ones() as usize) < self.quorum))
            {
                return res;
            }
            let dl = *deadline.get_or_insert_with(|| Instant::now() + self.timeout);
            if rounds > 0 && ok == last_ok {
                if Instant::now() >= dl {
                    tracing::warn!(layer = self.name, "no quorum within {:?}", self.timeout);
                    return res;
                }
                // The last round gained nothing: a poll's pause before the next.
                sleep_until((Instant::now() + POLL).min(dl)).await;
            }
            last_ok = ok;
            rounds += 1;
            if !self.wait_for(took, only_took, self.quorum, dl).await {
                tracing::warn!(layer = self.name, "no quorum within {:?}", self.timeout);
                return res;
            }
            let futs = (0..self.kids.len())
                .map(|i| (lost.contains(&i) && self.kids[i].up()).then(|| run(i)))
                .collect();
            for (i, r) in join_all(futs).await.into_iter().enumerate() {
                if r.is_some() {
                    res[i] = r;
                }
            }
        }
    }

    /// After a query failed with `e`: true (after a poll's pause, and once a replica is up)
    /// when it should be tried again — no replica could be reached and time is left.
    pub(super) async fn again(&self, deadline: &mut Option<Instant>, e: Errno) -> bool {
        if !unreachable(e) {
            return false;
        }
        let now = Instant::now();
        let dl = *deadline.get_or_insert_with(|| now + self.timeout);
        if now >= dl {
            return false;
        }
        // A poll's pause first (a reconnect in progress finishes), then until a replica is up.
        sleep_until((now + POLL).min(dl)).await;
        self.wait_for(0, false, 1, dl).await
    }

    /// Runs a query (`attempt`), and again while it fails only because no replica could be
    /// reached and one may come back in time.
    pub(super) async fn patiently<'b, T: Send + 'b>(
        &'b self,
        attempt: impl Fn() -> Fut<'b, T>,
    ) -> FopResult<T> {
        let mut deadline = None;
        loop {
            match attempt().await {
                Err(e) if self.again(&mut deadline, e).await => {}
                Err(e) if unreachable(e) => return Err(errno::ENOTCONN),
                r => return r,
            }
        }
    }
}

/// The replicas whose outcome is a success.
fn ok_set<T>(res: &[Option<FopResult<T>>]) -> u32 {
    res.iter()
        .enumerate()
        .filter(|(_, r)| matches!(r, Some(Ok(_))))
        .fold(0, |b, (i, _)| b | bit(i))
}
