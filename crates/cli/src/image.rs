//! `kiln image`: what VM platforms ask of an image's storage beyond I/O — dirty records for
//! incremental backups, and who holds an image's exclusive lock.

use std::path::PathBuf;

use kiln_client::volume::Source;
use kiln_client::{block_on, Fd, Volume};
use kiln_nbd::ImageSpec;
use kiln_proto::ops::{DIRTY_GET, DIRTY_START, DIRTY_STOP, LEASE_QUERY};

/// VM images on a volume: dirty records (changed-block tracking) and the exclusive lock.
///
/// IMAGE is SERVER:/VOL/PATH as `kiln nbd` takes it (or the PATH with --volfile).
///
/// An incremental backup: `kiln image dirty start IMAGE daily` once (after a full copy);
/// later, `kiln nbd IMAGE --bitmap daily` offers qemu:dirty-bitmap:daily, which
/// `nbdinfo --map=qemu:dirty-bitmap:daily` and backup tools read to copy only what changed,
/// then `kiln image dirty start IMAGE daily` again begins the next interval. The bricks keep
/// records in memory: after a brick restart a record is unknown, and the backup must copy
/// everything (`dirty show` fails, the bitmap context reports an error).
///
/// Examples:
///   kiln image dirty start 127.0.0.1:/vms/disk.img daily
///   kiln image dirty show 127.0.0.1:/vms/disk.img daily --json
///   kiln image lock 127.0.0.1:/vms/disk.img
#[derive(clap::Args, Debug)]
#[command(verbatim_doc_comment)]
pub struct ImageArgs {
    #[command(subcommand)]
    cmd: ImageCmd,
    /// Build the client stack from this volfile (TOML) instead of connecting to SERVER.
    #[arg(long, value_name = "FILE", global = true)]
    volfile: Option<PathBuf>,
}

#[derive(clap::Subcommand, Debug)]
enum ImageCmd {
    /// Dirty records: which ranges of an image were written since a record started.
    Dirty {
        #[command(subcommand)]
        cmd: DirtyCmd,
    },
    /// Who holds the image's exclusive lock (a writable `kiln nbd` takes it), and for how long
    /// its lease runs unless renewed.
    Lock {
        /// The image.
        image: String,
        /// One JSON object instead of a line of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Subcommand, Debug)]
enum DirtyCmd {
    /// Start recording under NAME from now (an existing record of that name starts over).
    Start {
        /// The image.
        image: String,
        /// The record's name (up to 256 bytes; a file keeps up to 8 records).
        name: String,
    },
    /// The ranges written since record NAME started: "OFFSET LENGTH" per line, in bytes.
    Show {
        /// The image.
        image: String,
        /// The record's name.
        name: String,
        /// One JSON object: {"name", "size", "dirty_bytes", "ranges": [[offset, length], …]}.
        #[arg(long)]
        json: bool,
    },
    /// Stop record NAME and drop it.
    Stop {
        /// The image.
        image: String,
        /// The record's name.
        name: String,
    },
}

/// Runs `kiln image`.
pub fn main(args: ImageArgs) -> Result<(), String> {
    let image = match &args.cmd {
        ImageCmd::Lock { image, .. } => image,
        ImageCmd::Dirty { cmd } => match cmd {
            DirtyCmd::Start { image, .. }
            | DirtyCmd::Show { image, .. }
            | DirtyCmd::Stop { image, .. } => image,
        },
    };
    let (vol, fd, size) = open(image, args.volfile.as_deref())?;
    let r = run(&vol, &fd, size, &args.cmd);
    let _ = block_on(vol.close(fd));
    r
}

/// Opens the image read-only (enough for every question; records see every writer).
fn open(image: &str, volfile: Option<&std::path::Path>) -> Result<(Volume, Fd, u64), String> {
    let (spec, src) = match volfile {
        Some(v) => (
            ImageSpec::in_volfile(image, v)?,
            Source::Volfile(v.to_owned()),
        ),
        None => {
            let spec: ImageSpec = image.parse()?;
            let src = Source::Server {
                server: spec.server.clone(),
                volume: spec.volume.clone(),
            };
            (spec, src)
        }
    };
    let vol = Volume::from_source(&src).map_err(|e| format!("cannot reach {src}: {e}"))?;
    let fd =
        block_on(vol.open(&spec.path, libc::O_RDONLY)).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => format!("image {} not found", spec.path),
            _ => format!("cannot open image {}: {e}", spec.path),
        })?;
    let size = block_on(vol.fstat(&fd))
        .map_err(|e| format!("cannot stat image {}: {e}", spec.path))?
        .size;
    Ok((vol, fd, size))
}

fn run(vol: &Volume, fd: &Fd, size: u64, cmd: &ImageCmd) -> Result<(), String> {
    let dirty_err = |name: &str, e: std::io::Error| match e.raw_os_error() {
        Some(libc::ENOENT) => format!(
            "no dirty record {name:?} on the image's bricks (never started, stopped, or a \
             brick restarted since): take a full copy and start it again"
        ),
        Some(libc::ENOSPC) => "the image has 8 dirty records already: stop one first".into(),
        Some(libc::EOPNOTSUPP) => "dirty records are not offered for sharded files".into(),
        Some(libc::ENOSYS) => "the bricks keep no dirty records (standalone bricks, not a \
                               managed volume)"
            .into(),
        _ => format!("dirty record {name:?}: {e}"),
    };
    match cmd {
        ImageCmd::Dirty { cmd } => match cmd {
            DirtyCmd::Start { name, .. } => {
                block_on(vol.dirty(fd, DIRTY_START, name, 0, 0)).map_err(|e| dirty_err(name, e))?;
                println!("dirty record {name:?} started: writes from now on are recorded");
            }
            DirtyCmd::Stop { name, .. } => {
                block_on(vol.dirty(fd, DIRTY_STOP, name, 0, 0)).map_err(|e| dirty_err(name, e))?;
                println!("dirty record {name:?} stopped");
            }
            DirtyCmd::Show { name, json, .. } => {
                let ranges = dirty_ranges(vol, fd, name, size).map_err(|e| dirty_err(name, e))?;
                print_ranges(name, size, &ranges, *json);
            }
        },
        ImageCmd::Lock { json, .. } => {
            let s = block_on(vol.lease(fd, LEASE_QUERY, 1000, "kiln image lock"))
                .map_err(|e| format!("cannot ask for the lock: {e}"))?;
            let held = !s.holder.is_empty();
            if *json {
                let v = serde_json::json!({
                    "locked": held,
                    "holder": held.then_some(&s.holder),
                    "lease_remaining_ms": held.then_some(s.remaining_ms),
                    "token": held.then_some(s.token),
                });
                println!("{v}");
            } else if held {
                println!(
                    "locked by {} (lease runs {:.1} s more unless renewed; token {})",
                    s.holder,
                    f64::from(s.remaining_ms) / 1000.0,
                    s.token
                );
            } else {
                println!("not locked");
            }
        }
    }
    Ok(())
}

/// Every written range of `[0, size)`, asking again where a reply's runs end.
fn dirty_ranges(vol: &Volume, fd: &Fd, name: &str, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut at = 0;
    while at < size {
        let runs = block_on(vol.dirty(fd, DIRTY_GET, name, at, size - at))?;
        if runs.is_empty() {
            break;
        }
        for r in runs {
            if !r.hole {
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == at => last.1 += r.len,
                    _ => out.push((at, r.len)),
                }
            }
            at += r.len;
        }
    }
    Ok(out)
}

fn print_ranges(name: &str, size: u64, ranges: &[(u64, u64)], json: bool) {
    let bytes: u64 = ranges.iter().map(|r| r.1).sum();
    if json {
        let v = serde_json::json!({
            "name": name,
            "size": size,
            "dirty_bytes": bytes,
            "ranges": ranges,
        });
        println!("{v}");
    } else {
        for (o, l) in ranges {
            println!("{o} {l}");
        }
    }
}
