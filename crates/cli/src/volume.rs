//! `kiln volume …`: operator commands on a volume.
//!
//! `create`, `start`, `stop`, `delete`, `info`, `status`, `list` and `volfile` talk to a kilnd
//! management daemon (`--server`, default `tcp:127.0.0.1:24007`) with JSON requests over the
//! MGMT fop (see `kiln_mgmt`), proving the management secret: `--mgmt-secret-file`,
//! else `KILN_MGMT_SECRET_FILE`, else `STATE_DIR/mgmt.secret` (`--state-dir`, default
//! `/var/lib/kiln`: root can read it on a kilnd host). Only `volfile` works without it.
//! `heal` fetches the volfile and works on the bricks with the volume's secret. `profile`
//! asks kilnd where the volume's bricks run, then the bricks themselves (with the volume's
//! secret) and every client that announced a metrics endpoint to them (mounts, NBD exports).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kiln_mgmt::response::{Changed, Deleted, Health, Infos, Names, Statuses, VolfileText};
use kiln_mgmt::{options, Request, VolState};
use kiln_proto::error::Context as _;
use kiln_proto::{Error, Kind};
use serde::{de::DeserializeOwned, Serialize};

mod create;
mod heal;
mod profile;
mod rebalance;
use create::{create, replica_and_bricks, CreateArgs};
use heal::HealArgs;
use rebalance::{RebalanceArgs, RemoveBrickArgs};

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
    Profile(profile::ProfileArgs),
    /// The layer types a volume graph (volfile) may use, with their options.
    Layers {
        /// Print one JSON object, {"ok": true, "layers": [{"name", "side", "doc", "options":
        /// [{"name", "type", "default", "doc"}, …]}, …]}.
        #[arg(long)]
        json: bool,
    },
    /// Define a volume: `kiln volume create NAME [replica N] HOST:/DIR...`.
    ///
    /// Bricks are `HOST:/DIR` or `HOST:MGMTPORT:/DIR` (MGMTPORT: the management port of that
    /// host's kilnd when not 24007). With `replica N` every N consecutive bricks hold the same
    /// files (a replica set); more than one set spreads files over the sets. Brick directories
    /// are created when missing; a directory inside another brick is refused. Every host with
    /// a brick must be in the pool (`kiln peer probe`). The definition and a new random secret
    /// for the bricks go to the pool's store, on every member (the secret also in
    /// STATE_DIR/vols/NAME/secret, mode 0600).
    #[command(
        after_help = "Examples:\n  kiln volume create vol1 replica 3 10.0.0.1:/srv/b1 \
                            10.0.0.2:/srv/b1 10.0.0.3:/srv/b1\n  kiln volume create scratch \
                            127.0.0.1:/srv/scratch"
    )]
    Create(CreateArgs),
    /// Change a volume option: `kiln volume set NAME OPTION VALUE` (`--help` lists the
    /// options). For options of the bricks, a started volume's bricks restart (clients
    /// reconnect by themselves); running clients take the others within a second.
    Set(SetArgs),
    /// Show a volume's options (`all`, or one): value, default, type, whether bricks restart
    /// to take it, and what it does; with the pool store version they were read at.
    #[command(
        after_help = "Examples:\n  kiln volume get vol1\n  kiln volume get vol1 io-timeout --json"
    )]
    Get(GetArgs),
    /// Put an option (or `all`) back to its default.
    Reset(GetArgs),
    /// Start a volume's bricks (each brick a process on its host); `force` also restarts bricks
    /// that are down in a started volume.
    Start(StartArgs),
    /// Stop a volume's bricks (SIGTERM; clients lose access until the next start). Asks first
    /// at a terminal; scripts pass --yes.
    Stop(DestroyArgs),
    /// Add bricks to a volume, online: `kiln volume add-brick NAME [replica N] HOST:/DIR...`.
    ///
    /// With N the volume's replica count (or no `replica`): whole new replica sets. The new
    /// bricks start empty and run at once in a started volume; running clients switch to the
    /// grown volume within a second and new files land on the new sets from then on. Files
    /// already there stay where they are and are found there; `rebalance NAME start` moves
    /// them where the new layout wants them.
    ///
    /// With N above it: the replica count is raised. Give N - R new bricks for each replica
    /// set, set by set; they are rebuilt in full from the set's bricks by the heal service
    /// (`status NAME` shows the progress) while clients go on.
    #[command(
        after_help = "Examples:\n  kiln volume add-brick vol1 10.0.0.4:/srv/b1 10.0.0.5:/srv/b1 \
                            10.0.0.6:/srv/b1\n  kiln volume add-brick scratch 127.0.0.1:/srv/scratch2\n  \
                      kiln volume add-brick single replica 3 10.0.0.2:/srv/b 10.0.0.3:/srv/b"
    )]
    AddBrick(CreateLikeArgs),
    /// Take whole replica sets out of a volume, online: `start` drains them (no new files; a
    /// rebalance moves theirs to the other sets while clients keep using them), `status`
    /// shows progress, `stop` keeps them, `commit` takes them out once nothing is left.
    #[command(after_help = "Examples:
  kiln volume remove-brick vol1 h4:/srv/b1 h5:/srv/b1 h6:/srv/b1 start --wait
                        kiln volume remove-brick vol1 h4:/srv/b1 h5:/srv/b1 h6:/srv/b1 commit")]
    RemoveBrick(RemoveBrickArgs),
    /// Move files to the replica sets the volume's layout places them on (after add-brick),
    /// while clients keep using them — open files included: `start`, `stop`, `status` (names
    /// and bytes found and moved per set, rate, ETA; also in `status` and /metrics).
    #[command(after_help = "Examples:
  kiln volume rebalance vol1 start --wait
                        kiln volume rebalance vol1 start --rate 100
  kiln volume rebalance vol1 status")]
    Rebalance(RebalanceArgs),
    /// Put a new, empty brick in the place of one (dead, or to be retired) in a replicated
    /// volume. The new brick serves no reads until the heal service has rebuilt it in full
    /// from its replicas; `heal NAME info` and `status NAME` show the progress.
    ReplaceBrick(ReplaceArgs),
    /// Forget a stopped volume's definition and secret (the data in the bricks stays). Asks
    /// first at a terminal; scripts pass --yes.
    Delete(DestroyArgs),
    /// Definitions: name, type, state, bricks (all volumes without NAME).
    Info(MaybeNameArgs),
    /// Every brick's port, pid, metrics port and whether it answers (all volumes without
    /// NAME); --clients adds the mounts' and exports' /metrics endpoints.
    Status(StatusArgs),
    /// Names of the volumes the server knows.
    List(MgmtOpts),
    /// Print the client volume graph (TOML) of a started volume, as clients fetch it.
    Volfile(NameArgs),
    /// Self-heal: `heal NAME info` lists the files a replica missed changes of (per replica,
    /// the marked ranges and bytes); `heal NAME` copies exactly those ranges to the replicas
    /// that are back, while I/O goes on, and prints progress and the bytes moved.
    Heal(HealArgs),
}

/// Options every management command takes.
#[derive(clap::Args, Debug)]
pub(crate) struct MgmtOpts {
    /// The kilnd management address (tcp:HOST:PORT or HOST:PORT).
    #[arg(long, default_value = kiln_client::mgmt::DEFAULT_SERVER)]
    pub(crate) server: String,
    /// Print the server's JSON reply instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// The kilnd's management secret (default: KILN_MGMT_SECRET_FILE, else
    /// STATE_DIR/mgmt.secret). Every command but `volfile` needs it.
    #[arg(long, value_name = "PATH")]
    mgmt_secret_file: Option<PathBuf>,
    /// The state directory of this host's kilnd, where the default management secret and the
    /// volume secrets are (readable by root).
    #[arg(long, value_name = "DIR", default_value = kiln_client::mgmt::DEFAULT_STATE_DIR)]
    pub(crate) state_dir: PathBuf,
}

/// The management secret a command proves, or why there is none (for the refusal's hint).
enum MgmtSecret {
    /// Read from this file.
    From(PathBuf, Vec<u8>),
    /// None: the default file and what was wrong with it.
    Missing(PathBuf, String),
}

impl MgmtOpts {
    /// Finds the management secret. A file named explicitly must be readable; the default one
    /// may be missing or root's (`volfile` needs no secret).
    fn secret(&self) -> Result<MgmtSecret, Error> {
        let explicit =
            self.mgmt_secret_file.is_some() || std::env::var_os("KILN_MGMT_SECRET_FILE").is_some();
        let default = self.state_dir.join(kiln_client::mgmt::MGMT_SECRET_FILE);
        let Some(path) =
            kiln_client::mgmt::mgmt_secret_file(self.mgmt_secret_file.as_deref(), &self.state_dir)
        else {
            return Ok(MgmtSecret::Missing(default, "it does not exist".into()));
        };
        match kiln_client::mgmt::read_secret(&path) {
            Ok(s) if !s.is_empty() => Ok(MgmtSecret::From(path, s)),
            Ok(_) if explicit => Err(Error::failed(format!(
                "management secret file {} is empty",
                path.display()
            ))),
            Ok(_) => Ok(MgmtSecret::Missing(path, "it is empty".into())),
            Err(e) if explicit => Err(Error::from(e)),
            Err(e) => Ok(MgmtSecret::Missing(
                path,
                format!("cannot read it ({}): run as root", e.kind()),
            )),
        }
    }
}

/// What to do when the kilnd refused for want of the right management secret.
fn secret_hint(secret: &MgmtSecret) -> String {
    match secret {
        MgmtSecret::Missing(path, why) => format!(
            ". No management secret: {} — {why}. On a kilnd host run kiln as root (it reads \
             STATE_DIR/mgmt.secret; --state-dir if not /var/lib/kiln); elsewhere copy that \
             file from the kilnd host and pass --mgmt-secret-file PATH (or set \
             KILN_MGMT_SECRET_FILE)",
            path.display()
        ),
        MgmtSecret::From(path, _) => format!(
            ". {} does not hold this kilnd's management secret: use a copy of the kilnd's \
             STATE_DIR/mgmt.secret (or of the file its --mgmt-secret-file names)",
            path.display()
        ),
    }
}

#[derive(clap::Args, Debug)]
struct CreateLikeArgs {
    /// The volume's name.
    name: String,
    /// `replica N` (optional), then the bricks: HOST:/DIR or HOST:MGMTPORT:/DIR.
    #[arg(required = true, value_name = "[replica N] HOST:/DIR")]
    args: Vec<String>,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::Args, Debug)]
struct SetArgs {
    /// The volume's name.
    name: String,
    /// The option (each is listed below: what it does, the values it takes, its default).
    /// `kiln volume get VOL all` shows their values now.
    #[arg(value_parser = option_names())]
    option: String,
    /// Its value, of the type the option takes. Values are parsed strictly: `On` is not `on`,
    /// a sign or spaces around a number are refused, and an empty item in a list (`,,,`)
    /// never reads as "all". A started volume's bricks restart to take an option that says
    /// so; running clients take the others within a second.
    value: String,
    #[command(flatten)]
    opts: MgmtOpts,
}

/// The volume options as `set` takes them, each with its help (from the options table, so
/// `--help` and the man page list every option).
fn option_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(options::OPTIONS.iter().map(|s| {
        let restarts = if s.restarts_bricks {
            "; a started volume's bricks restart to take it"
        } else {
            ""
        };
        clap::builder::PossibleValue::new(s.name).help(format!(
            "{}. Takes {}; default {}{restarts}",
            s.description, s.kind, s.default
        ))
    }))
}

#[derive(clap::Args, Debug)]
struct GetArgs {
    /// The volume's name.
    name: String,
    /// The option, or `all`.
    #[arg(default_value = "all")]
    option: String,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::Args, Debug)]
struct StartArgs {
    /// The volume's name.
    name: String,
    /// `force`: start the bricks that are down even if the volume is started.
    #[arg(value_parser = ["force"])]
    force: Option<String>,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::Args, Debug)]
struct ReplaceArgs {
    /// The volume's name.
    name: String,
    /// The brick to replace, as `volume info` shows it (HOST:/DIR).
    old: String,
    /// The new brick (HOST:/DIR): an empty or missing directory.
    new: String,
    /// `commit force`, as GlusterFS spells it: accepted, and what Kiln always does (the new
    /// brick takes the old one's place at once and is rebuilt from its replicas).
    #[arg(value_parser = ["commit"])]
    commit: Option<String>,
    /// The second word of `commit force`.
    #[arg(value_parser = ["force"], requires = "commit")]
    force: Option<String>,
    /// Wait for the heal service to rebuild the new brick, printing its progress until it is
    /// a member (Ctrl-C stops waiting, not the rebuild).
    #[arg(long)]
    wait: bool,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::Args, Debug)]
struct NameArgs {
    /// The volume's name.
    name: String,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::Args, Debug)]
struct DestroyArgs {
    /// The volume's name.
    name: String,
    /// Do not ask.
    #[arg(long, short = 'y')]
    yes: bool,
    #[command(flatten)]
    opts: MgmtOpts,
}

#[derive(clap::Args, Debug)]
struct MaybeNameArgs {
    /// The volume's name (default: every volume).
    name: Option<String>,
    #[command(flatten)]
    opts: MgmtOpts,
}

/// `status`.
#[derive(clap::Args, Debug)]
struct StatusArgs {
    /// The volume's name (default: every volume).
    name: Option<String>,
    /// Also list the clients of each started volume that serve /metrics (mounts, NBD and
    /// vhost-user-blk exports), as its bricks know them: one address each, on the client's
    /// host.
    #[arg(long)]
    clients: bool,
    #[command(flatten)]
    opts: MgmtOpts,
}

/// `kiln volume`.
pub fn main(args: VolumeArgs) -> Result<(), Error> {
    match args.cmd {
        VolumeCmd::Layers { json } => {
            crate::out::show(json, &layers_json(), |_| layers_text());
            Ok(())
        }
        VolumeCmd::Profile(p) => profile::profile(&p),
        VolumeCmd::Heal(a) => heal::heal(&a),
        VolumeCmd::Rebalance(a) => rebalance::rebalance(&a),
        VolumeCmd::RemoveBrick(a) => rebalance::remove_brick(&a),
        VolumeCmd::Create(a) => create(&a),
        VolumeCmd::Set(a) => set(&a),
        VolumeCmd::Get(a) => get(&a),
        VolumeCmd::Reset(a) => reset(&a),
        VolumeCmd::Start(a) => {
            let req = Request::Start {
                name: a.name.clone(),
                force: a.force.is_some(),
            };
            done(&a.opts, "start", &a.name, &mgmt_call(&a.opts, &req)?)
        }
        VolumeCmd::AddBrick(a) => {
            let (replica, bricks) = replica_and_bricks("add-brick", &a.name, &a.args)?;
            let req = Request::AddBrick {
                name: a.name.clone(),
                replica,
                bricks,
            };
            done(&a.opts, "add-brick", &a.name, &mgmt_call(&a.opts, &req)?)
        }
        VolumeCmd::ReplaceBrick(a) => {
            let req = Request::ReplaceBrick {
                name: a.name.clone(),
                old: a.old.clone(),
                new: a.new.clone(),
            };
            done(
                &a.opts,
                "replace-brick",
                &a.name,
                &mgmt_call(&a.opts, &req)?,
            )?;
            match a.wait {
                true => heal::wait_for_rebuild(&a.opts, &a.name, &a.new),
                false => Ok(()),
            }
        }
        VolumeCmd::Stop(a) => stop(&a),
        VolumeCmd::Delete(a) => delete(&a),
        VolumeCmd::Info(a) => {
            let req = Request::Info {
                name: a.name.clone(),
            };
            show(&a.opts, &mgmt_call::<Infos>(&a.opts, &req)?, info_text);
            Ok(())
        }
        VolumeCmd::Status(a) => status(&a),
        VolumeCmd::List(o) => {
            show(&o, &mgmt_call::<Names>(&o, &Request::List)?, |r| {
                if r.volumes.is_empty() {
                    "No volumes present\n".to_owned()
                } else {
                    r.volumes.iter().map(|n| format!("{n}\n")).collect()
                }
            });
            Ok(())
        }
        VolumeCmd::Volfile(a) => {
            let req = Request::Volfile {
                name: a.name.clone(),
            };
            show(&a.opts, &mgmt_call::<VolfileText>(&a.opts, &req)?, |r| {
                r.volfile.clone()
            });
            Ok(())
        }
    }
}

/// `volume stop`, after asking.
fn stop(a: &DestroyArgs) -> Result<(), Error> {
    if !a.yes {
        create::confirm(
            &format!("volume stop: {}", a.name),
            "stopping a volume makes its data unreachable to every client until it starts again",
            &format!("Stop volume {}?", a.name),
        )?;
    }
    let req = Request::Stop {
        name: a.name.clone(),
    };
    done(&a.opts, "stop", &a.name, &mgmt_call(&a.opts, &req)?)
}

/// `volume delete`, after asking.
fn delete(a: &DestroyArgs) -> Result<(), Error> {
    if !a.yes {
        create::confirm(
            &format!("volume delete: {}", a.name),
            "deleting a volume forgets its definition and its bricks' secret (the files stay \
             in the brick directories)",
            &format!("Delete volume {}?", a.name),
        )?;
    }
    let req = Request::Delete {
        name: a.name.clone(),
    };
    let r: Deleted = mgmt_call(&a.opts, &req)?;
    show(&a.opts, &r, |_| {
        format!("volume delete: {}: success\n", a.name)
    });
    warn(&r.warnings);
    Ok(())
}

/// The secret of volume `name`'s bricks: `explicit`, else `KILN_SECRET_FILE`, else
/// `STATE_DIR/vols/NAME/secret` when readable; none when nothing is found.
pub(crate) fn volume_secret(
    name: &str,
    explicit: Option<&Path>,
    state_dir: &Path,
) -> Result<Option<Vec<u8>>, Error> {
    match kiln_client::mgmt::secret_file_in(name, explicit, state_dir) {
        Some(p) => kiln_client::mgmt::read_secret(&p)
            .map(Some)
            .map_err(Error::from),
        None => Ok(None),
    }
}

/// One request to the management daemon, proving the management secret, and its reply of
/// type `T` (the one `req` names); errors read like `volume start: NAME: failed: …`, and a
/// refusal for want of the secret says what to do.
pub(crate) fn mgmt_call<T: DeserializeOwned>(opts: &MgmtOpts, req: &Request) -> Result<T, Error> {
    // `peer probe`, `pool list`; `volume start`.
    let what = match req.cmd() {
        c if c.starts_with("peer-") || c.starts_with("pool-") => c.replacen('-', " ", 1),
        "auth" => "auth".to_owned(),
        c => format!("volume {c}"),
    };
    let json = &req.to_json();
    // The kind stays; the sentence says which command on which volume failed.
    let fail = |e: Error| {
        let msg = match json["name"].as_str() {
            Some(n) => {
                let m = e.message();
                let m = m.strip_prefix(&format!("volume {n}: ")).unwrap_or(m);
                format!("{what}: {n}: failed: {m}")
            }
            None => format!("{what}: failed: {}", e.message()),
        };
        Error::new(e.kind(), msg)
    };
    let secret = opts.secret().map_err(fail)?;
    let key = match &secret {
        MgmtSecret::From(_, s) => Some(s.as_slice()),
        MgmtSecret::Missing(..) => None,
    };
    let v = kiln_client::mgmt::call_with_secret(&opts.server, json, key).map_err(|e| {
        // The key was refused (not a command the kilnd denied it): say what to do about it.
        let denied = e.kind() == Kind::Denied && e.raw_os_error() == Some(libc::EACCES);
        let e = fail(e);
        if denied {
            Error::new(e.kind(), e.message().to_owned() + &secret_hint(&secret))
        } else {
            e
        }
    })?;
    kiln_mgmt::response::decode_value(v).map_err(fail)
}

/// Prints a reply: as the wire's JSON object (its fields beside `"ok": true`) with `--json`,
/// else as `text` renders it.
pub(crate) fn show<T: Serialize>(opts: &MgmtOpts, r: &T, text: impl FnOnce(&T) -> String) {
    crate::out::show(opts.json, r, text);
}

pub(crate) fn warn(warnings: &[String]) {
    for w in warnings {
        eprintln!("kiln: warning: {w}");
    }
}

/// Prints the success line of a change (or the JSON reply) and any warnings.
fn done(opts: &MgmtOpts, what: &str, name: &str, r: &Changed) -> Result<(), Error> {
    show(opts, r, |_| format!("volume {what}: {name}: success\n"));
    warn(&r.warnings);
    Ok(())
}

fn set(a: &SetArgs) -> Result<(), Error> {
    let req = options::set_request(&a.name, &a.option, &a.value)
        .with_context(|| format!("volume set: {}", a.name))?;
    done(&a.opts, "set", &a.name, &mgmt_call(&a.opts, &req)?)
}

/// `reset`: the option (or every one) back to its default, as one `set`.
fn reset(a: &GetArgs) -> Result<(), Error> {
    let fail = |e: Error| e.context(format_args!("volume reset: {}", a.name));
    let names: Vec<&str> = match a.option.as_str() {
        "all" => options::OPTIONS
            .iter()
            .filter(|s| !s.create_only)
            .map(|s| s.name)
            .collect(),
        n => vec![options::spec(n).map_err(fail)?.name],
    };
    let req = options::reset_request(&a.name, &names).map_err(fail)?;
    done(&a.opts, "reset", &a.name, &mgmt_call(&a.opts, &req)?)
}

/// `get`: from the definition as `info` returns it (with the store version it was read at).
fn get(a: &GetArgs) -> Result<(), Error> {
    if a.option != "all" {
        options::spec(&a.option).with_context(|| format!("volume get: {}", a.name))?;
    }
    let req = Request::Info {
        name: Some(a.name.clone()),
    };
    let infos: Infos = mgmt_call(&a.opts, &req)?;
    let def = &infos
        .volumes
        .first()
        .ok_or_else(|| Error::not_found("volume get: no such volume"))?
        .def;
    let option = Some(a.option.as_str());
    let values = options::values(def, option).with_context(|| format!("volume get: {}", a.name))?;
    let r = OptionValues {
        volume: a.name.clone(),
        version: infos.version,
        options: values,
    };
    show(&a.opts, &r, |r| {
        let mut out = format!(
            "{:<14} {:<24} {:<8} RESTARTS BRICKS\n",
            "OPTION", "VALUE", "DEFAULT"
        );
        for o in &r.options {
            let restarts = if o.restarts_bricks { "yes" } else { "no" };
            out += &format!(
                "{:<14} {:<24} {:<8} {restarts}\n",
                o.name, o.value, o.default
            );
        }
        if a.option == "all" {
            out += "\n";
            for o in &r.options {
                out += &format!("{}: {} ({})\n", o.name, o.description, o.kind);
            }
        }
        out
    });
    Ok(())
}

/// `get`'s reply.
#[derive(serde::Serialize)]
struct OptionValues {
    volume: String,
    version: u64,
    options: Vec<options::OptionValue>,
}

fn info_text(r: &Infos) -> String {
    let mut out = String::new();
    if r.volumes.is_empty() {
        out.push_str("No volumes present\n");
    }
    for v in &r.volumes {
        let d = &v.def;
        let replica = d.replica.max(1);
        let n = d.bricks.len();
        let _ = writeln!(out, "\nVolume Name: {}", d.name);
        let _ = writeln!(out, "Type: {}", v.kind.word());
        let _ = writeln!(out, "Volume ID: {}", d.id);
        let _ = writeln!(out, "Status: {}", v.state_word);
        let _ = writeln!(
            out,
            "Number of Bricks: {} x {} = {}",
            n / replica,
            replica,
            n
        );
        let _ = writeln!(
            out,
            "Clients allowed from: {}",
            if d.allow.is_empty() {
                "anywhere".to_owned()
            } else {
                d.allow.join(", ")
            }
        );
        let squash = if d.root_squash { "on" } else { "off" };
        let _ = writeln!(out, "Root squash: {squash}");
        let _ = writeln!(out, "I/O timeout: {} s", d.io_timeout.unwrap_or(30));
        if let Some(b) = d.shard_block {
            let _ = writeln!(
                out,
                "Shards: pieces of {}",
                kiln_mgmt::options::size_text(b)
            );
        }
        let _ = writeln!(out, "Bricks:");
        for (i, b) in d.bricks.iter().enumerate() {
            let _ = writeln!(out, "Brick{}: {}", i + 1, b.spec());
        }
    }
    if r.version > 0 {
        let _ = writeln!(out, "\n(pool store version {})", r.version);
    }
    out
}

/// The status, and with `--clients` the clients' endpoints by volume.
#[derive(Serialize)]
struct StatusReply {
    #[serde(flatten)]
    statuses: Statuses,
    #[serde(skip_serializing_if = "Option::is_none")]
    clients: Option<std::collections::BTreeMap<String, Vec<String>>>,
}

fn status(a: &StatusArgs) -> Result<(), Error> {
    let req = Request::Status {
        name: a.name.clone(),
    };
    let statuses: Statuses = mgmt_call(&a.opts, &req)?;
    let clients = a.clients.then(|| {
        let mut by_volume = std::collections::BTreeMap::new();
        for v in statuses
            .volumes
            .iter()
            .filter(|v| v.state == VolState::Started)
        {
            match profile::client_endpoints(&a.opts, v) {
                Ok((eps, failed)) => {
                    for e in failed {
                        eprintln!("kiln: volume {}: {e}", v.name);
                    }
                    by_volume.insert(v.name.clone(), eps);
                }
                Err(e) => eprintln!("kiln: volume {}: clients not listed: {e}", v.name),
            }
        }
        by_volume
    });
    let r = StatusReply { statuses, clients };
    show(&a.opts, &r, |r| {
        let mut out = status_text(&r.statuses);
        for (name, eps) in r.clients.iter().flatten() {
            let _ = writeln!(out, "Clients of {name} serving /metrics: {}", eps.len());
            for e in eps {
                let _ = writeln!(out, "  http://{e}/metrics");
            }
        }
        if let Some(m) = &r.statuses.metrics {
            let _ = writeln!(out, "This kilnd serves /metrics at http://{m}/metrics");
        }
        out
    });
    Ok(())
}

fn status_text(r: &Statuses) -> String {
    let mut out = String::new();
    if r.volumes.is_empty() {
        out.push_str("No volumes present\n");
    }
    for v in &r.volumes {
        let name = &v.name;
        let _ = writeln!(out, "Status of volume: {name}");
        if v.state != VolState::Started {
            let _ = writeln!(out, "Volume {name} is not started\n");
            continue;
        }
        let _ = writeln!(
            out,
            "{:<50} {:>8} {:>7} {:>8} {:>8}",
            "Brick", "TCP Port", "Online", "Pid", "Metrics"
        );
        let _ = writeln!(out, "{}", "-".repeat(85));
        for b in &v.bricks {
            let shown = |x: Option<String>| x.filter(|_| b.online).unwrap_or("N/A".into());
            let _ = writeln!(
                out,
                "{:<50} {:>8} {:>7} {:>8} {:>8}",
                format!("Brick {}", b.brick),
                shown(b.port.map(|p| p.to_string())),
                if b.online { "Y" } else { "N" },
                shown(b.pid.map(|p| p.to_string())),
                shown(b.metrics_port.map(|p| p.to_string())),
            );
        }
        for b in &v.bricks {
            if let Some(s) = b.space.filter(|s| s.full()) {
                let _ = writeln!(
                    out,
                    "Brick {} is FULL: {} bytes free of {} (writes fail with ENOSPC)",
                    b.brick, s.free, s.size
                );
            }
            match &b.health {
                Some(h) if h.read_only => {
                    let _ = writeln!(
                        out,
                        "Brick {} is FAILING: its file system is read-only (writes fail with EROFS)",
                        b.brick
                    );
                }
                Some(Health {
                    write_error: Some(e),
                    ..
                }) => {
                    let _ = writeln!(
                        out,
                        "Brick {} is FAILING: a test write to it failed: {e}",
                        b.brick
                    );
                }
                _ => {}
            }
        }
        if let Some(h) = &v.heal {
            for r in &h.rebuilds {
                let spec = heal::brick_of(&r.target_name)
                    .and_then(|i| v.bricks.get(i))
                    .map_or(r.target_name.clone(), |b| b.brick.clone());
                let _ = writeln!(out, "Brick {spec} {}", heal::rebuild_text(r));
            }
            let _ = writeln!(
                out,
                "Heal service: backlog {} file(s); healed {} file(s), {} bytes since kilnd started{}",
                h.backlog,
                h.healed_files,
                h.healed_bytes,
                h.last_error
                    .as_ref()
                    .map_or(String::new(), |e| format!("; last error: {e}"))
            );
        }
        if let Some(r) = &v.rebalance {
            out.push_str(&rebalance::view_text(r));
        }
        out.push('\n');
    }
    out
}

fn layers_json() -> serde_json::Value {
    let layers: Vec<serde_json::Value> = kiln_layer::volfile::TYPES
        .iter()
        .map(|t| {
            let options: Vec<serde_json::Value> = t
                .options
                .iter()
                .map(|o| {
                    serde_json::json!({
                        "name": o.name, "type": o.ty, "default": o.default, "doc": o.text(),
                    })
                })
                .collect();
            serde_json::json!({ "name": t.name, "side": t.side, "doc": t.doc, "options": options })
        })
        .collect();
    serde_json::json!({ "layers": layers })
}

fn layers_text() -> String {
    let mut out = String::new();
    for t in kiln_layer::volfile::TYPES {
        let _ = writeln!(out, "{} ({})\n  {}", t.name, t.side, t.doc);
        for o in t.options {
            let _ = writeln!(
                out,
                "    {:<14} {:<24} default {:<16} {}",
                o.name,
                o.ty,
                o.default,
                o.text()
            );
        }
    }
    out
}
