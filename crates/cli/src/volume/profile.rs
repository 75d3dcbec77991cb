//! `kiln volume profile VOL start|info|stop|trace`: io-stats of every brick of a volume and of
//! every client that announced a metrics endpoint to them (mounts, NBD exports), or of one
//! brick (`--brick`), or of a brick server outside any managed volume (`--brick-server`).

use std::fmt::Write as _;
use std::io::{Read, Write};

use kiln_client::Client;
use kiln_layer::iostats::{Period, PointReport};
use kiln_layer::trace::{Timeline, Waterfall};
use kiln_mgmt::response::Statuses;
use kiln_mgmt::{Request, VolState};
use kiln_proto::ops::{PROFILE_INFO, PROFILE_START, PROFILE_STOP};

use super::{mgmt_call, volume_secret, MgmtOpts};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// `kiln volume profile`.
#[derive(clap::Args, Debug)]
pub(crate) struct ProfileArgs {
    /// The volume's name.
    volume: String,
    /// What to do.
    #[arg(value_enum)]
    action: Action,
    /// Only this brick of the volume (HOST:/DIR, as `kiln volume info` lists it) and its
    /// clients. Default: every brick.
    #[arg(long, value_name = "HOST:/DIR", conflicts_with = "brick_server")]
    brick: Option<String>,
    /// A brick server outside any managed volume (tcp:HOST:PORT, HOST:PORT or unix:PATH):
    /// ask it, not kilnd, and its clients.
    #[arg(long, value_name = "ADDR")]
    brick_server: Option<String>,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Start,
    Info,
    Stop,
    Trace,
}

/// Where a running brick takes connections; `None` while it is offline.
fn brick_addr(b: &kiln_mgmt::response::BrickStatus) -> Option<String> {
    b.port
        .filter(|_| b.online)
        .map(|port| format!("tcp:{}:{port}", b.host))
}

/// The brick servers to ask: (name shown, address).
fn bricks(p: &ProfileArgs) -> Result<Vec<(String, String)>, Error> {
    if let Some(a) = &p.brick_server {
        return Ok(vec![(a.clone(), a.clone())]);
    }
    let req = Request::Status {
        name: Some(p.volume.clone()),
    };
    let st: Statuses = mgmt_call(&p.opts, &req)?;
    let v = st
        .volumes
        .into_iter()
        .find(|v| v.name == p.volume)
        .ok_or_else(|| Error::not_found(format!("volume {}: no such volume", p.volume)))?;
    if v.state != VolState::Started {
        return Err(Error::conflict(format!("volume {}: not started", p.volume)));
    }
    let mut out = Vec::new();
    for b in v.bricks {
        if p.brick.as_ref().is_some_and(|w| *w != b.brick) {
            continue;
        }
        match brick_addr(&b) {
            Some(addr) => out.push((b.brick, addr)),
            None => eprintln!("kiln: brick {} is offline: not profiled", b.brick),
        }
    }
    match &p.brick {
        Some(w) if out.is_empty() => Err(Error::conflict(format!(
            "volume {}: no running brick {w} (see `kiln volume status {}`)",
            p.volume, p.volume
        ))),
        _ if out.is_empty() => Err(Error::conflict(format!(
            "volume {}: no brick runs",
            p.volume
        ))),
        _ => Ok(out),
    }
}

pub(crate) fn profile(p: &ProfileArgs) -> Result<(), Error> {
    // A brick of a managed volume wants the volume's secret.
    let secret = volume_secret(&p.volume, None, &p.opts.state_dir)?;
    let cmd = match p.action {
        Action::Start => PROFILE_START,
        Action::Stop => PROFILE_STOP,
        Action::Info | Action::Trace => PROFILE_INFO,
    };
    let (mut sources, mut unreachable, endpoints) = ask_bricks(p, cmd, secret.as_deref())?;
    for ep in &endpoints {
        let (method, path) = match (p.action, cmd) {
            (Action::Trace, _) => ("GET", "/traces"),
            (_, PROFILE_START) => ("POST", "/profile/start"),
            (_, PROFILE_STOP) => ("POST", "/profile/stop"),
            _ => ("GET", "/profile"),
        };
        match http(ep, method, path).and_then(|b| {
            serde_json::from_str::<serde_json::Value>(&b)
                .map_err(|e| Error::failed(format!("{ep}: {e}")))
        }) {
            Ok(v) => sources.push((format!("client {ep}"), v)),
            Err(e) => unreachable.push(e.to_string()),
        }
    }
    report(p, &sources, &unreachable)
}

/// What each brick answered to `cmd` (with its name), what failed, and the clients' metrics
/// endpoints the bricks know (each once).
type Answers = (Vec<(String, serde_json::Value)>, Vec<String>, Vec<String>);

fn ask_bricks(p: &ProfileArgs, cmd: u32, secret: Option<&[u8]>) -> Result<Answers, Error> {
    let mut sources = Vec::new();
    let mut unreachable = Vec::new();
    let mut endpoints: Vec<String> = Vec::new();
    for (name, addr) in bricks(p)? {
        let brick = match brick_profile(&name, &addr, cmd, secret) {
            Ok(b) => b,
            Err(e) => {
                unreachable.push(e.to_string());
                continue;
            }
        };
        add_endpoints(&brick, &mut endpoints);
        sources.push((format!("brick {name}"), brick));
    }
    if sources.is_empty() {
        return Err(Error::unavailable(format!(
            "volume {}: no brick answered: {}",
            p.volume,
            unreachable.join("; ")
        )));
    }
    Ok((sources, unreachable, endpoints))
}

/// Brick `name`'s answer to PROFILE `cmd` at `addr`.
fn brick_profile(
    name: &str,
    addr: &str,
    cmd: u32,
    secret: Option<&[u8]>,
) -> Result<serde_json::Value, Error> {
    Client::connect_with_secret(addr, secret)
        .with_context(|| format!("brick {name}: cannot reach it at {addr}"))
        .and_then(|c| {
            c.profile(cmd)
                .with_context(|| format!("brick {name}: profile request failed"))
        })
}

/// Adds the metrics endpoints of the clients a brick's profile names to `out`, each once (a
/// client connects to every brick and announces the same endpoint to each).
fn add_endpoints(brick: &serde_json::Value, out: &mut Vec<String>) {
    for ep in brick["clients"].as_array().into_iter().flatten() {
        if let Some(ep) = ep.as_str().filter(|ep| !out.iter().any(|e| e == ep)) {
            out.push(ep.to_owned());
        }
    }
}

/// The `/metrics` endpoints of the clients (mounts, NBD and vhost-user-blk exports) of volume
/// `v`, from its running bricks (reading a profile changes nothing), sorted; and the bricks
/// that could not be asked.
pub(crate) fn client_endpoints(
    opts: &MgmtOpts,
    v: &kiln_mgmt::response::VolumeStatus,
) -> Result<(Vec<String>, Vec<String>), Error> {
    let secret = volume_secret(&v.name, None, &opts.state_dir)?;
    let (mut endpoints, mut failed) = (Vec::new(), Vec::new());
    for b in &v.bricks {
        let Some(addr) = brick_addr(b) else { continue };
        match brick_profile(&b.brick, &addr, PROFILE_INFO, secret.as_deref()) {
            Ok(r) => add_endpoints(&r, &mut endpoints),
            Err(e) => failed.push(e.to_string()),
        }
    }
    endpoints.sort();
    Ok((endpoints, failed))
}

/// Prints what the sources said: a waterfall, JSON, a confirmation or the tables.
fn report(
    p: &ProfileArgs,
    sources: &[(String, serde_json::Value)],
    unreachable: &[String],
) -> Result<(), Error> {
    if p.action == Action::Trace {
        let mut timelines: Vec<Timeline> = Vec::new();
        for (_, v) in sources {
            if let Some(t) = v.get("timelines") {
                timelines
                    .extend(serde_json::from_value::<Vec<Timeline>>(t.clone()).unwrap_or_default());
            }
        }
        let w = Waterfall::of(&timelines);
        if p.opts.json {
            let r = serde_json::json!({ "volume": p.volume, "waterfall": w });
            crate::out::show(true, &r, |_| String::new());
        } else {
            match w {
                Some(w) => print!("{}", w.render()),
                None => println!(
                    "volume {}: no sampled requests yet (clients sample with --trace-every)",
                    p.volume
                ),
            }
        }
        return report_unreachable(unreachable);
    }
    if p.opts.json {
        let v: Vec<_> = sources
            .iter()
            .map(|(who, v)| serde_json::json!({ "source": who, "report": v }))
            .collect();
        let r = serde_json::json!({ "volume": p.volume, "sources": v });
        crate::out::show(true, &r, |_| String::new());
        return report_unreachable(unreachable);
    }
    if p.action == Action::Start {
        println!(
            "Starting volume profile on {} has been successful ({} source(s))",
            p.volume,
            sources.len()
        );
        return report_unreachable(unreachable);
    }
    for (who, v) in sources {
        let points: Vec<PointReport> =
            serde_json::from_value(v["points"].clone()).unwrap_or_default();
        for pt in points {
            println!("{who}, io-stats point {}", pt.name);
            println!("{}", "-".repeat(60));
            print_period("Cumulative Stats", &pt.cumulative);
            if let Some(iv) = &pt.interval {
                print_period("Interval Stats (since profile start)", iv);
            }
        }
    }
    report_unreachable(unreachable)
}

fn report_unreachable(errs: &[String]) -> Result<(), Error> {
    for e in errs {
        eprintln!("kiln: a client of the volume did not answer: {e}");
    }
    Ok(())
}

fn print_period(title: &str, p: &Period) {
    println!("{title}:");
    if !p.block_sizes.is_empty() {
        let mut hdr = String::from("   Block Size:");
        let mut rd = String::from(" No. of Reads:");
        let mut wr = String::from("No. of Writes:");
        for b in &p.block_sizes {
            let _ = write!(hdr, " {:>10}", format!("{}b+", b.size));
            let _ = write!(rd, " {:>10}", b.reads);
            let _ = write!(wr, " {:>10}", b.writes);
        }
        println!("{hdr}\n{rd}\n{wr}\n");
    }
    let total: f64 = p
        .fops
        .iter()
        .map(|f| f.latency_us_total)
        .sum::<f64>()
        .max(1e-9);
    println!(
        " %-latency   Avg-latency   Min-Latency   Max-Latency   p50-latency   p99-latency   No. of calls   Errors   Fop"
    );
    println!(
        " ---------   -----------   -----------   -----------   -----------   -----------   ------------   ------   ----"
    );
    let mut fops = p.fops.clone();
    fops.sort_by(|a, b| a.latency_us_total.total_cmp(&b.latency_us_total));
    for f in &fops {
        println!(
            " {:>9.2}   {:>8.2} us   {:>8.2} us   {:>8.2} us   {:>8.2} us   {:>8.2} us   {:>12}   {:>6}   {}",
            f.latency_us_total * 100.0 / total,
            f.latency_us_mean,
            f.latency_us_min,
            f.latency_us_max,
            f.latency_us_p50,
            f.latency_us_p99,
            f.calls,
            f.errors,
            f.fop.to_uppercase()
        );
    }
    println!(
        "\n    Duration: {:.0} seconds\n   Data Read: {} bytes\nData Written: {} bytes\n",
        p.duration_s, p.data_read, p.data_written
    );
}

/// GET or POST on a client's endpoint; returns the body.
fn http(addr: &str, method: &str, path: &str) -> Result<String, Error> {
    let mut s = std::net::TcpStream::connect(addr).context(addr)?;
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n"
    )
    .context(addr)?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).context(addr)?;
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .ok_or_else(|| Error::failed(format!("{addr}: malformed HTTP response")))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(Error::failed(format!(
            "{addr}{path}: {}",
            head.lines().next().unwrap_or("")
        )));
    }
    Ok(body.to_owned())
}
