//! Which stamped changes this brick ran on a file ([`kiln_proto::stamp`]): kept per writer
//! from the highest `done` the writer sent on, so that a snapshot can tell, across replicas,
//! a change one replica has not run yet although another has.
//!
//! Bounded: at most [`MAX_WRITERS`] writers per file and [`MAX_RAN`] changes per writer. A
//! writer idle for [`IDLE`] is forgotten first (none of its changes can still be on its way to
//! another replica); forgetting anything else makes the file's records `lost` for [`IDLE`],
//! and a snapshot taken meanwhile is refused rather than compared on what was forgotten.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kiln_proto::codec::Seq;
use kiln_proto::stamp::{Ran, Stamp, WriterRan};

/// Most writers kept per file.
pub(super) const MAX_WRITERS: usize = 64;
/// Most changes kept per writer: far above what a client has in flight on one file.
pub(super) const MAX_RAN: usize = 1024;
/// Most changes a snapshot's answer lists (its arguments stay within a frame's limit).
const MAX_REPORT: usize = 2048;
/// How long a writer's changes may still be on their way to another replica.
pub(super) const IDLE: Duration = Duration::from_secs(60);

/// One writer's changes run here.
struct Writer {
    writer: u64,
    done: u64,
    /// Sequence number → bytes `[start, end)` changed.
    ran: BTreeMap<u64, (u64, u64)>,
    last: Instant,
}

/// The stamped changes run on one file.
#[derive(Default)]
pub(super) struct RanLog {
    writers: Vec<Writer>,
    /// Until when records forgotten too early make the file's records incomplete.
    lost_until: Option<Instant>,
}

impl RanLog {
    /// Records change `s` of `[start, end)` as run here.
    pub(super) fn note(&mut self, s: &Stamp, start: u64, end: u64, now: Instant) {
        let i = match self.writers.iter().position(|w| w.writer == s.writer) {
            Some(i) => i,
            None => {
                self.make_room(now);
                self.writers.push(Writer {
                    writer: s.writer,
                    done: 0,
                    ran: BTreeMap::new(),
                    last: now,
                });
                self.writers.len() - 1
            }
        };
        let w = &mut self.writers[i];
        w.last = now;
        if s.done > w.done {
            w.done = s.done;
            while w.ran.first_key_value().is_some_and(|(k, _)| *k < s.done) {
                w.ran.pop_first();
            }
        }
        if s.seq < w.done {
            return;
        }
        if w.ran.len() >= MAX_RAN {
            w.ran.pop_first();
            self.lost_until = Some(now + IDLE);
        }
        w.ran.insert(s.seq, (start, end));
    }

    /// Makes room for one more writer: forgets those idle, then the least recently seen.
    fn make_room(&mut self, now: Instant) {
        if self.writers.len() < MAX_WRITERS {
            return;
        }
        self.writers.retain(|w| now.duration_since(w.last) < IDLE);
        if self.writers.len() >= MAX_WRITERS {
            if let Some(i) = (0..self.writers.len()).min_by_key(|i| self.writers[*i].last) {
                if !self.writers.swap_remove(i).ran.is_empty() {
                    self.lost_until = Some(now + IDLE);
                }
            }
        }
    }

    /// What a snapshot's answer says of the changes run here, and whether some were
    /// forgotten.
    pub(super) fn report(&self, now: Instant) -> (Seq<WriterRan>, bool) {
        let mut lost = self.lost_until.is_some_and(|t| now < t);
        let mut listed = 0;
        let mut out = Vec::with_capacity(self.writers.len());
        for w in &self.writers {
            listed += w.ran.len();
            if listed > MAX_REPORT {
                lost = true;
                break;
            }
            let ran = w.ran.iter().map(|(seq, (s, e))| Ran {
                seq: *seq,
                offset: *s,
                len: if *e == u64::MAX { 0 } else { e - s },
            });
            out.push(WriterRan {
                writer: w.writer,
                done: w.done,
                ran: Seq(ran.collect()),
            });
        }
        (Seq(out), lost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(writer: u64, seq: u64, done: u64) -> Stamp {
        Stamp { writer, seq, done }
    }

    #[test]
    fn changes_below_the_writers_done_are_forgotten() {
        let now = Instant::now();
        let mut log = RanLog::default();
        log.note(&stamp(1, 1, 1), 0, 10, now);
        log.note(&stamp(1, 2, 1), 10, 20, now);
        log.note(&stamp(1, 3, 3), 20, u64::MAX, now);
        // Late, below done: settled everywhere already, not kept.
        log.note(&stamp(1, 2, 1), 10, 20, now);
        let (w, lost) = log.report(now);
        assert!(!lost);
        assert_eq!(w.0.len(), 1);
        assert_eq!((w.0[0].writer, w.0[0].done), (1, 3));
        assert_eq!(
            w.0[0].ran.0,
            vec![Ran {
                seq: 3,
                offset: 20,
                len: 0
            }]
        );
    }

    #[test]
    fn forgetting_a_busy_writer_makes_the_records_lost_for_a_while() {
        let now = Instant::now();
        let mut log = RanLog::default();
        for w in 0..MAX_WRITERS as u64 {
            log.note(&stamp(w, 1, 1), 0, 1, now + Duration::from_millis(w));
        }
        assert!(!log.report(now).1);
        // Writer 0 is the least recently seen and has a change kept: forgetting it loses it.
        log.note(&stamp(999, 1, 1), 0, 1, now + Duration::from_secs(1));
        assert!(log.report(now + Duration::from_secs(1)).1);
        assert!(!log.report(now + IDLE + Duration::from_secs(2)).1);
        // Idle writers go without loss.
        let later = now + IDLE * 3;
        let mut log = RanLog::default();
        for w in 0..MAX_WRITERS as u64 {
            log.note(&stamp(w, 1, 1), 0, 1, now);
        }
        log.note(&stamp(999, 1, 1), 0, 1, later);
        let (w, lost) = log.report(later);
        assert!(!lost);
        assert_eq!(w.0.len(), 1);
    }

    #[test]
    fn too_many_changes_of_one_writer_make_the_records_lost() {
        let now = Instant::now();
        let mut log = RanLog::default();
        for seq in 1..=MAX_RAN as u64 {
            log.note(&stamp(1, seq, 1), 0, 1, now);
        }
        assert!(!log.report(now).1);
        log.note(&stamp(1, MAX_RAN as u64 + 1, 1), 0, 1, now);
        assert!(log.report(now).1);
    }
}
