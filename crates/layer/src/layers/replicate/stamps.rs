//! Stamps on a file's changes ([`kiln_proto::stamp`]): each change of a file's bytes this
//! client sends to the replicas carries the same stamp to each, so that a snapshot can find a
//! change one replica has not run yet although another has — one still on its way there, which
//! no barrier sees (see `snaps`).

use std::collections::hash_map::{HashMap, RandomState};
use std::collections::{BTreeSet, HashSet};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use kiln_proto::stamp::{SnapReply, Stamp};
use kiln_proto::sync::MutexExt as _;

use crate::marks::{self as m, RangeSet};
use crate::Ctx;

/// Hands out the stamps of one file's changes from this client.
pub(super) struct Stamper {
    writer: u64,
    /// The next sequence number, and those handed out whose change is not settled yet.
    open: Mutex<(u64, BTreeSet<u64>)>,
}

impl Default for Stamper {
    fn default() -> Stamper {
        static N: AtomicU64 = AtomicU64::new(0);
        // Distinct across clients (the process's random hash keys) and files (the counter).
        let writer = RandomState::new().hash_one(N.fetch_add(1, Relaxed));
        Stamper {
            writer,
            open: Mutex::new((1, BTreeSet::new())),
        }
    }
}

/// A change in flight: settled (every replica ran it, or its miss is marked) when dropped.
pub(super) struct Open<'a> {
    stamper: &'a Stamper,
    seq: u64,
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        let mut o = self.stamper.open.locked();
        o.1.remove(&self.seq);
    }
}

impl Stamper {
    /// Stamps a change: `cx` with the change's stamp, and what settles it when dropped.
    pub(super) fn begin(&self, cx: &Ctx) -> (Ctx, Open<'_>) {
        let (seq, done) = {
            let mut o = self.open.locked();
            let seq = o.0;
            o.0 += 1;
            let done = o.1.first().copied().unwrap_or(seq);
            o.1.insert(seq);
            (seq, done)
        };
        let stamp = Stamp {
            writer: self.writer,
            seq,
            done,
        };
        let cx = Ctx {
            change: Some(stamp),
            ..cx.clone()
        };
        (cx, Open { stamper: self, seq })
    }
}

/// For each replica's answer to `SNAP_TAKE`, the ranges of stamped changes its copy lacks
/// although another replica's holds them: a change listed by one replica that another neither
/// lists nor has settled below its `done`.
pub(super) fn lacking(replies: &[&SnapReply]) -> Vec<RangeSet> {
    // Per writer, per replica: its done and the changes it listed.
    let mut by_writer: HashMap<u64, Vec<(u64, HashSet<u64>)>> = HashMap::new();
    for (i, r) in replies.iter().enumerate() {
        for w in &r.writers.0 {
            let e = by_writer
                .entry(w.writer)
                .or_insert_with(|| vec![(0, HashSet::new()); replies.len()]);
            e[i] = (w.done, w.ran.0.iter().map(|c| c.seq).collect());
        }
    }
    let mut out = vec![RangeSet::default(); replies.len()];
    for r in replies {
        for w in &r.writers.0 {
            let seen = &by_writer[&w.writer];
            for c in &w.ran.0 {
                let len = if c.len == 0 { m::WHOLE } else { c.len };
                for (j, (done, ran)) in seen.iter().enumerate() {
                    if c.seq >= *done && !ran.contains(&c.seq) {
                        out[j].add(c.offset, len);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_proto::codec::Seq;
    use kiln_proto::stamp::{Ran, WriterRan};

    /// A writer's changes as a brick lists them: (writer, done, [(seq, offset, len)]).
    type Listed<'a> = (u64, u64, &'a [(u64, u64, u64)]);

    fn reply(writers: &[Listed<'_>]) -> SnapReply {
        SnapReply {
            writers: Seq(writers
                .iter()
                .map(|(writer, done, ran)| WriterRan {
                    writer: *writer,
                    done: *done,
                    ran: Seq(ran
                        .iter()
                        .map(|(seq, offset, len)| Ran {
                            seq: *seq,
                            offset: *offset,
                            len: *len,
                        })
                        .collect()),
                })
                .collect()),
            ..SnapReply::default()
        }
    }

    #[test]
    fn a_change_one_replica_has_not_run_is_found() {
        // Writer 1: replicas 0 and 1 ran change 5 (bytes 4096..8192), replica 2 not yet.
        // Change 4 ran everywhere: replica 1, told it is settled (done 5), lists it no more.
        let a = reply(&[(1, 4, &[(4, 0, 10), (5, 4096, 4096)])]);
        let b = reply(&[(1, 5, &[(5, 4096, 4096)])]);
        let c = reply(&[(1, 4, &[(4, 0, 10)])]);
        let l = lacking(&[&a, &b, &c]);
        assert!(l[0].is_empty() && l[1].is_empty());
        assert_eq!(l[2].iter().collect::<Vec<_>>(), vec![(4096, 4096)]);
    }

    #[test]
    fn a_replica_that_never_saw_the_writer_lacks_its_changes() {
        // Replica 2 ran nothing of writer 9 (a size change: to the end); writer 3 is alike.
        let a = reply(&[(9, 1, &[(1, 100, 0)]), (3, 2, &[(2, 0, 1)])]);
        let c = reply(&[(3, 2, &[(2, 0, 1)])]);
        let l = lacking(&[&a, &a, &c]);
        assert!(l[0].is_empty() && l[1].is_empty());
        assert_eq!(l[2].iter().collect::<Vec<_>>(), vec![(100, m::WHOLE)]);
        assert!(lacking(&[&c, &c, &c]).iter().all(|s| s.is_empty()));
    }
}
