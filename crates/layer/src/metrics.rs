//! The `/metrics` endpoint (Prometheus text format) every long-running Kiln process serves, and
//! the small HTTP control surface beside it that `kiln volume profile` uses to reach clients.
//!
//! - `GET /metrics`: every io-stats point of the process — per fop calls, errors, bytes and a
//!   latency histogram — plus whatever the process adds (connection counters and the like).
//! - `GET /profile`: the io-stats reports as JSON ([`crate::iostats::PointReport`] list).
//! - `POST /profile/start`, `POST /profile/stop`: start or end an interval on every point.
//! - `GET /traces`: sampled request timelines as JSON ([`crate::trace::Timeline`] list).
//!
//! The server is one thread with a blocking accept loop: scrapes are rare and small.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::iostats::points;
use crate::trace::TraceLog;

/// Latency bucket bounds for the Prometheus histogram, seconds.
const LE_S: &[f64] = &[
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0,
];

/// Extra lines a process appends to `/metrics`.
pub type Extra = Arc<dyn Fn(&mut String) + Send + Sync>;

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

/// A running metrics endpoint.
pub struct Endpoint {
    /// The bound address (with the real port when 0 was asked for).
    pub addr: SocketAddr,
}

/// The endpoint this process serves, once [`serve`] has started one (clients announce it to
/// bricks in HELLO so `kiln volume profile` can find them).
pub fn local_endpoint() -> Option<SocketAddr> {
    ENDPOINT.get().copied()
}

static ENDPOINT: std::sync::OnceLock<SocketAddr> = std::sync::OnceLock::new();

/// Serves `/metrics` and the profile routes on `addr` from a background thread. `process`
/// labels the series (`kilnd`, `kiln-mount`, …); `extra` appends process-specific lines.
pub fn serve(addr: &str, process: &str, extra: Option<Extra>) -> std::io::Result<Endpoint> {
    let server = tiny_http::Server::http(addr).map_err(std::io::Error::other)?;
    let addr = server
        .server_addr()
        .to_ip()
        .ok_or_else(|| std::io::Error::other("metrics endpoint is not on IP"))?;
    let _ = ENDPOINT.set(addr);
    let process = process.to_owned();
    std::thread::Builder::new()
        .name("kiln-metrics".into())
        .spawn(move || {
            for req in server.incoming_requests() {
                let (status, ctype, body) = route(&req, &process, extra.as_ref());
                let header = tiny_http::Header::from_bytes("Content-Type", ctype)
                    .expect("static header is valid");
                let resp = tiny_http::Response::from_string(body)
                    .with_status_code(status)
                    .with_header(header);
                if let Err(e) = req.respond(resp) {
                    tracing::debug!("metrics response failed: {e}");
                }
            }
        })?;
    Ok(Endpoint { addr })
}

fn route(
    req: &tiny_http::Request,
    process: &str,
    extra: Option<&Extra>,
) -> (u16, &'static str, String) {
    use tiny_http::Method::{Get, Post};
    const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
    const JSON: &str = "application/json";
    let json = |v: serde_json::Value| (200, JSON, v.to_string());
    match (req.method(), req.url()) {
        (Get, "/metrics") => {
            let mut s = render(process);
            if let Some(x) = extra {
                x(&mut s);
            }
            (200, TEXT, s)
        }
        (Get, "/profile") => json(profile_json(process)),
        (Post, "/profile/start") => {
            points().iter().for_each(|p| p.start_interval());
            json(profile_json(process))
        }
        (Post, "/profile/stop") => {
            let r = profile_json(process);
            points().iter().for_each(|p| p.stop_interval());
            json(r)
        }
        (Get, "/traces") => json(serde_json::json!({
            "process": process,
            "timelines": TraceLog::global().snapshot(),
        })),
        _ => (
            404,
            TEXT,
            "not found: try /metrics, /profile or /traces\n".into(),
        ),
    }
}

/// This process's io-stats reports as JSON: `{"process": …, "points": [PointReport…]}`.
pub fn profile_json(process: &str) -> serde_json::Value {
    let reports: Vec<_> = points().iter().map(|p| p.report()).collect();
    serde_json::json!({ "process": process, "points": reports })
}
