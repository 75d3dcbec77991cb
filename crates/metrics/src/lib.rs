//! The `/metrics` endpoint (Prometheus text format) every long-running Kiln process serves, and
//! the small HTTP control surface beside it that `kiln volume profile` uses to reach clients.
//!
//! - `GET /metrics`: every io-stats point of the process — per fop calls, errors, bytes and a
//!   latency histogram — plus whatever the process adds (connection counters and the like).
//! - `GET /profile`: the io-stats reports as JSON (`kiln_layer::iostats::PointReport` list).
//! - `POST /profile/start`, `POST /profile/stop`: start or end an interval on every point.
//! - `GET /traces`: sampled request timelines as JSON (`kiln_layer::trace::Timeline` list).
//!
//! The server is one thread with a blocking accept loop: scrapes are rare and small. What the
//! routes say comes from `kiln_layer::metrics`; this crate only serves it.

use std::net::SocketAddr;
use std::sync::Arc;

use kiln_layer::iostats::points;
use kiln_layer::metrics::{add_points, profile_json, Scrape};
use kiln_layer::trace::TraceLog;

/// What a process adds to `/metrics` beside its io-stats points.
pub type Extra = Arc<dyn Fn(&mut Scrape) + Send + Sync>;

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
            let mut s = Scrape::default();
            add_points(&mut s, process);
            if let Some(x) = extra {
                x(&mut s);
            }
            (200, TEXT, s.encode())
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
