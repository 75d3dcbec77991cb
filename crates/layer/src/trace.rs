//! Request waterfalls: a sampled request carries a [`Trace`] that every stage it passes through
//! stamps with the time, on both sides of the wire.
//!
//! Times are nanoseconds of `CLOCK_MONOTONIC`. The brick returns its stamps in the reply
//! ([`kiln_proto::ops::TraceBlock`]) with the name of its clock; when it matches the client's —
//! same host — all stamps go on one timeline and the gaps between consecutive stamps are the
//! stages, which add up to the end-to-end time by construction. Across hosts only durations
//! measured on one clock are used: the brick's stages are placed inside the client's wait for
//! the reply, and the remainder is shown as the wire (both directions, with the kernels' work).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_proto::sync::MutexExt as _;
use serde::{Deserialize, Serialize};

/// Now, in nanoseconds of the monotonic clock.
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A name for this host's monotonic clock: equal on two processes of the same boot.
pub fn clock_id() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        // FNV-1a: a stable hash, not a secret.
        boot.trim()
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            })
            .max(1)
    })
}

/// One stamp.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Nanoseconds on the monotonic clock of the side that took it.
    pub t_ns: u64,
    /// What happened, e.g. `client-top ↓` or `posix: storage call`.
    pub label: String,
    /// Taken on the brick, on a clock other than the client's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remote: bool,
}

/// The stamps of one sampled request.
///
/// A trace is finished by several parties — the request's completion, and the arrival of the
/// brick's stamps, which travel in a frame of their own after the reply — in any order; the last
/// one to finish logs it ([`Trace::part_done`]).
#[derive(Debug)]
pub struct Trace {
    events: Mutex<Vec<Event>>,
    /// Parties that have yet to finish; starts at 1 (the completion).
    parts: std::sync::atomic::AtomicU32,
}

impl Default for Trace {
    fn default() -> Trace {
        Trace {
            events: Mutex::default(),
            parts: std::sync::atomic::AtomicU32::new(1),
        }
    }
}

impl Trace {
    /// A new, empty trace.
    pub fn new() -> Arc<Trace> {
        Arc::new(Trace::default())
    }

    /// One more party will finish this trace (a brick that will send its stamps).
    pub fn expect_part(&self) {
        // Relaxed: the increment happens before the request is sent, which happens before any
        // party can finish; the AcqRel decrements order the stamps themselves.
        self.parts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A party is done with the trace; the last logs it to the process's [`TraceLog`].
    pub fn part_done(&self) {
        if self.parts.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            TraceLog::global().push(self);
        }
    }

    /// Stamps `label` now.
    pub fn stamp(&self, label: impl Into<String>) {
        self.stamp_at(now_ns(), label);
    }

    /// Stamps `label` at `t_ns`.
    pub fn stamp_at(&self, t_ns: u64, label: impl Into<String>) {
        let e = Event {
            t_ns,
            label: label.into(),
            remote: false,
        };
        self.events.locked().push(e);
    }

    /// Adds the brick's stamps from a reply.
    pub fn merge_remote(&self, block: &kiln_proto::ops::TraceBlock) {
        let remote = block.clock != clock_id();
        let mut ev = self.events.locked();
        ev.extend(block.events.0.iter().map(|e| Event {
            t_ns: e.t_ns,
            label: e.label.clone(),
            remote,
        }));
    }

    /// The stamps, for sending back over the wire.
    pub fn to_block(&self) -> kiln_proto::ops::TraceBlock {
        let ev = self.events.locked();
        kiln_proto::ops::TraceBlock {
            clock: clock_id(),
            events: kiln_proto::codec::Seq(
                ev.iter()
                    .map(|e| kiln_proto::ops::TraceEvent {
                        t_ns: e.t_ns,
                        label: e.label.clone(),
                    })
                    .collect(),
            ),
        }
    }

    /// The stamps taken so far, in the order taken.
    pub fn events(&self) -> Vec<Event> {
        self.events.locked().clone()
    }
}

/// The per-request context every fop receives.
#[derive(Debug, Default, Clone)]
pub struct Ctx {
    /// Present on sampled requests: every stage stamps it.
    pub trace: Option<Arc<Trace>>,
    /// Who issued the request, for layers that hold state per client (locks): on a brick,
    /// the connection's id; 0 when unknown.
    pub owner: u64,
    /// Whose request it is (uid, gid, groups): the posix layer runs its storage calls with
    /// these credentials. None: the process's own (internal work such as heal).
    pub cred: Option<Arc<kiln_proto::Cred>>,
    /// A replicated change's stamp ([`kiln_proto::stamp::Stamp`]): set by the replicate layer
    /// on changes of a file's bytes, carried to the bricks, recorded by their marks layer.
    pub change: Option<kiln_proto::stamp::Stamp>,
    /// The caller may make character and block device nodes (a capability of its identity);
    /// without it the posix layer refuses a device MKNOD that carries credentials.
    pub devices: bool,
    /// The subtree (relative to the brick root) the caller's identity is confined to: a path
    /// that reaches outside it through a symlink is refused where the posix layer resolves it.
    pub subtree: Option<Arc<str>>,
    /// The reader checks block checksums itself (a READ with [`kiln_proto::frame::FLAG_SUMS`]):
    /// a read answered from a file ships the sums ([`crate::ReadOut::File`]) instead of the
    /// brick reading the data to check it.
    pub ship_sums: bool,
}

impl Ctx {
    /// A context for an unsampled request.
    pub const NONE: Ctx = Ctx {
        trace: None,
        owner: 0,
        cred: None,
        change: None,
        devices: false,
        subtree: None,
        ship_sums: false,
    };

    /// A context carrying a new trace.
    pub fn traced() -> Ctx {
        Ctx {
            trace: Some(Trace::new()),
            owner: 0,
            cred: None,
            change: None,
            devices: false,
            subtree: None,
            ship_sums: false,
        }
    }

    /// The same context issued by `owner`.
    pub fn with_owner(self, owner: u64) -> Ctx {
        Ctx { owner, ..self }
    }

    /// The same context on behalf of `cred` (None: the process's own credentials).
    pub fn with_cred(self, cred: Option<Arc<kiln_proto::Cred>>) -> Ctx {
        Ctx { cred, ..self }
    }

    /// The same context with (or without) the capability to make device nodes.
    pub fn with_devices(self, devices: bool) -> Ctx {
        Ctx { devices, ..self }
    }

    /// Stamps `label` if the request is sampled. The label is built only then.
    #[inline]
    pub fn stamp(&self, label: impl FnOnce() -> String) {
        if let Some(t) = &self.trace {
            t.stamp(label());
        }
    }
}

/// A finished trace put on one timeline: consecutive stamps and the time between them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Timeline {
    /// Stage names (`from → to`), in order.
    pub stages: Vec<String>,
    /// Nanoseconds spent in each stage.
    pub ns: Vec<u64>,
}

impl Timeline {
    /// Orders a trace's events. Same-clock events are merged by time; a remote block is placed
    /// inside the client's gap between its last stamp before sending and its first after the
    /// reply, with the remainder named as the wire.
    pub fn from_events(events: &[Event]) -> Option<Timeline> {
        let (mut local, remote): (Vec<&Event>, Vec<&Event>) =
            events.iter().partition(|e| !e.remote);
        // Stable sort keeps record order for equal stamps.
        local.sort_by_key(|e| e.t_ns);
        let mut stages = Vec::new();
        let mut ns = Vec::new();
        if remote.is_empty() {
            for w in local.windows(2) {
                stages.push(stage_name(&w[0].label, &w[1].label));
                ns.push(w[1].t_ns.saturating_sub(w[0].t_ns));
            }
        } else {
            let mut remote = remote;
            remote.sort_by_key(|e| e.t_ns);
            // The client's wait spans "socket write" to "reply header".
            let sent = local.iter().position(|e| e.label == SENT)?;
            let back = local.iter().position(|e| e.label == REPLY_HEADER)?;
            if back <= sent {
                return None;
            }
            for w in local[..=sent].windows(2) {
                stages.push(stage_name(&w[0].label, &w[1].label));
                ns.push(w[1].t_ns - w[0].t_ns);
            }
            let wait = local[back].t_ns - local[sent].t_ns;
            let span = remote.last()?.t_ns - remote.first()?.t_ns;
            for w in remote.windows(2) {
                stages.push(stage_name(&w[0].label, &w[1].label));
                ns.push(w[1].t_ns - w[0].t_ns);
            }
            stages.push("wire, both ways (client wait − brick time)".into());
            ns.push(wait.saturating_sub(span));
            for w in local[back..].windows(2) {
                stages.push(stage_name(&w[0].label, &w[1].label));
                ns.push(w[1].t_ns - w[0].t_ns);
            }
        }
        Some(Timeline { stages, ns })
    }

    /// End to end: the sum of the stages.
    pub fn total_ns(&self) -> u64 {
        self.ns.iter().sum()
    }
}

/// Label the protocol client stamps when a request's frame is handed to `sendmsg`.
pub const SENT: &str = "socket write";
/// Label the protocol client stamps when the reply's header has been received.
pub const REPLY_HEADER: &str = "reply header received";

/// Names the stage between two stamps.
fn stage_name(from: &str, to: &str) -> String {
    let named = match (from, to) {
        (SENT, "brick: frame received") => Some("socket write + network + kernel, client → brick"),
        ("brick: reply write", REPLY_HEADER) => {
            Some("socket write + network + kernel, brick → client")
        }
        ("send queued", SENT) => Some("send queue"),
        ("brick: frame received", "brick: dispatch") => Some("brick dispatch queue"),
        ("brick: reply queued", "brick: reply write") => Some("brick reply queue"),
        ("posix: storage call", "posix: storage done") => Some("storage syscall"),
        (REPLY_HEADER, "reply received") => Some("client receive (args + payload)"),
        _ => None,
    };
    match named {
        Some(n) => format!("{n}  [{from} → {to}]"),
        None => format!("{from} → {to}"),
    }
}

/// Per-stage statistics over many timelines of the same shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Waterfall {
    /// Timelines summarised (those with the most common shape).
    pub samples: usize,
    /// Timelines seen in all.
    pub seen: usize,
    /// One row per stage, in order.
    pub stages: Vec<StageStats>,
    /// Median end-to-end nanoseconds.
    pub total_p50_ns: u64,
    /// 99th percentile end-to-end nanoseconds.
    pub total_p99_ns: u64,
}

/// One stage's numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageStats {
    /// `from → to`.
    pub stage: String,
    /// Median nanoseconds.
    pub p50_ns: u64,
    /// 99th percentile nanoseconds.
    pub p99_ns: u64,
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

impl Waterfall {
    /// Summarises timelines: the most common shape (stage sequence) wins.
    pub fn of(timelines: &[Timeline]) -> Option<Waterfall> {
        let mut shapes: HashMap<&[String], Vec<&Timeline>> = HashMap::new();
        for t in timelines {
            shapes.entry(&t.stages).or_default().push(t);
        }
        let (shape, group) = shapes.into_iter().max_by_key(|(_, g)| g.len())?;
        let mut stages = Vec::new();
        for (i, name) in shape.iter().enumerate() {
            let mut v: Vec<u64> = group.iter().map(|t| t.ns[i]).collect();
            v.sort_unstable();
            stages.push(StageStats {
                stage: name.clone(),
                p50_ns: pct(&v, 0.5),
                p99_ns: pct(&v, 0.99),
            });
        }
        let mut totals: Vec<u64> = group.iter().map(|t| t.total_ns()).collect();
        totals.sort_unstable();
        Some(Waterfall {
            samples: group.len(),
            seen: timelines.len(),
            stages,
            total_p50_ns: pct(&totals, 0.5),
            total_p99_ns: pct(&totals, 0.99),
        })
    }

    /// Sum of the stages' medians.
    pub fn sum_p50_ns(&self) -> u64 {
        self.stages.iter().map(|s| s.p50_ns).sum()
    }

    /// A table for people.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let w = self
            .stages
            .iter()
            .map(|s| s.stage.chars().count())
            .max()
            .unwrap_or(5)
            .max(10);
        let _ = writeln!(
            out,
            "{:<w$}  {:>10}  {:>10}  {:>6}",
            "stage", "median µs", "p99 µs", "%"
        );
        let sum = self.sum_p50_ns().max(1) as f64;
        for s in &self.stages {
            let _ = writeln!(
                out,
                "{:<w$}  {:>10.2}  {:>10.2}  {:>5.1}%",
                s.stage,
                s.p50_ns as f64 / 1e3,
                s.p99_ns as f64 / 1e3,
                s.p50_ns as f64 * 100.0 / sum
            );
        }
        let _ = writeln!(
            out,
            "{:<w$}  {:>10.2}\n{:<w$}  {:>10.2}  {:>10.2}\n({} of {} sampled requests had this shape)",
            "sum of stage medians",
            self.sum_p50_ns() as f64 / 1e3,
            "end to end",
            self.total_p50_ns as f64 / 1e3,
            self.total_p99_ns as f64 / 1e3,
            self.samples,
            self.seen
        );
        out
    }
}

/// Where finished traces of this process go: a bounded ring, newest kept.
#[derive(Default)]
pub struct TraceLog {
    ring: Mutex<std::collections::VecDeque<Timeline>>,
}

/// Traces kept per process.
pub const TRACE_LOG_MAX: usize = 20_000;

impl TraceLog {
    /// The process-wide log.
    pub fn global() -> &'static TraceLog {
        static LOG: OnceLock<TraceLog> = OnceLock::new();
        LOG.get_or_init(TraceLog::default)
    }

    /// Adds a finished trace.
    pub fn push(&self, t: &Trace) {
        if let Some(tl) = Timeline::from_events(&t.events()) {
            let mut r = self.ring.locked();
            if r.len() == TRACE_LOG_MAX {
                r.pop_front();
            }
            r.push_back(tl);
        }
    }

    /// Takes every trace logged so far.
    pub fn drain(&self) -> Vec<Timeline> {
        let mut r = self.ring.locked();
        r.drain(..).collect()
    }

    /// A copy of every trace logged so far.
    pub fn snapshot(&self) -> Vec<Timeline> {
        let r = self.ring.locked();
        r.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t: u64, l: &str, remote: bool) -> Event {
        Event {
            t_ns: t,
            label: l.into(),
            remote,
        }
    }

    #[test]
    fn same_clock_stages_add_up() {
        let e = vec![
            ev(0, "top ↓", false),
            ev(10, "send queued", false),
            ev(15, SENT, false),
            ev(40, "brick: frame received", false),
            ev(45, "brick: reply write", false),
            ev(70, REPLY_HEADER, false),
            ev(80, "top ↑", false),
        ];
        let t = Timeline::from_events(&e).unwrap();
        assert_eq!(t.total_ns(), 80);
        assert_eq!(t.stages.len(), 6);
        assert!(t.stages[2].starts_with("socket write + network + kernel, client → brick"));
    }

    #[test]
    fn other_clock_shows_wire_as_remainder() {
        let e = vec![
            ev(0, "top ↓", false),
            ev(5, SENT, false),
            ev(1_000_000, "brick: frame received", true),
            ev(1_000_020, "brick: reply write", true),
            ev(65, REPLY_HEADER, false),
            ev(70, "top ↑", false),
        ];
        let t = Timeline::from_events(&e).unwrap();
        assert_eq!(t.total_ns(), 70);
        let wire = t.stages.iter().position(|s| s.starts_with("wire")).unwrap();
        assert_eq!(t.ns[wire], 60 - 20);
    }

    #[test]
    fn waterfall_takes_common_shape() {
        let a = Timeline {
            stages: vec!["a".into(), "b".into()],
            ns: vec![1, 2],
        };
        let b = Timeline {
            stages: vec!["a".into()],
            ns: vec![9],
        };
        let w = Waterfall::of(&[a.clone(), a, b]).unwrap();
        assert_eq!((w.samples, w.seen), (2, 3));
        assert_eq!(w.sum_p50_ns(), 3);
    }
}
