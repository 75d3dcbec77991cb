//! `kiln volume rebalance` and `kiln volume remove-brick`: ask the pool's leader to move files
//! where the layout wants them (and off sets being removed), show how far it is, and take
//! drained sets out.

use std::fmt::Write as _;
use std::time::Duration;

use kiln_mgmt::response::RebalanceView;
use kiln_mgmt::Request;

use super::{mgmt_call, show, MgmtOpts};
use kiln_proto::Error;

#[derive(clap::Args, Debug)]
pub(super) struct RebalanceArgs {
    /// The volume's name.
    name: String,
    /// `start` a run (files move while clients use them), `stop` it after the file in hand,
    /// or show its `status`: names and bytes found and moved per replica set, rate and ETA.
    #[arg(value_parser = ["start", "stop", "status"])]
    action: String,
    /// With `start`: copy at most this many MiB per second (default 64; 0: no limit).
    /// Client I/O shares the bricks' disks and CPU with the rebalance: the default kept a
    /// mount's read p99 within 1.3x of idle on a 2-core host (bench/README.md).
    #[arg(long, value_name = "MIB")]
    rate: Option<u64>,
    /// Follow the run, printing its progress every second, until it ends.
    #[arg(long)]
    wait: bool,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::Args, Debug)]
pub(super) struct RemoveBrickArgs {
    /// The volume's name.
    name: String,
    /// The bricks (HOST:/DIR as `volume info` shows them), whole replica sets, then what to
    /// do: `start` (drain: new files go elsewhere, a rebalance moves theirs off), `status`,
    /// `stop` (keep them), or `commit` (take them out; refused while anything is left).
    #[arg(required = true, value_name = "BRICK... start|status|stop|commit")]
    args: Vec<String>,
    /// With `start`: follow the draining until it ends.
    #[arg(long)]
    wait: bool,
    /// With `start`: the rebalance copies at most this many MiB per second (default 64; 0:
    /// no limit).
    #[arg(long, value_name = "MIB")]
    rate: Option<u64>,
    #[command(flatten)]
    opts: MgmtOpts,
}

/// `kiln volume rebalance`.
pub(super) fn rebalance(a: &RebalanceArgs) -> Result<(), Error> {
    let req = Request::Rebalance {
        name: a.name.clone(),
        action: a.action.clone(),
        rate_mib: a.rate,
    };
    let v: RebalanceView = mgmt_call(&a.opts, &req)?;
    show(&a.opts, &v, view_text);
    if a.wait && a.action == "start" {
        follow(&a.opts, &a.name)?;
    }
    Ok(())
}

/// `kiln volume remove-brick`.
pub(super) fn remove_brick(a: &RemoveBrickArgs) -> Result<(), Error> {
    let (action, bricks) = a
        .args
        .split_last()
        .filter(|(act, b)| {
            !b.is_empty() && ["start", "status", "stop", "commit"].contains(&act.as_str())
        })
        .ok_or_else(|| {
            format!(
                "usage: kiln volume remove-brick {} BRICK... start|status|stop|commit",
                a.name
            )
        })
        .map_err(Error::invalid)?;
    let req = Request::RemoveBrick {
        name: a.name.clone(),
        bricks: bricks.to_vec(),
        action: action.clone(),
        rate_mib: a.rate,
    };
    let v: RebalanceView = mgmt_call(&a.opts, &req)?;
    if action == "commit" {
        show(&a.opts, &v, |_| {
            format!("volume remove-brick commit: {}: success\n", a.name)
        });
        return Ok(());
    }
    show(&a.opts, &v, view_text);
    if a.wait && action == "start" {
        follow(&a.opts, &a.name)?;
    }
    Ok(())
}

/// Prints the run's progress every second until it is no longer running; fails unless it
/// completed without failures.
fn follow(opts: &MgmtOpts, name: &str) -> Result<(), Error> {
    let req = Request::Rebalance {
        name: name.to_owned(),
        action: "status".into(),
        rate_mib: None,
    };
    loop {
        // A timer, not synchronisation: progress is shown once a second.
        std::thread::sleep(Duration::from_secs(1));
        let v: RebalanceView = mgmt_call(opts, &req)?;
        if !opts.json {
            eprintln!("{}", line(&v));
        }
        if v.state != "running" {
            show(opts, &v, view_text);
            return match (v.state.as_str(), v.failed) {
                ("completed", 0) => Ok(()),
                (s, f) => Err(Error::failed(format!(
                    "rebalance of {name} {s} with {f} name(s) not moved{}",
                    v.error.map(|e| format!(": {e}")).unwrap_or_default()
                ))),
            };
        }
    }
}

/// One line of progress.
fn line(v: &RebalanceView) -> String {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    format!(
        "{} {}: {}/{} names, {:.1}/{:.1} MiB, {:.1} MiB/s, ETA {}",
        v.state,
        v.phase,
        v.files_moved,
        v.files_total,
        mib(v.bytes_moved),
        mib(v.bytes_total),
        v.rate_bps / f64::from(1 << 20),
        v.eta_s.map_or("-".into(), |s| format!("{s:.0} s")),
    )
}

/// The report `status` prints.
pub(super) fn view_text(v: &RebalanceView) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Rebalance of {}: {}", v.volume, line(v));
    let _ = writeln!(
        out,
        "  elapsed {:.1} s, {} skipped, {} failed{}",
        v.elapsed_s,
        v.skipped,
        v.failed,
        match v.rate_limit_bps {
            0 => String::new(),
            r => format!(", paced to {} MiB/s", r >> 20),
        }
    );
    for s in &v.sets {
        let _ = writeln!(
            out,
            "  {}{}: out {}/{} names ({} bytes moved), in {} names ({} bytes)  [{}]",
            s.set,
            if s.draining { " (draining)" } else { "" },
            s.moved_out,
            s.files_out,
            s.moved_out_bytes,
            s.moved_in,
            s.moved_in_bytes,
            s.bricks.join(" ")
        );
    }
    if let Some(e) = &v.error {
        let _ = writeln!(out, "  first error: {e}");
    }
    out
}
