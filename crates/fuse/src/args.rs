//! `kiln mount`'s command line.

use std::path::PathBuf;

use kiln_client::volume::Source;

use crate::{Mode, SMALL_FILE_MAX};
use kiln_proto::Error;

/// Mounts a Kiln volume with FUSE and serves it in the foreground until unmounted
/// (`kiln umount DIR`, `umount DIR`) or sent SIGTERM/SIGINT.
///
/// SERVER:/VOL names the server (`HOST:PORT`, `tcp:HOST:PORT` or `unix:PATH`) and the volume:
/// the client stack is the volume's volfile; a plain brick (one that keeps no volume
/// definitions) is mounted with the default stack, io-stats over one protocol-client. With
/// `--volfile FILE` the stack comes from FILE instead (distribute, replicate, several bricks):
/// `kiln mount --volfile vol.toml DIR`.
/// Prints `kiln: mounted SOURCE on DIR` once the mount is ready.
#[derive(clap::Args, Debug, Clone)]
pub struct MountArgs {
    /// SERVER:/VOL, e.g. 127.0.0.1:24100:/vol or unix:/run/kiln.sock:/vol (with --volfile:
    /// the mount point, or a name for the mount followed by the mount point).
    pub source: String,
    /// An existing, empty directory to mount on.
    pub mountpoint: Option<PathBuf>,
    /// Build the client stack from this volfile (TOML) instead of asking SERVER.
    #[arg(long, value_name = "FILE")]
    pub volfile: Option<PathBuf>,
    /// Caching mode: vm-image (direct I/O, no page cache) or general (page cache).
    #[arg(long, value_enum, default_value = "general")]
    pub mode: Mode,
    /// FUSE worker threads. A write waits for the brick on its FUSE thread (it is sent from
    /// the kernel's buffer, without a copy), so this bounds the writes in flight. Measured with
    /// fio 128k QD32 O_DIRECT writes: 4 threads 1.84-2.07 GB/s, 16 threads 2.15-2.26 GB/s;
    /// reads were the same either way. Only two of them wait on the kernel for requests; the
    /// others take over while those wait on bricks (fewer wake-ups for serial requests).
    #[arg(long, default_value_t = 16)]
    pub threads: usize,
    /// Accepted for compatibility and ignored: the stack has one connection per brick.
    #[arg(long, default_value_t = 1, hide = true)]
    pub connections: usize,
    /// Attribute and entry cache timeout in general mode, in seconds (at most a day).
    #[arg(long, value_name = "SECS", default_value_t = 1.0, value_parser = kiln_proto::seconds::up_to_a_day)]
    pub attr_timeout: f64,
    /// In vm-image mode, files opened read-only on a brick of this host (without replicas) are
    /// read by the kernel straight from the brick's file (FUSE passthrough; needs root and
    /// Linux 6.9): on, or off to send every read through this process.
    #[arg(long, value_enum, default_value = "on")]
    pub passthrough: Switch,
    /// Reads of 32 KiB or more from a brick over TCP go from its socket to the kernel by
    /// splice, never into this process's memory (one copy fewer; FUSE requests are then read
    /// from one shared device descriptor): on, or off to receive every read here first.
    #[arg(long, value_enum, default_value = "on")]
    pub splice: Switch,
    /// In general mode, a read-only open of a file of at most this many bytes fetches the
    /// whole file with the open, in one round trip to the brick, and later reads of that
    /// handle need none (close-to-open: the file as it was when opened). 0 turns it off.
    #[arg(long, value_name = "BYTES", default_value_t = SMALL_FILE_MAX)]
    pub small_file_max: u32,
    /// General mode: gather writes in the kernel's page cache and send them later (FUSE
    /// writeback caching). The kernel then trusts its own file sizes, so other clients'
    /// changes to files this mount holds may go unseen: for trees only this mount writes.
    /// Without it, writes go through at once and an open sees what others wrote and closed.
    #[arg(long)]
    pub writeback_cache: bool,
    /// General mode, without --writeback-cache: a write that continues the file's last one
    /// is answered at once and held (up to 256 KiB a file) until anything needs it on the
    /// brick — a read, stat, chmod, fsync, and at the latest the file's close, which waits
    /// for it and reports its errors. Off: every write waits for the brick.
    #[arg(long, value_enum, default_value = "on")]
    pub write_behind: Switch,
    /// Support POSIX ACLs: stored on the bricks, enforced and cached by the kernel. Without
    /// it the mount has none (getfacl shows the mode, setfacl fails with "Operation not
    /// supported"), and `ls -l` does not ask for them entry by entry.
    #[arg(long)]
    pub acl: bool,
    /// Serve Prometheus `/metrics` on this address (port 0 picks one, logged at start; the
    /// brick learns it, so `kiln volume profile` reaches this mount); "off" disables it.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:0")]
    pub metrics: String,
    /// The volume's secret file (else `KILN_SECRET_FILE`, else the local state directory's
    /// copy, `/var/lib/kiln/vols/VOL/secret`, when readable).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Mount options, comma-separated. `nonempty`: mount on a directory that is not empty
    /// (what it holds is hidden while the volume is mounted there); without it such a
    /// directory is refused. The kernel's flags ro, rw, nosuid, suid, nodev, dev, noexec,
    /// exec, noatime, atime, sync, async and dirsync are set as the mount is made.
    #[arg(short = 'o', value_name = "OPTIONS", value_delimiter = ',')]
    pub options: Vec<String>,
}

impl MountArgs {
    /// What this mount's log lines start with: `volume=V mount=DIR`.
    pub fn log_tag(&self) -> String {
        let volume = match &self.volfile {
            Some(v) => v.file_stem().map(|s| s.to_string_lossy().into_owned()),
            None => parse_source(&self.source).ok().map(|(_, v)| v),
        };
        let dir = match (&self.mountpoint, &self.volfile) {
            (Some(m), _) => m.display().to_string(),
            (None, Some(_)) => self.source.clone(),
            (None, None) => String::new(),
        };
        match volume {
            Some(v) => format!("volume={} mount={dir}", v.trim_start_matches('/')),
            None => String::new(),
        }
    }
}

/// An on/off command-line value (`--passthrough`, and `kiln bench --short-circuit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

/// Splits `SERVER:/VOL` at the last `:/`.
pub fn parse_source(s: &str) -> Result<(String, String), Error> {
    match Source::parse(s)? {
        Source::Server { server, volume } => Ok((server, volume)),
        Source::Volfile(_) => unreachable!("parse gives a server"),
    }
}
