//! What a process's `/metrics` and profile routes say: every io-stats point rendered in
//! Prometheus text format, and the io-stats reports as JSON. The HTTP endpoint that serves
//! them is the `kiln-metrics` crate.

use std::fmt::Write as _;

use crate::iostats::points;

/// Latency bucket bounds for the Prometheus histogram, seconds.
const LE_S: &[f64] = &[
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0,
];

/// Renders every io-stats point of this process in Prometheus text format.
pub fn render(process: &str) -> String {
    let mut out = String::new();
    let pts = points();
    let label = |p: &str, f: &str| format!("process=\"{process}\",layer=\"{p}\",fop=\"{f}\"");
    type Pick = fn(u64, u64, u64) -> u64;
    let counters: [(&str, &str, Pick); 3] = [
        (
            "kiln_fop_calls_total",
            "Fops completed, per io-stats point.",
            |c, _, _| c,
        ),
        ("kiln_fop_errors_total", "Fops that failed.", |_, e, _| e),
        (
            "kiln_fop_bytes_total",
            "File data bytes moved by reads and writes.",
            |_, _, b| b,
        ),
    ];
    for (name, help, pick) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for p in &pts {
            p.for_each_fop(|fop, calls, errors, bytes, _| {
                let v = pick(calls, errors, bytes);
                let _ = writeln!(out, "{name}{{{}}} {v}", label(p.name(), fop));
            });
        }
    }
    let _ = writeln!(
        out,
        "# HELP kiln_fop_latency_seconds Fop latency at an io-stats point."
    );
    let _ = writeln!(out, "# TYPE kiln_fop_latency_seconds histogram");
    for p in &pts {
        p.for_each_fop(|fop, _, _, _, h| {
            let l = label(p.name(), fop);
            for le in LE_S {
                let n = h.count_between(0, (le * 1e9) as u64);
                let _ = writeln!(
                    out,
                    "kiln_fop_latency_seconds_bucket{{{l},le=\"{le}\"}} {n}"
                );
            }
            let _ = writeln!(
                out,
                "kiln_fop_latency_seconds_bucket{{{l},le=\"+Inf\"}} {}",
                h.len()
            );
            let sum = h.mean() * h.len() as f64 / 1e9;
            let _ = writeln!(out, "kiln_fop_latency_seconds_sum{{{l}}} {sum}");
            let _ = writeln!(out, "kiln_fop_latency_seconds_count{{{l}}} {}", h.len());
        });
    }
    out
}

/// This process's io-stats reports as JSON: `{"process": …, "points": [PointReport…]}`.
pub fn profile_json(process: &str) -> serde_json::Value {
    let reports: Vec<_> = points().iter().map(|p| p.report()).collect();
    serde_json::json!({ "process": process, "points": reports })
}
