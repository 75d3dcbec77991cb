//! `kiln`: the one Kiln command line.

mod auth;
mod bench;
mod demo;
mod generate;
mod image;
mod out;
mod pool;
mod snapshots;
mod tls;
mod volume;

use clap::{CommandFactory, Parser, Subcommand};

/// Kiln: a distributed network file system with an accounted, zero-copy data path.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, propagate_version = true, after_help = out::EXIT_STATUS)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start a local brick on a temporary directory and use it for real: write, read back and
    /// verify data, exercise metadata, and measure.
    Demo(demo::DemoArgs),
    /// Load generator on the native API (fio-like): throughput, latency percentiles, CPU.
    Bench(bench::BenchArgs),
    /// Run a brick server in the foreground (the same as `kilnd`).
    Server(kilnd::ServeArgs),
    /// Mount a volume with FUSE (foreground; stop with SIGTERM or `kiln umount`).
    Mount(kiln_fuse::MountArgs),
    // Help text comes from `NbdArgs`' own doc comment.
    Nbd(kiln_nbd::NbdArgs),
    // Help text comes from `VhostArgs`' own doc comment.
    VhostUserBlk(kiln_vhost::VhostArgs),
    /// VM images: snapshots and clones, dirty records for incremental backups, and the
    /// exclusive lock's holder.
    Image(image::ImageArgs),
    /// Volumes: create, start, stop, delete, info, status, options, bricks (add, remove,
    /// replace), heal, rebalance, profiles and request waterfalls.
    Volume(volume::VolumeArgs),
    /// The trusted storage pool: add (probe), remove (detach) and list the kilnds that share
    /// volume definitions.
    Peer(pool::PeerArgs),
    /// Identities: each client its own key, with what it may do (volumes, read-only, a
    /// subtree, whose credentials), checked by the bricks on every request.
    Auth(auth::AuthArgs),
    /// The pool's members as a table: `kiln pool list`.
    Pool(pool::PoolArgs),
    /// TLS certificates: a CA and identities for bricks and clients.
    Tls(tls::TlsArgs),
    /// Man pages and shell completions (`kiln generate completions bash`).
    Generate(generate::GenerateArgs),
    /// Unmount a Kiln FUSE mount (any other file system there is refused).
    Umount {
        /// The mount point.
        mountpoint: std::path::PathBuf,
        /// Print the result as one JSON object, {"ok": true, "unmounted": DIR}.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> std::process::ExitCode {
    // With --json, even a usage error is an envelope (help and --version are not errors).
    let wants_json = std::env::args_os().any(|a| a == "--json");
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if wants_json && e.use_stderr() => {
            let e = kiln_proto::Error::invalid(e.render().to_string().trim_end());
            println!("{}", out::failed(&e));
            return std::process::ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    // What prints and ends: dies quietly on a closed pipe, and answers --json with the
    // envelope, errors included.
    let one_shot = matches!(
        cli.cmd,
        Cmd::Volume(_)
            | Cmd::Tls(_)
            | Cmd::Peer(_)
            | Cmd::Pool(_)
            | Cmd::Auth(_)
            | Cmd::Umount { .. }
            | Cmd::Image(_)
            | Cmd::Generate(_)
    );
    if one_shot {
        quiet_on_closed_output();
    }
    // The demo and bench run bricks of their own, which a closed pipe must not leave behind:
    // they take --json but keep SIGPIPE ignored.
    let json = (one_shot || matches!(cli.cmd, Cmd::Demo(_) | Cmd::Bench(_))) && wants_json;
    let r = match cli.cmd {
        Cmd::Server(a) => return kilnd::main(a),
        Cmd::Demo(a) => {
            kilnd::init_logging();
            demo::main(a)
        }
        Cmd::Bench(a) => {
            kilnd::init_logging();
            bench::main(a)
        }
        Cmd::Mount(a) => {
            kilnd::init_logging_as(&a.log_tag());
            kiln_fuse::main(a)
        }
        Cmd::Volume(a) => volume::main(a),
        Cmd::Image(a) => image::main(a),
        Cmd::Tls(a) => tls::main(a),
        Cmd::Peer(a) => pool::peer(a),
        Cmd::Pool(a) => pool::pool(a),
        Cmd::Auth(a) => auth::main(a),
        Cmd::Generate(a) => generate::main(a, Cli::command()),
        Cmd::Umount { mountpoint, json } => kiln_fuse::umount(&mountpoint).map(|()| {
            let r = serde_json::json!({ "unmounted": mountpoint.display().to_string() });
            out::show(json, &r, |_| String::new());
        }),
        Cmd::VhostUserBlk(a) => {
            kilnd::init_logging_as(&a.log_tag());
            kiln_vhost::main(a)
        }
        Cmd::Nbd(a) => {
            kilnd::init_logging_as(&a.log_tag());
            kiln_nbd::main(a)
        }
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if json && !out::printed() {
                println!("{}", out::failed(&e));
            }
            eprintln!("kiln: {e}");
            std::process::ExitCode::from(out::exit_status(e.kind()))
        }
    }
}

/// A command that prints and ends (`kiln volume list | head -1`) dies quietly when what reads
/// its output goes away, as `ls` does, instead of panicking in `println!`. Not for the
/// servers, mounts and exports: their sockets must see EPIPE as an error, not end them.
/// (Their own sockets and the management connection send with `MSG_NOSIGNAL` anyway.)
fn quiet_on_closed_output() {
    // SAFETY: restores the default action of one signal before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
