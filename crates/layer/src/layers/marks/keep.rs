//! Dirty records kept across a clean restart of the brick.
//!
//! The records ([`images`](super::images)) live in memory while the brick runs. When it is
//! stopped cleanly (kilnd's `SIGTERM`), [`Marks::keep_dirty`] seals every file that has one —
//! from then on a change of its bytes is refused, so none can run unrecorded — and writes them
//! to `.kiln/dirty.json` (a new file renamed into place). At the next start [`Marks::new`]
//! loads them and removes the file at once: a brick that then dies without a clean stop
//! comes back knowing no record, and a backup copies everything, as qemu treats a persistent
//! bitmap left "in use". A record is kept only for the file it was made on, untouched: its
//! inode number and change time are saved with it and checked at load (a file replaced or
//! changed behind the brick's back while it was away starts over). Writes made through the other replicas while this brick was away are in theirs: the
//! replicate layer asks enough replicas that one of them saw every write.

use std::io::{Read, Write};

use kiln_proto::sync::MutexExt as _;
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

use super::*;

/// The file in `.kiln` the records are kept in between a clean stop and the next start.
const KEPT: &str = "dirty.json";
/// Where they are written first.
const KEPT_NEW: &str = "dirty.json.new";
/// The most ranges kept in all (about 40 bytes each as kept: well within what a start reads).
const MAX_RANGES: usize = 1 << 20;
/// The longest a stopping brick waits for changes in flight to finish.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// One file's records, as kept.
#[derive(Serialize, Deserialize)]
struct Kept {
    path: String,
    /// The file's inode number and change time (seconds, nanoseconds) when kept.
    id: (u64, i64, i64),
    records: Vec<(String, Vec<(u64, u64)>)>,
}

/// The inode number and change time of `path` beneath the brick `root`, never through a
/// symlink.
fn id_of(root: &OwnedFd, path: &str) -> Option<(u64, i64, i64)> {
    let rel = path.trim_start_matches('/');
    let how = rfs::openat2(
        root,
        if rel.is_empty() { "." } else { rel },
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
    )
    .ok()?;
    rfs::fstat(&how)
        .ok()
        .map(|st| (st.st_ino, st.st_ctime, st.st_ctime_nsec as i64))
}

impl Marks {
    /// Seals every file this layer knows (a change of a file's bytes then waits), and writes
    /// the dirty records to `.kiln/dirty.json` (see the module documentation); returns how many
    /// files' records were kept. Called once, as the brick stops.
    pub fn keep_dirty(&self) -> std::io::Result<usize> {
        let keys: Vec<(String, Arc<FileKey>)> = self
            .files
            .locked()
            .iter()
            .map(|(p, k)| (p.clone(), k.clone()))
            .collect();
        for (_, key) in &keys {
            key.state().sealed = true;
        }
        // Changes already past the gate finish first: the change time read below must be the
        // file's last one, or the next start would take the file for changed behind its back.
        let deadline = std::time::Instant::now() + DRAIN;
        let mut kept = Vec::new();
        let mut ranges = 0usize;
        for (path, key) in keys {
            let mut st = key.state();
            while st.inflight.iter().any(|w| !w.ns) && std::time::Instant::now() < deadline {
                drop(st);
                std::thread::sleep(std::time::Duration::from_millis(1));
                st = key.state();
            }
            if st.dirty.is_empty() {
                continue;
            }
            let Some(id) = id_of(&self.root, &path) else {
                continue;
            };
            let mut records = Vec::new();
            for (n, r) in &st.dirty {
                // Too many ranges to keep (past what a start reads back): unknown next time,
                // and the backup copies everything.
                ranges += r.count();
                if ranges > MAX_RANGES {
                    tracing::warn!(path, record = n, "dirty record too large to keep");
                    continue;
                }
                records.push((n.clone(), r.iter().collect()));
            }
            kept.push(Kept { path, id, records });
        }
        let Some(state) = super::log::open_state_dir(&self.root, true)? else {
            return Ok(0);
        };
        let _ = rfs::unlinkat(&state, KEPT_NEW, AtFlags::empty());
        let fd = rfs::openat(
            &state,
            KEPT_NEW,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        let mut f = std::fs::File::from(fd);
        f.write_all(&serde_json::to_vec(&kept).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        rfs::renameat(&state, KEPT_NEW, &state, KEPT)?;
        rfs::fsync(&state)?;
        tracing::info!(
            files = kept.len(),
            "{}: dirty records kept",
            self.dir.display()
        );
        Ok(kept.len())
    }

    /// Loads the records a clean stop kept, and removes them from the disk (see the module
    /// documentation).
    pub(super) fn load_kept(&self) {
        let Ok(Some(state)) = super::log::open_state_dir(&self.root, false) else {
            return;
        };
        let fd = match rfs::openat(
            &state,
            KEPT,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return,
            Err(e) => {
                tracing::warn!(
                    "{}: cannot read kept dirty records: {e}",
                    self.dir.display()
                );
                let _ = rfs::unlinkat(&state, KEPT, AtFlags::empty());
                return;
            }
        };
        // Gone before anything else: from now on only a clean stop writes them again.
        let _ = rfs::unlinkat(&state, KEPT, AtFlags::empty()).and_then(|()| rfs::fsync(&state));
        let regular = rfs::fstat(&fd)
            .is_ok_and(|st| rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile);
        let mut bytes = Vec::new();
        let kept: Vec<Kept> = match regular.then(|| {
            std::fs::File::from(fd)
                .take(64 << 20)
                .read_to_end(&mut bytes)
        }) {
            Some(Ok(_)) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!("{}: kept dirty records unreadable: {e}", self.dir.display());
                Vec::new()
            }),
            _ => Vec::new(),
        };
        let mut loaded = 0;
        for k in kept {
            if id_of(&self.root, &k.path) != Some(k.id) {
                tracing::info!(
                    path = k.path,
                    "dirty records dropped: the file was replaced or changed while the brick was away"
                );
                continue;
            }
            let key = self.key(&k.path);
            let mut st = key.state();
            for (name, ranges) in k.records.into_iter().take(kiln_proto::ops::DIRTY_MAX) {
                let mut r = RangeSet::default();
                for (o, l) in ranges {
                    r.add(o, l);
                }
                st.dirty.push((name, r));
            }
            loaded += 1;
        }
        tracing::info!(
            files = loaded,
            "{}: kept dirty records loaded",
            self.dir.display()
        );
    }
}
