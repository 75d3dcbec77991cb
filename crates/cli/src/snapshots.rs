//! `kiln image snapshot|clone|list|rm`: an image's snapshots as an operator handles them.

use std::time::{Duration, Instant};

use kiln_client::volume::TreeReport;
use kiln_client::{block_on, Volume};
use kiln_proto::ops::{snapshot_name_ok, snapshot_path};

use crate::out;
use kiln_proto::{Error, Kind};

/// The words for a snapshot fop's error.
fn explain(what: &str, e: &std::io::Error) -> Error {
    let msg = match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) => format!(
            "{what}: the bricks' file system cannot reflink (XFS made with reflink=1 or Btrfs \
             needed), or the image is sharded"
        ),
        Some(libc::EEXIST) => format!("{what}: it exists already"),
        Some(libc::ENOENT) => format!("{what}: no such snapshot or image"),
        Some(libc::EBUSY) => format!(
            "{what}: another snapshot of the image is being taken, or the image is being moved \
             by a rebalance; try again"
        ),
        Some(libc::EBADF) => format!("{what}: the image could not be opened for writing"),
        Some(libc::EAGAIN) => format!(
            "{what}: a replica of the image is away or behind (see `kiln volume heal VOL \
             info`); try again once heal has run"
        ),
        Some(libc::ETIMEDOUT) => format!(
            "{what}: the barrier lapsed before the copies were taken, or was renewed past the \
             longest a brick holds writers for one snapshot"
        ),
        Some(libc::ENOTDIR) => format!("{what}: not a directory tree's snapshot"),
        Some(libc::ENOSYS) => format!(
            "{what}: the bricks take no snapshots (standalone bricks, not a managed volume)"
        ),
        _ => format!("{what}: {e}"),
    };
    Error::new(errno_kind(e), msg)
}

/// The kind of a snapshot or dirty-record failure: what to do next, as the sentence says.
pub(crate) fn errno_kind(e: &std::io::Error) -> Kind {
    match e.raw_os_error() {
        Some(libc::EBUSY | libc::EAGAIN) => Kind::Conflict,
        Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::ENOTDIR | libc::ENOSPC) => Kind::Invalid,
        _ => Kind::of_io(e),
    }
}

fn check_name(name: &str) -> Result<(), Error> {
    if snapshot_name_ok(name) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "snapshot name {name:?}: want 1 to 64 of A-Z a-z 0-9 . _ - (not starting with a dot)"
        )))
    }
}

/// `kiln image snapshot`.
pub fn take(vol: &Volume, path: &str, name: &str, max_wait: u32, json: bool) -> Result<(), Error> {
    check_name(name)?;
    let max = max_wait.clamp(100, kiln_proto::ops::SNAP_TTL_MAX);
    let ((healed, held), took) = patiently("the image's replicas to be current", || {
        let t = Instant::now();
        block_on(vol.snapshot(path, name, max)).map(|h| (h, t.elapsed()))
    })
    .map_err(|e| explain(&format!("snapshot {path}@{name}"), &e))?;
    let r = serde_json::json!({
        "image": path,
        "snapshot": name,
        "path": snapshot_path(path, name),
        "took_ms": took.as_secs_f64() * 1e3,
        "writes_held_ms": held.as_secs_f64() * 1e3,
        "healing_bytes": healed,
    });
    out::show(json, &r, |_| {
        format!(
            "snapshot {path}@{name} taken in {:.1} ms (writes held {:.1} ms){}\n",
            took.as_secs_f64() * 1e3,
            held.as_secs_f64() * 1e3,
            if healed > 0 {
                format!("; heal makes {healed} bytes written meanwhile alike on every replica")
            } else {
                String::new()
            }
        )
    });
    Ok(())
}

/// `kiln image clone`: waits (up to a minute, saying so) while heal makes the snapshot's
/// copies alike.
pub fn clone(vol: &Volume, path: &str, name: &str, to: &str, json: bool) -> Result<(), Error> {
    check_name(name)?;
    patiently("heal to make the snapshot's copies alike", || {
        block_on(vol.clone_snapshot(path, name, to))
    })
    .map_err(|e| explain(&format!("clone of {path}@{name} as {to}"), &e))?;
    let r = serde_json::json!({ "clone": to, "of": format!("{path}@{name}") });
    out::show(json, &r, |_| format!("{to}: a clone of {path}@{name}\n"));
    Ok(())
}

/// What a tree snapshot or clone did, as `take_tree` and `clone_tree` print it.
fn tree_report(r: &TreeReport, took: Duration, extra: serde_json::Value) -> serde_json::Value {
    for s in &r.skipped {
        eprintln!("kiln: left out {s}");
    }
    let mut v = serde_json::json!({
        "files": r.files,
        "directories": r.dirs,
        "symlinks": r.symlinks,
        "skipped": r.skipped,
        "took_ms": took.as_secs_f64() * 1e3,
        "steps_ms": r.steps.iter().map(|(s, d)| (s.to_string(), serde_json::json!(d.as_secs_f64() * 1e3))).collect::<serde_json::Map<_, _>>(),
    });
    if let (Some(v), serde_json::Value::Object(extra)) = (v.as_object_mut(), extra) {
        v.extend(extra);
    }
    v
}

/// `kiln image snapshot` of a directory.
pub fn take_tree(
    vol: &Volume,
    path: &str,
    name: &str,
    max_wait: u32,
    json: bool,
) -> Result<(), Error> {
    check_name(name)?;
    let max = max_wait.clamp(100, kiln_proto::ops::SNAP_TTL_MAX);
    let t = Instant::now();
    let r = patiently("the files' replicas to be current", || {
        block_on(vol.snapshot_tree(path, name, max))
    })
    .map_err(|e| explain(&format!("snapshot {path}@{name}"), &e))?;
    let took = t.elapsed();
    let v = tree_report(
        &r,
        took,
        serde_json::json!({
            "tree": path,
            "snapshot": name,
            "path": snapshot_path(path, name),
            "writes_held_ms": r.held.as_secs_f64() * 1e3,
            "healing_bytes": r.healing_bytes,
        }),
    );
    out::show(json, &v, |_| {
        format!(
            "snapshot {path}@{name} of {} files, {} directories and {} symlinks taken in \
             {:.1} ms (writes held {:.1} ms)\n",
            r.files,
            r.dirs,
            r.symlinks,
            took.as_secs_f64() * 1e3,
            r.held.as_secs_f64() * 1e3
        )
    });
    Ok(())
}

/// `kiln image clone` of a directory's snapshot.
pub fn clone_tree(vol: &Volume, path: &str, name: &str, to: &str, json: bool) -> Result<(), Error> {
    check_name(name)?;
    let t = Instant::now();
    let r = patiently("heal to make the snapshot's copies alike", || {
        block_on(vol.clone_tree(path, name, to))
    })
    .map_err(|e| explain(&format!("clone of {path}@{name} as {to}"), &e))?;
    let v = tree_report(
        &r,
        t.elapsed(),
        serde_json::json!({ "clone": to, "of": format!("{path}@{name}") }),
    );
    out::show(json, &v, |_| {
        format!("{to}: a clone of {path}@{name} ({} files)\n", r.files)
    });
    Ok(())
}

/// Runs `f` again while it fails with `EAGAIN` (a replica away or behind, heal not done), for
/// up to a minute, saying once what it waits for.
fn patiently<T>(what: &str, mut f: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut told = false;
    loop {
        match f() {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && Instant::now() < deadline => {
                if !told {
                    eprintln!("waiting for {what}…");
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            r => return r,
        }
    }
}

/// The image's snapshots: (name, size, path).
fn snapshots(vol: &Volume, path: &str) -> Result<Vec<(String, u64, String)>, Error> {
    let (dir, base) = path.rsplit_once('/').unwrap_or(("", path));
    let prefix = format!(".{base}@");
    let entries = block_on(vol.readdir(dir))
        .map_err(|e| {
            format!(
                "cannot list {}: {e}",
                if dir.is_empty() { "/" } else { dir }
            )
        })
        .map_err(Error::failed)?;
    let mut out = Vec::new();
    for e in entries {
        // A part file (a snapshot being made, or left by one that failed) is not one.
        if let Some(name) = e.name.strip_prefix(&prefix).filter(|n| snapshot_name_ok(n)) {
            let p = snapshot_path(path, name);
            let size = block_on(vol.lookup(&p)).map_or(0, |a| a.size);
            out.push((name.to_owned(), size, p));
        }
    }
    out.sort();
    Ok(out)
}

/// `kiln image list`.
pub fn list(vol: &Volume, path: &str, json: bool) -> Result<(), Error> {
    let snaps = snapshots(vol, path)?;
    let list: Vec<_> = snaps
        .iter()
        .map(|(n, s, p)| serde_json::json!({ "name": n, "size": s, "path": p }))
        .collect();
    let r = serde_json::json!({ "image": path, "snapshots": list });
    out::show(json, &r, |_| {
        snaps.iter().map(|(n, s, _)| format!("{n} {s}\n")).collect()
    });
    Ok(())
}

/// `kiln image rm`.
pub fn remove(vol: &Volume, path: &str, name: &str, json: bool) -> Result<(), Error> {
    check_name(name)?;
    let snap = snapshot_path(path, name);
    let tree = block_on(vol.lookup(&snap)).map_or(true, |a| a.mode & libc::S_IFMT == libc::S_IFDIR);
    block_on(async {
        if tree {
            vol.remove_tree_snapshot(&snap).await
        } else {
            vol.unlink(&snap).await
        }
    })
    .map_err(|e| explain(&format!("snapshot {path}@{name}"), &e))?;
    let r = serde_json::json!({ "removed": format!("{path}@{name}") });
    out::show(json, &r, |_| format!("snapshot {path}@{name} removed\n"));
    Ok(())
}
