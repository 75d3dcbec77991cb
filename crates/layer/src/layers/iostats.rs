//! io-stats: counts, bytes and latency of every fop that passes, placeable anywhere in a stack.
//!
//! Per fop it keeps calls, errors, data bytes and a latency histogram (HdrHistogram, ns, two
//! significant digits); for reads and writes also a block-size table (power-of-two buckets).
//! Everything is cumulative since the layer was built; [`IoStatsData::start_interval`] marks a
//! point from which an interval is reported too (what `kiln volume profile VOL start` does).
//!
//! Costs per fop: two clock reads, three relaxed atomic adds and one uncontended mutex for the
//! histogram. Relaxed ordering is enough: every counter is an independent tally read only for
//! display, where a count one fop behind is fine.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use hdrhistogram::Histogram;
use kiln_proto::sync::MutexExt as _;
use serde::{Deserialize, Serialize};

use crate::trace::now_ns;
use crate::{Ctx, FopOutput, Fut, Interpose, LayerRef, Op};

/// Block-size buckets: 2^0 .. 2^24 bytes (the largest payload is 16 MiB).
const SIZE_BUCKETS: usize = 25;
/// Slots per opcode (opcodes start at 1).
const OPS: usize = 64;
const _: () = assert!(Op::ALL.len() < OPS, "every opcode has a slot of its own");

#[derive(Default)]
struct OpStats {
    calls: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
    /// Latency in nanoseconds; allocated on the fop's first call.
    lat: Mutex<Option<Histogram<u64>>>,
}

fn new_hist() -> Histogram<u64> {
    // 1 ns .. 10 min at two significant digits; larger values are clamped.
    Histogram::new_with_bounds(1, 600_000_000_000, 2).expect("valid histogram bounds")
}

/// The counters of one io-stats point, shared with the process registry and `/metrics`.
pub struct IoStatsData {
    name: String,
    ops: [OpStats; OPS],
    read_sizes: [AtomicU64; SIZE_BUCKETS],
    write_sizes: [AtomicU64; SIZE_BUCKETS],
    born: Instant,
    interval: Mutex<Option<(Instant, Raw)>>,
}

/// A copy of the raw counters, kept at an interval's start.
#[derive(Clone, Default)]
struct Raw {
    calls: Vec<u64>,
    errors: Vec<u64>,
    bytes: Vec<u64>,
    lat: Vec<Option<Histogram<u64>>>,
    read_sizes: Vec<u64>,
    write_sizes: Vec<u64>,
}

/// One fop's row in a profile.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FopRow {
    /// Fop name.
    pub fop: String,
    /// Calls completed.
    pub calls: u64,
    /// Calls that failed.
    pub errors: u64,
    /// File data bytes moved.
    pub bytes: u64,
    /// Latency, µs.
    pub latency_us_min: f64,
    /// Latency, µs.
    pub latency_us_mean: f64,
    /// Latency, µs.
    pub latency_us_p50: f64,
    /// Latency, µs.
    pub latency_us_p99: f64,
    /// Latency, µs.
    pub latency_us_max: f64,
    /// Sum of latencies, µs (for %-latency).
    pub latency_us_total: f64,
}

/// A block-size table row: requests whose size was in `[size, 2·size)`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SizeRow {
    /// Lower bound of the bucket, bytes.
    pub size: u64,
    /// Reads of that size.
    pub reads: u64,
    /// Writes of that size.
    pub writes: u64,
}

/// The numbers of one io-stats point over some duration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Period {
    /// Seconds covered.
    pub duration_s: f64,
    /// Bytes read.
    pub data_read: u64,
    /// Bytes written.
    pub data_written: u64,
    /// Fops with at least one call.
    pub fops: Vec<FopRow>,
    /// Block sizes of reads and writes.
    pub block_sizes: Vec<SizeRow>,
}

/// The report of one io-stats point.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PointReport {
    /// The layer's name.
    pub name: String,
    /// Since the layer was built.
    pub cumulative: Period,
    /// Since the last `start`, if one was given.
    pub interval: Option<Period>,
}

fn bucket(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (usize::BITS - 1 - n.leading_zeros()).min(SIZE_BUCKETS as u32 - 1) as usize
    }
}

impl IoStatsData {
    /// Fresh counters, registered with the process so `/metrics` and profiles find them.
    pub fn new(name: &str) -> Arc<IoStatsData> {
        let d = Arc::new(IoStatsData {
            name: name.to_owned(),
            ops: std::array::from_fn(|_| OpStats::default()),
            read_sizes: Default::default(),
            write_sizes: Default::default(),
            born: Instant::now(),
            interval: Mutex::new(None),
        });
        let mut r = registry().locked();
        r.retain(|w| w.strong_count() > 0);
        r.push(Arc::downgrade(&d));
        d
    }

    /// The point's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records one completed fop.
    pub fn record(&self, op: Op, ok: bool, bytes: usize, latency_ns: u64) {
        let s = &self.ops[op as usize % OPS];
        s.calls.fetch_add(1, Relaxed);
        if !ok {
            s.errors.fetch_add(1, Relaxed);
        }
        if bytes > 0 {
            s.bytes.fetch_add(bytes as u64, Relaxed);
        }
        match op {
            Op::Read if ok => self.read_sizes[bucket(bytes)].fetch_add(1, Relaxed),
            Op::Write | Op::WriteMarked if ok => {
                self.write_sizes[bucket(bytes)].fetch_add(1, Relaxed)
            }
            _ => 0,
        };
        let mut h = s.lat.locked();
        h.get_or_insert_with(new_hist)
            .saturating_record(latency_ns.max(1));
    }

    /// Records `calls` fops that were timed elsewhere, or not at all (a client's reads
    /// straight from the brick's files, [`Op::LocalRead`]): counted, without latencies.
    pub fn record_untimed(&self, op: Op, calls: u64, bytes: u64) {
        let s = &self.ops[op as usize % OPS];
        s.calls.fetch_add(calls, Relaxed);
        s.bytes.fetch_add(bytes, Relaxed);
    }

    fn raw(&self) -> Raw {
        let load = |a: &AtomicU64| a.load(Relaxed);
        Raw {
            calls: self.ops.iter().map(|s| load(&s.calls)).collect(),
            errors: self.ops.iter().map(|s| load(&s.errors)).collect(),
            bytes: self.ops.iter().map(|s| load(&s.bytes)).collect(),
            lat: self.ops.iter().map(|s| s.lat.locked().clone()).collect(),
            read_sizes: self.read_sizes.iter().map(load).collect(),
            write_sizes: self.write_sizes.iter().map(load).collect(),
        }
    }

    /// Starts a new interval now.
    pub fn start_interval(&self) {
        let raw = self.raw();
        *self.interval.locked() = Some((Instant::now(), raw));
    }

    /// Ends the interval: later reports have none.
    pub fn stop_interval(&self) {
        *self.interval.locked() = None;
    }

    /// Cumulative and interval numbers.
    pub fn report(&self) -> PointReport {
        let now = self.raw();
        let cumulative = period(&now, None, self.born.elapsed().as_secs_f64());
        let interval = self
            .interval
            .locked()
            .as_ref()
            .map(|(at, base)| period(&now, Some(base), at.elapsed().as_secs_f64()));
        PointReport {
            name: self.name.clone(),
            cumulative,
            interval,
        }
    }

    /// Per fop: name, calls, errors, bytes and the latency histogram (cumulative), for
    /// `/metrics`.
    pub fn for_each_fop(&self, mut f: impl FnMut(&str, u64, u64, u64, &Histogram<u64>)) {
        for op in Op::ALL {
            let name = op.name().to_ascii_lowercase();
            let s = &self.ops[*op as usize % OPS];
            let h = s.lat.locked();
            if let Some(h) = h.as_ref() {
                f(
                    &name,
                    s.calls.load(Relaxed),
                    s.errors.load(Relaxed),
                    s.bytes.load(Relaxed),
                    h,
                );
            }
        }
    }
}

fn period(now: &Raw, base: Option<&Raw>, duration_s: f64) -> Period {
    let sub = |v: &[u64], b: Option<&Vec<u64>>, i: usize| v[i] - b.map_or(0, |b| b[i].min(v[i]));
    let mut fops = Vec::new();
    let (mut data_read, mut data_written) = (0, 0);
    for op in Op::ALL {
        let i = *op as usize % OPS;
        let calls = sub(&now.calls, base.map(|b| &b.calls), i);
        if calls == 0 {
            continue;
        }
        let bytes = sub(&now.bytes, base.map(|b| &b.bytes), i);
        match op {
            Op::Read => data_read = bytes,
            Op::Write | Op::WriteMarked => data_written += bytes,
            _ => {}
        }
        let mut h = now.lat[i].clone().unwrap_or_else(new_hist);
        if let Some(Some(b)) = base.map(|b| &b.lat[i]) {
            // Same bounds, and `b` is an earlier state of `h`: cannot fail.
            let _ = h.subtract(b);
        }
        let us = |ns: u64| ns as f64 / 1e3;
        fops.push(FopRow {
            fop: op.name().to_ascii_lowercase(),
            calls,
            errors: sub(&now.errors, base.map(|b| &b.errors), i),
            bytes,
            latency_us_min: us(h.min()),
            latency_us_mean: h.mean() / 1e3,
            latency_us_p50: us(h.value_at_quantile(0.5)),
            latency_us_p99: us(h.value_at_quantile(0.99)),
            latency_us_max: us(h.max()),
            latency_us_total: h.mean() * h.len() as f64 / 1e3,
        });
    }
    let mut block_sizes = Vec::new();
    for i in 0..SIZE_BUCKETS {
        let reads = sub(&now.read_sizes, base.map(|b| &b.read_sizes), i);
        let writes = sub(&now.write_sizes, base.map(|b| &b.write_sizes), i);
        if reads + writes > 0 {
            block_sizes.push(SizeRow {
                size: 1 << i,
                reads,
                writes,
            });
        }
    }
    Period {
        duration_s,
        data_read,
        data_written,
        fops,
        block_sizes,
    }
}

/// Every io-stats point alive in this process.
pub fn registry() -> &'static Mutex<Vec<Weak<IoStatsData>>> {
    static R: OnceLock<Mutex<Vec<Weak<IoStatsData>>>> = OnceLock::new();
    R.get_or_init(Mutex::default)
}

/// The live io-stats points of this process, in the order they were built.
pub fn points() -> Vec<Arc<IoStatsData>> {
    let r = registry().locked();
    r.iter().filter_map(Weak::upgrade).collect()
}

/// The io-stats layer.
pub struct IoStats {
    children: [LayerRef; 1],
    data: Arc<IoStatsData>,
    down: String,
    up: String,
}

impl IoStats {
    /// An io-stats point named `name` above `child`.
    pub fn new(name: &str, child: LayerRef) -> IoStats {
        IoStats {
            children: [child],
            data: IoStatsData::new(name),
            down: format!("{name} ↓"),
            up: format!("{name} ↑"),
        }
    }

    /// Its counters.
    pub fn data(&self) -> &Arc<IoStatsData> {
        &self.data
    }
}

impl Interpose for IoStats {
    fn name(&self) -> &str {
        &self.data.name
    }

    fn children(&self) -> &[LayerRef] {
        &self.children
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn around<'a, T: FopOutput + Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        op: Op,
        call: Box<dyn FnOnce() -> Fut<'a, T> + Send + 'a>,
    ) -> Fut<'a, T> {
        Box::pin(async move {
            if let Some(t) = &cx.trace {
                t.stamp(self.down.as_str());
            }
            let t0 = now_ns();
            let r = call().await;
            let t1 = now_ns();
            if let Some(t) = &cx.trace {
                t.stamp_at(t1, self.up.as_str());
            }
            let bytes = r.as_ref().map_or(0, |v| v.data_bytes());
            self.data.record(op, r.is_ok(), bytes, t1 - t0);
            r
        })
    }
}

crate::interpose_all!(IoStats);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_subtracts_the_start() {
        let d = IoStatsData::new("t");
        d.record(Op::Read, true, 4096, 10_000);
        d.start_interval();
        d.record(Op::Read, true, 131072, 50_000);
        d.record(Op::Read, false, 0, 70_000);
        let r = d.report();
        let cum = &r.cumulative.fops[0];
        assert_eq!((cum.calls, cum.errors, cum.bytes), (3, 1, 135168));
        let iv = r.interval.unwrap();
        let row = &iv.fops[0];
        assert_eq!((row.calls, row.errors, row.bytes), (2, 1, 131072));
        assert!(row.latency_us_min >= 49.0, "{row:?}");
        // Failed reads carry no size; the 4k read was before the interval.
        assert_eq!(iv.block_sizes.len(), 1, "{:?}", iv.block_sizes);
        assert_eq!(iv.block_sizes[0].size, 131072);
        assert_eq!(bucket(4096), 12);
        assert_eq!(bucket(4097), 12);
        assert_eq!(bucket(1 << 30), SIZE_BUCKETS - 1);
    }
}
