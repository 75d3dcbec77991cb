//! What each client connection changed lately, kept so that a connection that ends without
//! releasing its handles — its client was killed, or its host lost — leaves *suspect* marks.
//!
//! A client sends a change to every replica at once; killed mid-way, it may have reached
//! some replicas and not others, and it lives no longer to mark the miss. No replica can tell
//! which of them is right, only that the bytes may differ: so when the connection ends, each
//! brick records what that connection changed lately as marks against [`m::ANY`] — "some
//! replica may differ here" — and heal ([`crate::heal`]) turns them into ordinary marks from
//! one replica every reader agrees on, then copies. Until then readers read that replica
//! only ([`crate::replicate`]), so no read before the heal is contradicted by one after it.
//!
//! **Bytes**: every change through a handle (write, fallocate, discard, a size change) adds
//! its range to the handle's record, under the file's state mutex the change takes anyway.
//! A handle released normally drops its record: its changes were answered, on every replica
//! it reached, before its client let go. Only recent changes matter (one still in flight on
//! some replica when the client died), so a record keeps two generations of [`WINDOW`] each,
//! and coarsens its ranges (to [`GRAIN`] and then wider) rather than grow past [`MOST`].
//!
//! **Names**: a change of a name or of attributes by path (create, mkdir, unlink, rename,
//! link, setattr, xattrs) adds the name to the connection's record of the last [`NAME_WINDOW`]
//! twice over (or of its last [`MOST_NAMES`] names, if fewer), which becomes [`m::ENTRY`]
//! suspect flags. Heal compares such a name on every
//! replica and heals only those that differ (`crate::heal::suspect`): a client that simply
//! went away costs a lookup per name it touched in the last seconds.

use std::time::{Duration, Instant};

use crate::marks::{self as m, RangeSet};
use kiln_proto::sync::MutexExt as _;

use super::*;

/// How long one generation of a handle's record lasts: a change stays in the record between
/// one and two of these after it began.
pub(super) const WINDOW: Duration = Duration::from_secs(60);
/// The same for names: their changes are one small request, never queued long.
pub(super) const NAME_WINDOW: Duration = Duration::from_secs(10);
/// Ranges are recorded at least this coarse.
pub(super) const GRAIN: u64 = 64 << 10;
/// Most ranges a generation keeps; past it, the ranges are widened until a quarter remain.
pub(super) const MOST: usize = 1024;
/// Most names a connection's record keeps per generation; past it a new generation begins
/// early (the names that matter are the last ones: those a dying client had in flight).
pub(super) const MOST_NAMES: usize = 16384;

/// The recent changes through one client handle.
pub(super) struct Recent {
    /// The handle's id ([`MarkFd::id`]).
    pub(super) fd: u64,
    /// Its connection.
    pub(super) owner: u64,
    cur: RangeSet,
    prev: RangeSet,
    since: Instant,
    grain: u64,
}

impl Recent {
    fn new(fd: u64, owner: u64, now: Instant) -> Recent {
        Recent {
            fd,
            owner,
            cur: RangeSet::default(),
            prev: RangeSet::default(),
            since: now,
            grain: GRAIN,
        }
    }

    fn note(&mut self, start: u64, end: u64, now: Instant) {
        if now.duration_since(self.since) >= WINDOW {
            self.prev = std::mem::take(&mut self.cur);
            self.since = now;
            if self.prev.is_empty() {
                self.grain = GRAIN;
            }
        }
        let g = self.grain;
        let a = start / g * g;
        let b = if end == u64::MAX {
            u64::MAX
        } else {
            end.div_ceil(g).saturating_mul(g)
        };
        self.cur.add(a, locks::len_of(a, b));
        while self.cur.count() > MOST {
            self.grain = self.grain.saturating_mul(16);
            self.cur = widen(&self.cur, self.grain);
        }
    }

    /// Both generations, as they stand at `now`: a generation older than two windows is
    /// gone, as if a change had come and rotated it out.
    pub(super) fn ranges(&self, now: Instant) -> RangeSet {
        let age = now.saturating_duration_since(self.since);
        let mut all = RangeSet::default();
        if age >= 2 * WINDOW {
            return all;
        }
        if age < WINDOW {
            all = self.prev.clone();
        }
        for (o, l) in self.cur.iter() {
            all.add(o, l);
        }
        all
    }
}

/// `set` with every range widened to multiples of `grain`.
fn widen(set: &RangeSet, grain: u64) -> RangeSet {
    let mut out = RangeSet::default();
    for (o, l) in set.iter() {
        let a = o / grain * grain;
        let len = if l == m::WHOLE {
            m::WHOLE
        } else {
            (o + l).div_ceil(grain).saturating_mul(grain) - a
        };
        out.add(a, len);
    }
    out
}

/// Records a change of `[start, end)` through handle `fd` of connection `owner`, under the
/// file's state mutex.
pub(super) fn note(st: &mut FileState, fd: u64, owner: u64, start: u64, end: u64) {
    let now = Instant::now();
    let i = match st.recent.iter().position(|r| r.fd == fd) {
        Some(i) => i,
        None => {
            st.recent.push(Recent::new(fd, owner, now));
            st.recent.len() - 1
        }
    };
    st.recent[i].note(start, end, now);
}

/// The names one connection changed lately.
#[derive(Default)]
pub(super) struct Names {
    cur: Vec<String>,
    prev: Vec<String>,
    since: Option<Instant>,
}

impl Names {
    pub(super) fn note(&mut self, path: &str) {
        let now = Instant::now();
        let old = self
            .since
            .is_none_or(|s| now.duration_since(s) >= NAME_WINDOW);
        if old || self.cur.len() >= MOST_NAMES {
            self.prev = std::mem::take(&mut self.cur);
            self.since = Some(now);
        }
        if self.cur.last().is_none_or(|l| l != path) {
            self.cur.push(path.to_owned());
        }
    }

    /// The suspect names at `now`, each once: those of the last [`NAME_WINDOW`] twice over,
    /// however long ago the last change came (a client's names from the start of a long run
    /// are no longer in doubt when it ends).
    fn suspects(self, now: Instant) -> Vec<String> {
        let age = self
            .since
            .map_or(Duration::MAX, |s| now.saturating_duration_since(s));
        let mut all = Vec::new();
        if age < NAME_WINDOW {
            all = self.prev;
        }
        if age < 2 * NAME_WINDOW {
            all.extend(self.cur);
        }
        all.sort_unstable();
        all.dedup();
        all
    }
}

impl Marks {
    /// Adds `path` (and `also`) to connection `owner`'s recent names.
    pub(super) fn note_names(&self, owner: u64, path: &str, also: Option<&str>) {
        if owner == 0 {
            return; // not a client connection (a brick's own or a test's work)
        }
        let mut names = self.names.locked();
        let n = names.entry(owner).or_default();
        n.note(path);
        if let Some(a) = also {
            n.note(a);
        }
    }

    /// Connection `owner` said goodbye: nothing it changed is in doubt, so its records go.
    pub(super) fn forget_recent(&self, owner: u64) {
        let keys: Vec<Arc<FileKey>> = {
            let files = self.files.locked();
            files.values().cloned().collect()
        };
        for key in keys {
            key.state().recent.retain(|r| r.owner != owner);
        }
        self.names.locked().remove(&owner);
    }

    /// Connection `owner` ended: what it changed lately through handles it still held, and
    /// the names it changed lately, become suspect marks ([`m::ANY`]).
    pub(super) fn suspect_leftovers(&self, owner: u64) {
        let now = Instant::now();
        let mut ops: Vec<(u8, String, u32, u64, u64)> = Vec::new();
        let keys: Vec<(String, Arc<FileKey>)> = {
            let files = self.files.locked();
            files.iter().map(|(p, k)| (p.clone(), k.clone())).collect()
        };
        for (path, key) in keys {
            let mut st = key.state();
            let mut ranges = RangeSet::default();
            st.recent.retain(|r| {
                if r.owner != owner {
                    return true;
                }
                for (o, l) in r.ranges(now).iter() {
                    ranges.add(o, l);
                }
                false
            });
            drop(st);
            ops.extend(
                ranges
                    .iter()
                    .map(|(o, l)| (b'A', path.clone(), m::ANY, o, l)),
            );
        }
        let names = self.names.locked().remove(&owner);
        for p in names.map(|n| n.suspects(now)).unwrap_or_default() {
            ops.push((b'F', p, m::ANY, u64::from(m::ENTRY), 0));
        }
        if ops.is_empty() {
            return;
        }
        let ranges = ops.iter().filter(|o| o.0 == b'A').count();
        let names = ops.len() - ranges;
        if ranges > 0 {
            tracing::info!(
                connection = owner,
                ranges,
                names,
                "{}: a client connection ended holding handles it had written through \
                 lately: recorded as suspect, for heal to make the replicas agree",
                self.dir.display()
            );
        } else {
            tracing::debug!(
                connection = owner,
                names,
                "{}: names changed by an ended \
                 connection recorded as suspect",
                self.dir.display()
            );
        }
        let refs: Vec<(u8, &str, u32, u64, u64)> = ops
            .iter()
            .map(|(k, p, t, o, l)| (*k, p.as_str(), *t, *o, *l))
            .collect();
        if let Err(e) = self.apply(&refs) {
            tracing::error!(
                "{}: cannot record suspect marks for an ended connection (errno {e}): replicas \
                 may differ where it was writing until a full heal",
                self.dir.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_age_out_after_two_windows_even_without_a_later_change() {
        let t0 = Instant::now();
        let names = || {
            let mut n = Names::default();
            n.note("a");
            n.note("b");
            n
        };
        assert_eq!(names().suspects(t0), ["a", "b"]);
        assert_eq!(
            names().suspects(t0 + NAME_WINDOW),
            ["a", "b"],
            "one window on"
        );
        assert!(names()
            .suspects(t0 + 2 * NAME_WINDOW + Duration::from_millis(5))
            .is_empty());

        let mut r = Recent::new(1, 7, t0);
        r.note(0, 4096, t0);
        assert_eq!(r.ranges(t0).count(), 1);
        assert_eq!(r.ranges(t0 + WINDOW).count(), 1, "one window on");
        assert_eq!(r.ranges(t0 + 2 * WINDOW).count(), 0, "two windows on");
    }
}
