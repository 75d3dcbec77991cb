//! `kiln volume …`: operator commands on a volume.
//!
//! Today a brick server serves one volume, so a volume is reached through its brick's address
//! (`--server`, default the `kilnd` default). `profile` gathers the io-stats of the brick and of
//! every client that announced a metrics endpoint to it (mounts, NBD exports).

use std::fmt::Write as _;
use std::io::{Read, Write};

use kiln_client::Client;
use kiln_layer::iostats::{Period, PointReport};
use kiln_layer::trace::{Timeline, Waterfall};
use kiln_proto::ops::{PROFILE_INFO, PROFILE_START, PROFILE_STOP};

/// Volume operations.
#[derive(clap::Args, Debug)]
pub struct VolumeArgs {
    #[command(subcommand)]
    cmd: VolumeCmd,
}

#[derive(clap::Subcommand, Debug)]
enum VolumeCmd {
    /// Per-fop counts, latency (min/mean/p50/p99/max) and block sizes at every io-stats point
    /// of the brick and its clients, and request waterfalls.
    ///
    /// `start` opens an interval (counting never stops: cumulative numbers are always there),
    /// `info` prints cumulative and interval tables, `stop` prints them and closes the interval,
    /// `trace` prints the waterfall of sampled requests that clients recorded.
    Profile(ProfileArgs),
    /// The layer types a volume graph (volfile) may use, with their options.
    Layers,
}

#[derive(clap::Args, Debug)]
struct ProfileArgs {
    /// The volume's name.
    volume: String,
    /// What to do.
    #[arg(value_enum)]
    action: Action,
    /// The brick server of the volume (tcp:HOST:PORT, HOST:PORT or unix:PATH).
    #[arg(long, default_value = "tcp:127.0.0.1:24100")]
    server: String,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Start,
    Info,
    Stop,
    Trace,
}

/// `kiln volume`.
pub fn main(args: VolumeArgs) -> Result<(), String> {
    match args.cmd {
        VolumeCmd::Layers => {
            print!("{}", layers_text());
            Ok(())
        }
        VolumeCmd::Profile(p) => profile(&p),
    }
}

fn layers_text() -> String {
    let mut out = String::new();
    for t in kiln_layer::volfile::TYPES {
        let _ = writeln!(out, "{} ({})\n  {}", t.name, t.side, t.doc);
        for o in t.options {
            let _ = writeln!(
                out,
                "    {:<12} {:<22} default {:<16} {}",
                o.name, o.ty, o.default, o.doc
            );
        }
    }
    out
}

/// GET or POST on a client's endpoint; returns the body.
fn http(addr: &str, method: &str, path: &str) -> Result<String, String> {
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n"
    )
    .map_err(|e| format!("{addr}: {e}"))?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .map_err(|e| format!("{addr}: {e}"))?;
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr}: malformed HTTP response"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(format!(
            "{addr}{path}: {}",
            head.lines().next().unwrap_or("")
        ));
    }
    Ok(body.to_owned())
}

fn profile(p: &ProfileArgs) -> Result<(), String> {
    let client = Client::connect(&p.server)
        .map_err(|e| format!("volume {}: cannot reach its brick: {e}", p.volume))?;
    let cmd = match p.action {
        Action::Start => PROFILE_START,
        Action::Stop => PROFILE_STOP,
        Action::Info | Action::Trace => PROFILE_INFO,
    };
    let brick = client
        .profile(cmd)
        .map_err(|e| format!("volume {}: profile request failed: {e}", p.volume))?;
    let endpoints: Vec<String> = brick["clients"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let mut sources = vec![(format!("brick {}", p.server), brick)];
    let mut unreachable = Vec::new();
    for ep in &endpoints {
        let (method, path) = match (p.action, cmd) {
            (Action::Trace, _) => ("GET", "/traces"),
            (_, PROFILE_START) => ("POST", "/profile/start"),
            (_, PROFILE_STOP) => ("POST", "/profile/stop"),
            _ => ("GET", "/profile"),
        };
        match http(ep, method, path).and_then(|b| {
            serde_json::from_str::<serde_json::Value>(&b).map_err(|e| format!("{ep}: {e}"))
        }) {
            Ok(v) => sources.push((format!("client {ep}"), v)),
            Err(e) => unreachable.push(e),
        }
    }
    if p.action == Action::Trace {
        let mut timelines: Vec<Timeline> = Vec::new();
        for (_, v) in &sources {
            if let Some(t) = v.get("timelines") {
                timelines
                    .extend(serde_json::from_value::<Vec<Timeline>>(t.clone()).unwrap_or_default());
            }
        }
        let w = Waterfall::of(&timelines);
        if p.json {
            println!(
                "{}",
                serde_json::json!({ "volume": p.volume, "waterfall": w })
            );
        } else {
            match w {
                Some(w) => print!("{}", w.render()),
                None => println!(
                    "volume {}: no sampled requests yet (clients sample with --trace-every)",
                    p.volume
                ),
            }
        }
        return report_unreachable(&unreachable);
    }
    if p.json {
        let v: Vec<_> = sources
            .iter()
            .map(|(who, v)| serde_json::json!({ "source": who, "report": v }))
            .collect();
        println!(
            "{}",
            serde_json::json!({ "volume": p.volume, "sources": v })
        );
        return report_unreachable(&unreachable);
    }
    if p.action == Action::Start {
        println!(
            "Starting volume profile on {} has been successful ({} source(s))",
            p.volume,
            sources.len()
        );
        return report_unreachable(&unreachable);
    }
    for (who, v) in &sources {
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
    report_unreachable(&unreachable)
}

fn report_unreachable(errs: &[String]) -> Result<(), String> {
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
