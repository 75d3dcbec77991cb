//! `kiln nbd`: exports a VM image that lives on a Kiln volume as an NBD (Network Block Device)
//! export, so QEMU, qemu-img, nbdinfo, nbdcopy, fio's nbd engine or the kernel's nbd client use
//! it without any patch.
//!
//! The NBD protocol is implemented here from its specification (fixed-newstyle handshake,
//! simple and structured replies); see [`proto`] for what is spoken. Requests are pipelined
//! through the export's client stack (one brick, or a volfile's graph over several): many
//! requests in flight, and replies in whatever order the bricks finish them. READ payload goes from the Kiln socket
//! into the buffer that is then written to the NBD socket, with no copy in between.
//!
//! ```no_run
//! # async fn f() -> Result<(), kiln_proto::Error> {
//! use kiln_nbd::{Export, ExportConfig};
//! let export = Export::bind(ExportConfig {
//!     image: "unix:/run/kiln/b1.sock:/vol/images/vm.img".parse()?,
//!     volfile: None,
//!     listen: "unix:/run/kiln/vm.nbd".parse()?,
//!     export_name: None,
//!     read_only: false,
//!     lock: Some(Default::default()),
//!     bitmap: None,
//! })
//! .await?;
//! println!("{}", export.uri()); // nbd+unix:///images/vm.img?socket=/run/kiln/vm.nbd
//! export.run(std::future::pending()).await;
//! # Ok(()) }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod backend;
pub mod export;
pub mod handshake;
pub mod lock;
pub mod metrics;
pub mod proto;
pub mod reader;
pub mod spec;
pub mod status;
pub mod transmission;

pub use export::{Export, ExportConfig};
pub use spec::{ImageSpec, Listen};

use kiln_proto::error::Context as _;
use kiln_proto::Error;
use std::io::Write as _;
use std::path::PathBuf;

/// Export a VM image on a Kiln brick over NBD, for QEMU, qemu-img, nbdinfo and fio.
///
/// IMAGE is SERVER:/VOL/PATH, split at its last ":/". SERVER is a kilnd that manages volumes
/// (HOST for its default management port 24007, or HOST:PORT): the export uses the volume
/// VOL's graph (distribute, replicate) as that kilnd hands it out. Or SERVER is a plain brick
/// (tcp:HOST:PORT, HOST:PORT or unix:SOCKETPATH): a brick serves one volume, so VOL is recorded
/// and shown (in the export description) but PATH is taken relative to the brick root:
/// unix:/run/kiln/b1.sock:/vol/images/vm.img exports the brick file images/vm.img. With
/// --volfile FILE, the client stack (distribute, replicate, several bricks) comes from FILE and
/// IMAGE is just the PATH in that volume. The image must exist; its size is the export size
/// (create and size it with Kiln first).
///
/// Prints one line "kiln nbd: exporting NAME (SIZE bytes) at URI" once it is listening, then
/// serves until SIGINT or SIGTERM, when it stops accepting, finishes the requests in flight and
/// exits. Every NBD client connection opens the image through the export's one client stack;
/// several connections to one export are safe (NBD_FLAG_CAN_MULTI_CONN). Logs go to stderr (KILN_LOG=debug for more); a
/// summary of each client's requests is logged when it disconnects.
///
/// Examples:
///   kiln nbd unix:/run/kiln/b1.sock:/vol/images/vm.img --listen unix:/run/kiln/vm.nbd
///   qemu-img info 'nbd+unix:///images/vm.img?socket=/run/kiln/vm.nbd'
///   kiln nbd 127.0.0.1:24100:/vol/vm.img --listen tcp:127.0.0.1:10809 --read-only
///   nbdinfo nbd://127.0.0.1:10809/vm.img
///   kiln nbd --volfile dist.toml images/vm.img --listen unix:/run/kiln/vm.nbd
#[derive(clap::Args, Debug, Clone)]
#[command(verbatim_doc_comment)]
pub struct NbdArgs {
    /// The image to export: SERVER:/VOL/PATH, or with --volfile the PATH (see above).
    #[arg(value_name = "IMAGE")]
    pub image: String,
    /// Build the client stack from this volfile (TOML) instead of connecting to SERVER.
    #[arg(long, value_name = "FILE")]
    pub volfile: Option<PathBuf>,
    /// Where NBD clients connect: unix:PATH or tcp:IP:PORT (port 0 picks a free one; use a
    /// loopback address unless the network is trusted: NBD has no authentication here).
    #[arg(long, value_name = "ADDR", default_value = "tcp:127.0.0.1:10809")]
    pub listen: Listen,
    /// The export name clients ask for [default: the image PATH, e.g. images/vm.img]. The empty
    /// (default) export name is always accepted too.
    #[arg(long, value_name = "NAME")]
    pub export_name: Option<String>,
    /// Refuse writes, trims and zeroing (NBD_FLAG_READ_ONLY); the image is opened read-only.
    #[arg(long)]
    pub read_only: bool,
    /// Lock the image for this export alone while it runs: the bricks refuse every other
    /// client's writes to it, and a second export of it is refused. "auto" (the default)
    /// locks when the bricks can (a managed volume's can, a standalone brick's cannot: then
    /// it warns and exports unlocked), "exclusive" insists, "off" shares the image (its
    /// clients must then coordinate). A read-only export never locks.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = ["auto", "exclusive", "off"])]
    pub lock: String,
    /// Wait up to SECS at start for another export's lock on the image to go (a live
    /// migration's destination), instead of failing at once. At most a day.
    #[arg(long, value_name = "SECS", default_value_t = 0.0, value_parser = kiln_proto::seconds::up_to_a_day)]
    pub lock_wait: f64,
    /// How long the lock outlives this export if it is cut off from the bricks without
    /// exiting (it renews every third of this): the time another export must wait then
    /// (0.3 to 300).
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = |s: &str| kiln_proto::seconds::parse_seconds_up_to(s, 300.0))]
    pub lock_ttl: f64,
    /// Offer the bricks' dirty record NAME (started with `kiln image dirty start`) as the
    /// metadata context qemu:dirty-bitmap:NAME: the ranges written since it started, for
    /// incremental backups (`nbdinfo --map=qemu:dirty-bitmap:NAME`).
    #[arg(long, value_name = "NAME")]
    pub bitmap: Option<String>,
    /// Runtime threads for the NBD side. One is fastest on small machines: completions arrive
    /// on each client's Kiln receive thread anyway, and a second runtime thread mostly adds
    /// cross-thread wake-ups.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub threads: usize,
    /// Serve Prometheus `/metrics` on this address (port 0 picks one, logged at start; the
    /// brick learns it, so `kiln volume profile` reaches this export); "off" disables it.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:0")]
    pub metrics: String,
    /// The volume's secret file (else `KILN_SECRET_FILE`, else the local state directory's
    /// copy, `/var/lib/kiln/vols/VOL/secret`, when readable).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
}

impl NbdArgs {
    /// What this export's log lines start with: `volume=V image=PATH`.
    pub fn log_tag(&self) -> String {
        ImageSpec::log_tag(&self.image, self.volfile.as_deref())
    }
}

/// The lock an export takes, from its options.
fn lock_config(mode: &str, wait: f64, ttl: f64) -> Result<Option<lock::LockConfig>, Error> {
    let secs = |v: f64, what: &str, max: f64| {
        if v.is_finite() && (0.0..=max).contains(&v) {
            Ok(std::time::Duration::from_secs_f64(v))
        } else {
            Err(Error::failed(format!(
                "{what} must be between 0 and {max} seconds, not {v}"
            )))
        }
    };
    let ttl = secs(ttl, "--lock-ttl", 300.0)?;
    if ttl < std::time::Duration::from_millis(300) {
        return Err(Error::failed("--lock-ttl must be at least 0.3 seconds"));
    }
    Ok((mode != "off").then_some(lock::LockConfig {
        ttl,
        wait: secs(wait, "--lock-wait", 86400.0)?,
        required: mode == "exclusive",
    }))
}

/// Runs `kiln nbd` until SIGINT or SIGTERM.
pub fn main(args: NbdArgs) -> Result<(), Error> {
    if let Some(p) = &args.secret_file {
        kiln_client::mgmt::use_secret_file(p);
    }
    let mut builder = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(args.threads);
        b
    };
    let rt = builder
        .thread_name("kiln-nbd")
        .enable_all()
        .build()
        .context("cannot start runtime")?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        // Install the handlers before anything else, so a signal during start-up is not lost.
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        kiln_client::start_metrics(&args.metrics, "kiln-nbd")?;
        let image = match &args.volfile {
            Some(v) => ImageSpec::in_volfile(&args.image, v)?,
            None => args.image.parse()?,
        };
        let export = Export::bind(ExportConfig {
            image,
            volfile: args.volfile,
            listen: args.listen,
            export_name: args.export_name,
            read_only: args.read_only,
            lock: lock_config(&args.lock, args.lock_wait, args.lock_ttl)?,
            bitmap: args.bitmap,
        })
        .await?;
        println!(
            "kiln nbd: exporting {:?} ({} bytes) at {}",
            export.name(),
            export.size(),
            export.uri()
        );
        let _ = std::io::stdout().flush();
        export
            .run(async move {
                let sig = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                };
                tracing::info!("{sig}: shutting down");
            })
            .await;
        Ok(())
    })
}
