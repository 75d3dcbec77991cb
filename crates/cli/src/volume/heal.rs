//! `kiln volume heal`: what replicas missed, healing it, and full rebuilds of new bricks —
//! on connections of the command's own (heal locks belong to the connection that takes them).

use std::fmt::Write as _;

use kiln_mgmt::response::{Infos, Statuses};
use kiln_mgmt::Request;

use super::{mgmt_call, volume_secret, MgmtOpts, MgmtSecret};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

#[derive(clap::Args, Debug)]
pub(super) struct HealArgs {
    /// The volume's name.
    name: String,
    /// `info`: only list what needs healing (and new bricks' rebuild progress). `full`:
    /// rebuild new bricks (wiped, replaced) in full from their replicas now — or, with
    /// `--brick`, that brick even if it is a member — and show progress until done.
    #[arg(value_parser = ["info", "full"])]
    what: Option<String>,
    /// With `full`: the brick (HOST:/DIR, as `volume info` shows it) to rebuild.
    #[arg(long, value_name = "HOST:/DIR")]
    brick: Option<String>,
    /// The volume's secret (default: KILN_SECRET_FILE, else the local kilnd's state directory).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    opts: MgmtOpts,
}

/// `replace-brick ... --wait`: follows the heal service's rebuild of the brick `new` (as the
/// pool's leader reports it) until it is a member, printing each change of its progress.
pub(super) fn wait_for_rebuild(opts: &MgmtOpts, name: &str, new: &str) -> Result<(), Error> {
    let req = Request::Status {
        name: Some(name.to_owned()),
    };
    // Whether the brick is still new: what the client graph's replicate layers say (they ask a
    // new brick once a second whether it has become a member).
    let secret = volume_secret(name, None, &opts.state_dir)?;
    let key = secret
        .as_deref()
        .map(kiln_client::mgmt::Key::from_file_text);
    let volfile = kiln_client::mgmt::fetch_volfile_with(&opts.server, name, key.as_ref())
        .with_context(|| format!("cannot fetch the graph of {name}"))?;
    let vol = kiln_client::Volume::from_volfile_with_secret(&volfile, secret.as_deref())
        .with_context(|| format!("cannot reach the bricks of {name}"))?;
    let mut said = String::new();
    // A rebuild of this brick finished before the replacement is not this one.
    let t0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs().saturating_sub(1));
    loop {
        let mut st: Statuses = mgmt_call(opts, &req)?;
        let mut v = st
            .volumes
            .pop()
            .ok_or_else(|| Error::not_found("no such volume"))?;
        if v.heal.is_none() {
            // Only the leader heals: ask it.
            if let Some(leader) = v.authority.clone() {
                let at = MgmtOpts {
                    server: leader,
                    json: opts.json,
                    mgmt_secret_file: opts.mgmt_secret_file.clone(),
                    state_dir: opts.state_dir.clone(),
                };
                let mut st: Statuses = mgmt_call(&at, &req)?;
                v = st
                    .volumes
                    .pop()
                    .ok_or_else(|| Error::not_found("no such volume"))?;
            }
        }
        let i = v
            .bricks
            .iter()
            .position(|b| b.brick == new)
            .ok_or_else(|| Error::not_found(format!("volume {name} has no brick {new}")))?;
        let target = format!("{name}-client-{i}");
        let r = v.heal.as_ref().and_then(|h| {
            h.rebuilds
                .iter()
                .find(|r| r.target_name == target && r.since >= t0)
        });
        let line = match r {
            Some(r) => format!("{new}: {}", rebuild_text(r)),
            None => format!("{new}: waiting for the heal service to start its rebuild"),
        };
        if line != said {
            progress(opts.json, &line);
            said = line;
        }
        let still_new = kiln_layer::heal::new_bricks(vol.top())
            .iter()
            .any(|(n, _)| *n == target);
        if !still_new {
            progress(opts.json, &format!("{new}: rebuilt; a member now"));
            vol.shutdown();
            return Ok(());
        }
        // A display interval, not synchronisation.
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// A line of progress: on stdout for a person, on stderr beside a `--json` result.
fn progress(json: bool, line: &str) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// Prints the rebuilds' progress every two seconds until `done`.
fn show_progress(board: &kiln_layer::heal::Board, done: &std::sync::atomic::AtomicBool) {
    let mut last = std::time::Instant::now();
    while !done.load(std::sync::atomic::Ordering::SeqCst) {
        // A display interval, not synchronisation.
        std::thread::sleep(std::time::Duration::from_millis(100));
        if last.elapsed() >= std::time::Duration::from_secs(2) {
            last = std::time::Instant::now();
            for r in board.snapshot() {
                println!("{} {}", r.target_name, rebuild_text(&r));
            }
        }
    }
}

/// `heal full`: flags a rebuild of each new brick, or of the brick `--brick` names.
fn start_rebuilds(a: &HealArgs, vol: &kiln_client::Volume) -> Result<(), Error> {
    use kiln_layer::heal;
    let want = match &a.brick {
        Some(spec) => {
            let req = Request::Info {
                name: Some(a.name.clone()),
            };
            let infos: Infos = mgmt_call(&a.opts, &req)?;
            let v = infos
                .volumes
                .first()
                .ok_or_else(|| Error::not_found("no such volume"))?;
            let i = v
                .def
                .bricks
                .iter()
                .position(|b| b.spec() == *spec)
                .ok_or_else(|| {
                    Error::not_found(format!("volume {} has no brick {spec}", a.name))
                })?;
            Some(format!("{}-client-{i}", a.name))
        }
        None => None,
    };
    let mut started = 0;
    for l in heal::replicate_layers(vol.top()) {
        let r = l
            .as_any()
            .and_then(|x| x.downcast_ref::<kiln_layer::replicate::Replicate>())
            .ok_or("not a replicate layer")
            .map_err(Error::failed)?;
        for (t, k) in r.replicas().iter().enumerate() {
            let named = want.as_deref() == Some(k.name());
            if !(named || (want.is_none() && k.joining())) {
                continue;
            }
            let leave = named && !k.joining();
            kiln_layer::exec::block_on(heal::start_rebuild(r, t, leave)).map_err(|e| {
                Error::failed(format!("cannot start a rebuild of {}: errno {e}", k.name()))
            })?;
            started += 1;
        }
    }
    if started == 0 {
        return Err(match want {
            Some(w) => Error::not_found(format!("{w} is not a replica in this graph")),
            None => Error::invalid(format!(
                "no brick of {} is new: name one with --brick HOST:/DIR to rebuild it from \
                 its replicas",
                a.name
            )),
        });
    }
    Ok(())
}

/// `kiln volume heal NAME [info]`: runs on connections of its own (heal locks belong to the
/// connection that takes them).
pub(super) fn heal(a: &HealArgs) -> Result<(), Error> {
    use kiln_layer::exec::block_on;
    use kiln_layer::heal;
    let secret = volume_secret(&a.name, a.secret_file.as_deref(), &a.opts.state_dir)?;
    let key = secret
        .as_deref()
        .map(kiln_client::mgmt::Key::from_file_text);
    let volfile = kiln_client::mgmt::fetch_volfile_with(&a.opts.server, &a.name, key.as_ref())
        .with_context(|| format!("cannot fetch the graph of {}", a.name))?;
    // Heal opens are kilnd's own: with the management secret at hand (root on a pool host),
    // the bricks are reached as kilnd's internal identity, which a volume that squashes root
    // does not refuse them to.
    let service = match (&a.secret_file, a.opts.secret()) {
        (None, Ok(MgmtSecret::From(_, s))) => {
            Some(kiln_mgmt::identities::service_key(&s, &a.name).into_bytes())
        }
        _ => None,
    };
    let bricks_key = service.as_deref().or(secret.as_deref());
    let vol = kiln_client::Volume::from_volfile_with_secret(&volfile, bricks_key)
        .with_context(|| format!("cannot reach the bricks of {}", a.name))?;
    if heal::replicate_layers(vol.top()).is_empty() {
        return Err(Error::invalid(format!(
            "{} is not replicated: nothing to heal",
            a.name
        )));
    }
    let full = a.what.as_deref() == Some("full");
    if a.brick.is_some() && !full {
        return Err(Error::invalid("--brick goes with `full`"));
    }
    if full {
        start_rebuilds(a, &vol)?;
    }
    if a.what.as_deref() == Some("info") {
        return print_info(a, &vol);
    }
    let t0 = std::time::Instant::now();
    let quiet = a.opts.json;
    let board = heal::Board::default();
    let done = std::sync::atomic::AtomicBool::new(false);
    let report = std::thread::scope(|sc| {
        if full && !quiet {
            sc.spawn(|| show_progress(&board, &done));
        }
        let r = block_on(heal::run_with(
            vol.top(),
            &|n, bytes| {
                if !quiet && !full {
                    println!("healed {} on {}: {bytes} bytes", n.path, n.target_name);
                }
            },
            &board,
        ));
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    });
    if !quiet {
        for r in board.snapshot() {
            println!("{} {}", r.target_name, rebuild_text(&r));
        }
    }
    let failed = (!report.errors.is_empty()).then(|| {
        Error::failed(format!(
            "{} file(s) could not be healed",
            report.errors.len()
        ))
    });
    if a.opts.json {
        match &failed {
            None => crate::out::show(true, &report, |_| String::new()),
            Some(e) => crate::out::show_failed(&report, e),
        }
    } else {
        println!(
            "heal of {}: {} file(s), {} bytes moved in {:.2} s; {} left for later",
            a.name,
            report.files,
            report.bytes,
            t0.elapsed().as_secs_f64(),
            report.left
        );
        for e in &report.errors {
            println!("  error: {e}");
        }
    }
    failed.map_or(Ok(()), Err)
}

/// `heal NAME info`: the files behind, the bricks not asked, new bricks and their rebuilds.
fn print_info(a: &HealArgs, vol: &kiln_client::Volume) -> Result<(), Error> {
    use kiln_layer::exec::block_on;
    use kiln_layer::heal;
    let info = block_on(heal::info_from_reachable(vol.top()));
    if a.opts.json {
        crate::out::show(true, &info, |_| String::new());
        return Ok(());
    }
    let need = &info.needs;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Heal backlog of volume {}: {} file(s)",
        a.name,
        need.len()
    );
    if !info.unasked.is_empty() {
        let _ = writeln!(
            out,
            "Not asked (down or not answering): {}; files only they know of are not listed",
            info.unasked.join(", ")
        );
    }
    if !need.is_empty() {
        let _ = writeln!(
            out,
            "{:<18} {:<24} {:>8} {:>24}  File",
            "Replica set", "Replica behind", "Ranges", "Missed"
        );
    }
    for n in need {
        // What the replica missed: its name (created, removed, renamed), its attributes
        // (mode, owner, times, xattrs), data bytes.
        let mut missed = Vec::new();
        if n.suspect {
            // A client died changing it: which replica differs is not known yet.
            missed.push("suspect (client died mid-change)".to_owned());
        }
        if n.entry {
            missed.push("name".to_owned());
        }
        if n.metadata {
            missed.push("attrs".to_owned());
        }
        if n.bytes > u64::MAX / 2 {
            missed.push("whole file".to_owned());
        } else if n.ranges > 0 {
            missed.push(format!("{} bytes", n.bytes));
        }
        let bytes = missed.join(" + ");
        let down = if n.target_up { "" } else { " (down)" };
        let _ = writeln!(
            out,
            "{:<18} {:<24} {:>8} {:>24}  {}",
            n.set,
            format!("{}{down}", n.target_name),
            n.ranges,
            bytes,
            n.path
        );
    }
    for (name, up) in heal::new_bricks(vol.top()) {
        let _ = writeln!(
            out,
            "{name} is NEW (wiped or replaced): it serves no reads until rebuilt{}",
            if up { "" } else { " (down)" }
        );
    }
    // The heal service's progress, when this kilnd runs the rebuild.
    let req = Request::Status {
        name: Some(a.name.clone()),
    };
    if let Ok(st) = mgmt_call::<Statuses>(&a.opts, &req) {
        for v in &st.volumes {
            for r in v.heal.iter().flat_map(|h| &h.rebuilds) {
                let _ = writeln!(out, "{} {}", r.target_name, rebuild_text(r));
            }
        }
    }
    print!("{out}");
    Ok(())
}

/// The brick index in a protocol-client layer's name (`VOL-client-N`).
pub(super) fn brick_of(layer: &str) -> Option<usize> {
    layer.rsplit_once("-client-")?.1.parse().ok()
}

/// One rebuild's progress: "rebuilding: N of M names, X of Y bytes, R/s, about S s left".
pub(super) fn rebuild_text(r: &kiln_layer::heal::Rebuild) -> String {
    if r.done {
        return format!(
            "rebuilt: {} names, {} bytes; a member again",
            r.files_total, r.bytes_total
        );
    }
    let pct = if r.bytes_total > 0 {
        100.0 * r.bytes_done as f64 / r.bytes_total as f64
    } else {
        0.0
    };
    let eta = match r.eta {
        Some(s) => format!(", about {s} s left"),
        None => String::new(),
    };
    format!(
        "is NEW, being rebuilt: {} of {} names, {} of {} bytes ({pct:.0}%), {:.1} MB/s{eta}",
        r.files_done,
        r.files_total,
        r.bytes_done,
        r.bytes_total,
        r.rate / 1e6
    )
}
