//! `kiln image`: what VM platforms ask of an image's storage beyond I/O — snapshots and
//! clones, dirty records for incremental backups, and who holds an image's exclusive lock.

use std::path::PathBuf;

use kiln_client::{block_on, Fd, Volume};

use crate::out;
use kiln_nbd::ImageSpec;
use kiln_proto::error::Context as _;
use kiln_proto::ops::{DIRTY_GET, DIRTY_START, DIRTY_STOP, LEASE_QUERY};
use kiln_proto::Error;

/// VM images on a volume: snapshots and clones, dirty records (changed-block tracking) and
/// the exclusive lock.
///
/// IMAGE is SERVER:/VOL/PATH as `kiln nbd` takes it (or the PATH with --volfile); a snapshot
/// is IMAGE@NAME.
///
/// Snapshots are crash-consistent on every replica: writes to the image wait at a barrier on
/// each brick for the moment the copies take (milliseconds), and the copies are reflinks
/// (instant, sharing blocks until written): the bricks' file system must reflink (XFS made
/// with reflink=1, Btrfs); elsewhere a snapshot is refused. A snapshot is the hidden read-only
/// file DIR/.BASE@NAME beside the image; a clone is a new writable image sharing its blocks.
///
/// IMAGE may be a directory: its snapshot is a tree, DIR/.BASE@NAME, of its directories,
/// files and symlinks (modes and owners kept), every file copied at one instant under
/// barriers standing on all of them at once — so the files agree as after a crash of the
/// whole tree (a VM's disks, a database's data and log). Names are the ones found just
/// before the copies; a clone of a tree is a new tree sharing the snapshot's blocks.
///
/// An incremental backup: `kiln image dirty start IMAGE daily` once (after a full copy);
/// later, `kiln nbd IMAGE --bitmap daily` offers qemu:dirty-bitmap:daily, which
/// `nbdinfo --map=qemu:dirty-bitmap:daily` and backup tools read to copy only what changed,
/// then `kiln image dirty start IMAGE daily` again begins the next interval. The bricks keep
/// records in memory and write them to disk when stopped cleanly (`volume stop`, a restart
/// of kilnd's service): they outlive that. A brick that dies without a clean stop forgets
/// them, and when too few replicas know a record the backup must copy everything (`dirty
/// show` fails, the bitmap context reports an error).
///
/// Examples:
///   kiln image snapshot 127.0.0.1:/vms/disk.img before-upgrade
///   kiln image clone 127.0.0.1:/vms/disk.img@before-upgrade test/disk.img
///   kiln image list 127.0.0.1:/vms/disk.img
///   kiln image snapshot 127.0.0.1:/vms/vm1 nightly      (a whole directory)
///   kiln image clone 127.0.0.1:/vms/vm1@nightly vm1-test
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
    /// Print the result as one JSON object, {"ok": true, …} (errors as {"ok": false,
    /// "error": …}).
    #[arg(long, global = true)]
    json: bool,
}

#[derive(clap::Subcommand, Debug)]
enum ImageCmd {
    /// Take snapshot NAME of the image (crash-consistent on every replica, instant).
    Snapshot {
        /// The image.
        image: String,
        /// The snapshot's name: 1 to 64 of A-Z a-z 0-9 . _ - (not starting with a dot).
        name: String,
        /// The longest the image's writers may wait at the barrier, in milliseconds (the
        /// snapshot fails rather than hold them longer).
        #[arg(long, default_value_t = 5000, value_name = "MS")]
        max_wait: u32,
    },
    /// Make NEWPATH (in the same volume) a writable clone of snapshot IMAGE@NAME, sharing its
    /// blocks until written.
    Clone {
        /// The snapshot: IMAGE@NAME.
        snapshot: String,
        /// The new image's path in the volume.
        newpath: String,
    },
    /// The image's snapshots: "NAME SIZE" per line (JSON: {"image", "snapshots": [{"name",
    /// "size", "path"}, …]}).
    List {
        /// The image.
        image: String,
    },
    /// Remove snapshot IMAGE@NAME (its clones stay).
    Rm {
        /// The snapshot: IMAGE@NAME.
        snapshot: String,
    },
    /// Dirty records: which ranges of an image were written since a record started.
    Dirty {
        #[command(subcommand)]
        cmd: DirtyCmd,
    },
    /// Who holds the image's exclusive lock (a writable `kiln nbd` takes it), and for how long
    /// its lease runs unless renewed (JSON: {"locked", "holder", "lease_remaining_ms",
    /// "token"}).
    Lock {
        /// The image.
        image: String,
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
    /// The ranges written since record NAME started: "OFFSET LENGTH" per line, in bytes
    /// (JSON: {"name", "size", "dirty_bytes", "ranges": [[offset, length], …]}).
    Show {
        /// The image.
        image: String,
        /// The record's name.
        name: String,
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
pub fn main(args: ImageArgs) -> Result<(), Error> {
    let image = match &args.cmd {
        ImageCmd::Lock { image, .. }
        | ImageCmd::Snapshot { image, .. }
        | ImageCmd::List { image, .. } => image,
        ImageCmd::Clone { snapshot, .. } | ImageCmd::Rm { snapshot } => split_snapshot(snapshot)?.0,
        ImageCmd::Dirty { cmd } => match cmd {
            DirtyCmd::Start { image, .. }
            | DirtyCmd::Show { image, .. }
            | DirtyCmd::Stop { image, .. } => image,
        },
    };
    // Starting or stopping a record changes others' backups: the bricks want a writer.
    let write = matches!(
        &args.cmd,
        ImageCmd::Dirty {
            cmd: DirtyCmd::Start { .. } | DirtyCmd::Stop { .. }
        }
    );
    // A snapshot of a directory is found by its own path: the directory may be gone.
    let snapshot = match &args.cmd {
        ImageCmd::Clone { snapshot, .. } | ImageCmd::Rm { snapshot } => {
            Some(split_snapshot(snapshot)?.1)
        }
        _ => None,
    };
    let (vol, fd, size, path) = open(image, args.volfile.as_deref(), write, snapshot)?;
    let r = match &fd {
        Some(fd) => run(&vol, fd, size, &path, &args.cmd, args.json),
        None => tree(&vol, &path, &args.cmd, args.json),
    };
    if let Some(fd) = fd {
        let _ = block_on(vol.close(fd));
    }
    r
}

/// The commands on a directory: its snapshots as trees.
fn tree(vol: &Volume, path: &str, cmd: &ImageCmd, json: bool) -> Result<(), Error> {
    use crate::snapshots as snaps;
    match cmd {
        ImageCmd::Snapshot { name, max_wait, .. } => {
            snaps::take_tree(vol, path, name, *max_wait, json)
        }
        ImageCmd::Clone { snapshot, newpath } => snaps::clone_tree(
            vol,
            path,
            &snap_name(snapshot),
            newpath.trim_start_matches('/'),
            json,
        ),
        ImageCmd::List { .. } => snaps::list(vol, path, json),
        ImageCmd::Rm { snapshot } => snaps::remove(vol, path, &snap_name(snapshot), json),
        ImageCmd::Dirty { .. } | ImageCmd::Lock { .. } => Err(Error::invalid(format!(
            "{path} is a directory: dirty records and the lock are an image's"
        ))),
    }
}

/// IMAGE@NAME as (IMAGE, NAME).
fn split_snapshot(s: &str) -> Result<(&str, &str), Error> {
    s.rsplit_once('@')
        .filter(|(i, n)| !i.is_empty() && !n.is_empty())
        .ok_or_else(|| Error::invalid(format!("{s:?}: want IMAGE@NAME")))
}

/// The NAME of IMAGE@NAME (checked by [`split_snapshot`] already).
fn snap_name(s: &str) -> String {
    split_snapshot(s)
        .map(|(_, n)| n.to_owned())
        .unwrap_or_default()
}

/// Opens the image (for writing with `write`); returns it with its size and path in the
/// volume. A directory, or the snapshot `snapshot` of one, is not opened (`None`).
fn open(
    image: &str,
    volfile: Option<&std::path::Path>,
    write: bool,
    snapshot: Option<&str>,
) -> Result<(Volume, Option<Fd>, u64, String), Error> {
    let (spec, src) = ImageSpec::with_source(image, volfile)?;
    let vol = Volume::from_source(&src).with_context(|| format!("cannot reach {src}"))?;
    let is_dir =
        |p: &str| block_on(vol.lookup(p)).is_ok_and(|a| a.mode & libc::S_IFMT == libc::S_IFDIR);
    let tree_snapshot = |n: &str| {
        let snap = kiln_proto::ops::snapshot_path(&spec.path, n);
        is_dir(&snap) || block_on(vol.lookup(&format!("{snap}~"))).is_ok()
    };
    if is_dir(&spec.path) || snapshot.is_some_and(tree_snapshot) {
        return Ok((vol, None, 0, spec.path));
    }
    let flags = if write { libc::O_RDWR } else { libc::O_RDONLY };
    let fd = block_on(vol.open(&spec.path, flags)).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => Error::not_found(format!("image {} not found", spec.path)),
        // Only a kilnd without a brick (its management port) answers a fop so.
        Some(libc::ENOSYS) => Error::invalid(format!(
            "{src} reached a management port, not a brick: image commands take a brick's \
             address in a volfile (remote = \"tcp:HOST:BRICKPORT\"), or SERVER:/VOL/PATH where \
             SERVER is the managing kilnd or a brick"
        )),
        _ => Error::io(format_args!("cannot open image {}", spec.path), &e),
    })?;
    let size = block_on(vol.fstat(&fd))
        .with_context(|| format!("cannot stat image {}", spec.path))?
        .size;
    Ok((vol, Some(fd), size, spec.path))
}

fn run(
    vol: &Volume,
    fd: &Fd,
    size: u64,
    path: &str,
    cmd: &ImageCmd,
    json: bool,
) -> Result<(), Error> {
    use crate::snapshots as snaps;
    let dirty_err = |name: &str, e: std::io::Error| {
        let kind = snaps::errno_kind(&e);
        let msg = match e.raw_os_error() {
            Some(libc::ENOENT) => format!(
                "no dirty record {name:?} on the image's bricks (never started, stopped, or \
             bricks died since): take a full copy and start it again"
            ),
            Some(libc::ENOSPC) => "the image has 8 dirty records already: stop one first".into(),
            Some(libc::EOPNOTSUPP) => "dirty records are not offered for sharded files".into(),
            Some(libc::ENOSYS) => "the bricks keep no dirty records (standalone bricks, not a \
                               managed volume)"
                .into(),
            _ => format!("dirty record {name:?}: {e}"),
        };
        Error::new(kind, msg)
    };
    match cmd {
        ImageCmd::Snapshot { name, max_wait, .. } => snaps::take(vol, path, name, *max_wait, json)?,
        ImageCmd::Clone { snapshot, newpath } => snaps::clone(
            vol,
            path,
            &snap_name(snapshot),
            newpath.trim_start_matches('/'),
            json,
        )?,
        ImageCmd::List { .. } => snaps::list(vol, path, json)?,
        ImageCmd::Rm { snapshot } => snaps::remove(vol, path, &snap_name(snapshot), json)?,
        ImageCmd::Dirty { cmd } => match cmd {
            DirtyCmd::Start { name, .. } => {
                block_on(vol.dirty(fd, DIRTY_START, name, 0, 0)).map_err(|e| dirty_err(name, e))?;
                let r = serde_json::json!({ "image": path, "record": name, "started": true });
                out::show(json, &r, |_| {
                    format!("dirty record {name:?} started: writes from now on are recorded\n")
                });
            }
            DirtyCmd::Stop { name, .. } => {
                block_on(vol.dirty(fd, DIRTY_STOP, name, 0, 0)).map_err(|e| dirty_err(name, e))?;
                let r = serde_json::json!({ "image": path, "record": name, "stopped": true });
                out::show(json, &r, |_| format!("dirty record {name:?} stopped\n"));
            }
            DirtyCmd::Show { name, .. } => {
                let ranges = dirty_ranges(vol, fd, name, size).map_err(|e| dirty_err(name, e))?;
                print_ranges(name, size, &ranges, json);
            }
        },
        ImageCmd::Lock { .. } => {
            let s = block_on(vol.lease(fd, LEASE_QUERY, 1000, "kiln image lock"))
                .context("cannot ask for the lock")?;
            let held = !s.holder.is_empty();
            let r = serde_json::json!({
                "locked": held,
                "holder": held.then_some(&s.holder),
                "lease_remaining_ms": held.then_some(s.remaining_ms),
                "token": held.then_some(s.token),
            });
            out::show(json, &r, |_| {
                if held {
                    format!(
                        "locked by {} (lease runs {:.1} s more unless renewed; token {})\n",
                        s.holder,
                        f64::from(s.remaining_ms) / 1000.0,
                        s.token
                    )
                } else {
                    "not locked\n".into()
                }
            });
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
    let r = serde_json::json!({
        "name": name,
        "size": size,
        "dirty_bytes": bytes,
        "ranges": ranges,
    });
    out::show(json, &r, |_| {
        ranges.iter().map(|(o, l)| format!("{o} {l}\n")).collect()
    });
}
