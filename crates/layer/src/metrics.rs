//! What a process's `/metrics` and profile routes say: every io-stats point, and whatever else
//! the process counts, as a [`Scrape`] that `prometheus-client` encodes in the Prometheus text
//! format (escaping label values and help text: a volume named `a"b` cannot break a line); and
//! the io-stats reports as JSON. The HTTP endpoint that serves them is the `kiln-metrics` crate.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::iostats::points;

/// Latency bucket bounds for the Prometheus histogram, seconds.
const LE_S: &[f64] = &[
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0,
];

/// One scrape's metric families, filled by every part of a process that counts something and
/// encoded once by [`Scrape::encode`].
#[derive(Debug, Default)]
pub struct Scrape {
    families: Vec<Family>,
}

/// A metric family: one name, help and type, and its samples by label set.
#[derive(Debug)]
pub struct Family {
    name: String,
    help: String,
    kind: MetricType,
    rows: Vec<(Vec<(String, String)>, Sample)>,
}

#[derive(Debug)]
enum Sample {
    Counter(u64),
    Gauge(f64),
    /// Sum, count and per-bucket (not cumulative) counts by upper bound.
    Histogram(f64, u64, Vec<(f64, u64)>),
}

impl Scrape {
    fn family(&mut self, name: &str, help: &str, kind: MetricType) -> &mut Family {
        self.families.push(Family {
            name: name.to_owned(),
            help: help.to_owned(),
            kind,
            rows: Vec::new(),
        });
        self.families.last_mut().expect("just pushed")
    }

    /// A counter family; `name` without the `_total` the encoder adds.
    pub fn counter(&mut self, name: &str, help: &str) -> &mut Family {
        self.family(name, help, MetricType::Counter)
    }

    /// A gauge family.
    pub fn gauge(&mut self, name: &str, help: &str) -> &mut Family {
        self.family(name, help, MetricType::Gauge)
    }

    /// A histogram family.
    pub fn histogram(&mut self, name: &str, help: &str) -> &mut Family {
        self.family(name, help, MetricType::Histogram)
    }

    /// The Prometheus text exposition (format 0.0.4) of every family.
    pub fn encode(self) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::new();
        // Writing into a String fails only if a label set does, and ours are plain strings.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
        out
    }
}

impl Family {
    fn push(&mut self, labels: &[(&str, &str)], s: Sample) -> &mut Self {
        let labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.rows.push((labels, s));
        self
    }

    /// A counter's value for one label set.
    pub fn count(&mut self, labels: &[(&str, &str)], v: u64) -> &mut Self {
        self.push(labels, Sample::Counter(v))
    }

    /// A gauge's value for one label set.
    pub fn set(&mut self, labels: &[(&str, &str)], v: f64) -> &mut Self {
        self.push(labels, Sample::Gauge(v))
    }

    /// A histogram for one label set: the sum and count of observations, and how many fell
    /// at or under each upper bound but above the one before (not cumulative).
    pub fn observed(
        &mut self,
        labels: &[(&str, &str)],
        sum: f64,
        count: u64,
        buckets: Vec<(f64, u64)>,
    ) -> &mut Self {
        self.push(labels, Sample::Histogram(sum, count, buckets))
    }
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.families {
            let mut m = enc.encode_descriptor(&f.name, &f.help, None, f.kind)?;
            for (labels, s) in &f.rows {
                if labels.is_empty() {
                    sample(&mut m, s)?;
                } else {
                    sample(&mut m.encode_family(labels)?, s)?;
                }
            }
        }
        Ok(())
    }
}

fn sample(m: &mut MetricEncoder, s: &Sample) -> Result<(), std::fmt::Error> {
    match s {
        Sample::Counter(v) => m.encode_counter::<NoLabelSet, _, u64>(v, None),
        Sample::Gauge(v) => m.encode_gauge(v),
        Sample::Histogram(sum, count, buckets) => {
            m.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None)
        }
    }
}

/// Adds every io-stats point of this process: calls, errors, bytes and latency per fop.
pub fn add_points(out: &mut Scrape, process: &str) {
    let pts = points();
    type Pick = fn(u64, u64, u64) -> u64;
    let counters: [(&str, &str, Pick); 3] = [
        (
            "kiln_fop_calls",
            "Fops completed, per io-stats point.",
            |c, _, _| c,
        ),
        ("kiln_fop_errors", "Fops that failed.", |_, e, _| e),
        (
            "kiln_fop_bytes",
            "File data bytes moved by reads and writes.",
            |_, _, b| b,
        ),
    ];
    for (name, help, pick) in counters {
        let f = out.counter(name, help);
        for p in &pts {
            p.for_each_fop(|fop, calls, errors, bytes, _| {
                let l = [("process", process), ("layer", p.name()), ("fop", fop)];
                f.count(&l, pick(calls, errors, bytes));
            });
        }
    }
    let f = out.histogram(
        "kiln_fop_latency_seconds",
        "Fop latency at an io-stats point.",
    );
    for p in &pts {
        p.for_each_fop(|fop, _, _, _, h| {
            let mut below = 0;
            let buckets = LE_S
                .iter()
                .map(|le| {
                    let n = h.count_between(0, (le * 1e9) as u64);
                    let b = (*le, n.saturating_sub(below));
                    below = below.max(n);
                    b
                })
                .collect();
            let sum = h.mean() * h.len() as f64 / 1e9;
            let l = [("process", process), ("layer", p.name()), ("fop", fop)];
            f.observed(&l, sum, h.len(), buckets);
        });
    }
}

/// Renders every io-stats point of this process in Prometheus text format.
pub fn render(process: &str) -> String {
    let mut s = Scrape::default();
    add_points(&mut s, process);
    s.encode()
}

/// This process's io-stats reports as JSON: `{"process": …, "points": [PointReport…]}`.
pub fn profile_json(process: &str) -> serde_json::Value {
    let reports: Vec<_> = points().iter().map(|p| p.report()).collect();
    serde_json::json!({ "process": process, "points": reports })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_and_types_named() {
        let mut s = Scrape::default();
        s.counter("kiln_x", "Help with \\ and\nnewline.")
            .count(&[("volume", "a\"b\\c\nd")], 3);
        s.gauge("kiln_g", "A gauge.").set(&[], 1.5);
        s.histogram("kiln_h", "A histogram.").observed(
            &[("fop", "read")],
            0.5,
            3,
            vec![(0.1, 1), (1.0, 2)],
        );
        let t = s.encode();
        assert!(t.contains("# TYPE kiln_x_total counter"), "{t}");
        assert!(t.contains(r#"kiln_x_total{volume="a\"b\\c\nd"} 3"#), "{t}");
        assert!(t.contains("kiln_g 1.5"), "{t}");
        // Buckets are cumulative on the wire, the +Inf one equal to the count.
        assert!(t.contains(r#"kiln_h_bucket{fop="read",le="1"} 3"#), "{t}");
        assert!(
            t.contains(r#"kiln_h_bucket{fop="read",le="+Inf"} 3"#),
            "{t}"
        );
        assert!(!t.contains('\u{1b}'));
    }
}
