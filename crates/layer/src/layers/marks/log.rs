//! The records and their log: marks and flags applied in memory and appended to
//! `.kiln/pending.log`, replayed and compacted at start, moved with renames and dropped with
//! unlinks. Every file here is opened beneath the brick without following a symlink.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;

use crate::marks::{self as m};
use crate::{errno, FopResult};
use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::*;

impl Marks {
    /// A marks layer for the brick at `dir` over `child`; replays and compacts its log.
    ///
    /// Fails when `.kiln` or its log is a symlink or not what it should be: see the module
    /// documentation.
    pub fn new(name: &str, child: LayerRef, dir: &Path) -> std::io::Result<Marks> {
        let root = rfs::open(
            dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut records = Records::new();
        let mut flags = Flags::new();
        let state = open_state_dir(&root, false).inspect_err(|e| {
            tracing::error!("{}: not starting the brick: {e}", dir.display());
        })?;
        let mut log = None;
        if let Some(state) = &state {
            let path = dir.join(STATE_DIR).join(LOG);
            match open_log(state, OFlags::RDONLY, Mode::empty()) {
                Ok(mut f) => {
                    let mut bytes = Vec::new();
                    f.read_to_end(&mut bytes)?;
                    let (n, bad) = replay(&bytes, &mut records, &mut flags);
                    if bad {
                        tracing::warn!(
                            records = n,
                            "{}: ignoring a torn record at the end",
                            path.display()
                        );
                    }
                    log = Some(compact(dir, state, &records, &flags).map_err(|e| {
                        std::io::Error::new(e.kind(), format!("compacting {}: {e}", path.display()))
                    })?);
                    tracing::info!(
                        files = records.len(),
                        names = flags.len(),
                        "{}: pending marks loaded",
                        dir.display()
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::error!("{}: not starting the brick: {e}", dir.display());
                    return Err(e);
                }
            }
        }
        // Generations start at the wall clock (ns): a restarted brick never reuses one.
        let mut next_gen = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            .max(1);
        let mut gens = Gens::new();
        let held = records
            .iter()
            .flat_map(|(p, t)| t.keys().map(move |t| (p, *t)))
            .chain(
                flags
                    .iter()
                    .flat_map(|(p, t)| t.keys().map(move |t| (p, *t))),
            );
        for (path, t) in held {
            gens.entry(path.clone()).or_default().insert(t, next_gen);
            next_gen += 1;
        }
        let m = Marks {
            name: name.into(),
            kids: vec![child],
            dir: dir.to_owned(),
            root,
            store: Mutex::new(Store {
                records,
                flags,
                gens,
                next_gen,
                state,
                log,
                dirty: false,
            }),
            files: Mutex::default(),
            identity: None,
            joining: false.into(),
            names: Mutex::default(),
            moved: Default::default(),
        };
        m.load_kept();
        Ok(m)
    }

    /// Appends records to the log (creating `.kiln` on first use) and applies them.
    pub(super) fn apply(&self, ops: &[(u8, &str, u32, u64, u64)]) -> FopResult<()> {
        let mut st = self.store();
        self.apply_locked(&mut st, ops)
    }

    /// Clears `[offset, offset+len)` of `target`'s marks on `path` unless a mark for it was
    /// added since generation `gen` (`EAGAIN`).
    pub(super) fn clear_if(
        &self,
        path: &str,
        target: u32,
        gen: u64,
        offset: u64,
        len: u64,
    ) -> FopResult<()> {
        let mut st = self.store();
        if st.gen(path, target) != gen {
            return Err(EAGAIN);
        }
        let held = st
            .records
            .get(path)
            .and_then(|t| t.get(&target))
            .is_some_and(|r| r.overlaps(offset, len));
        if !held {
            return Ok(());
        }
        self.apply_locked(&mut st, &[(b'C', path, target, offset, len)])
    }

    /// Clears `bits` of `target`'s flags on `path` unless a mark for it was added since
    /// generation `gen` (`EAGAIN`).
    /// With `data`, marks the whole file's bytes for `target` in the same record.
    pub(super) fn clear_flags_if(
        &self,
        path: &str,
        target: u32,
        gen: u64,
        bits: u32,
        data: bool,
    ) -> FopResult<()> {
        let mut st = self.store();
        if st.gen(path, target) != gen {
            return Err(EAGAIN);
        }
        // Copying the bytes changes the target's times: its attributes are healed after.
        let bits = if data { bits & !m::META } else { bits };
        let held = st
            .flags
            .get(path)
            .and_then(|t| t.get(&target))
            .is_some_and(|f| f & bits != 0);
        let mut ops = Vec::new();
        if held {
            ops.push((b'f', path, target, u64::from(bits), 0));
        }
        if data {
            ops.push((b'A', path, target, 0, m::WHOLE));
            ops.push((b'F', path, target, u64::from(m::META), 0));
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.apply_locked(&mut st, &ops)
    }

    pub(super) fn apply_locked(
        &self,
        st: &mut Store,
        ops: &[(u8, &str, u32, u64, u64)],
    ) -> FopResult<()> {
        if st.log.is_none() {
            let opened = self.open_log_for_append(st);
            st.log = Some(opened.map_err(|e| {
                tracing::error!(
                    "{}: cannot record a pending mark in {STATE_DIR}/{LOG}: {e}",
                    self.dir.display()
                );
                io_errno(&e)
            })?);
        }
        let mut buf = Vec::new();
        for (kind, path, t, o, l) in ops {
            record(&mut buf, *kind, path, *t, *o, *l);
        }
        st.log
            .as_mut()
            .expect("opened above")
            .write_all(&buf)
            .map_err(|e| {
                tracing::error!("cannot append to the pending log: {e}");
                io_errno(&e)
            })?;
        st.dirty = true;
        for (kind, path, t, o, l) in ops {
            apply_one(&mut st.records, &mut st.flags, *kind, path, *t, *o, *l);
            if *kind == b'A' || *kind == b'F' {
                let g = st.next_gen;
                st.next_gen += 1;
                st.gens.entry((*path).to_owned()).or_default().insert(*t, g);
            } else if !st.records.get(*path).is_some_and(|r| r.contains_key(t))
                && !st.flags.get(*path).is_some_and(|r| r.contains_key(t))
            {
                if let Some(g) = st.gens.get_mut(*path) {
                    g.remove(t);
                    if g.is_empty() {
                        st.gens.remove(*path);
                    }
                }
            }
        }
        Ok(())
    }

    /// Opens (making them if need be) `.kiln` and the log, for the first mark since start.
    pub(super) fn open_log_for_append(&self, st: &mut Store) -> std::io::Result<File> {
        if st.state.is_none() {
            st.state = open_state_dir(&self.root, true)?;
        }
        let state = st.state.as_ref().expect("made above");
        open_log(
            state,
            OFlags::WRONLY | OFlags::APPEND | OFlags::CREATE,
            Mode::from_raw_mode(0o644),
        )
    }

    /// Moves a renamed path's marks, and those of everything beneath it (a renamed
    /// directory), to the new name. Marks held at the new name (and beneath) before are
    /// dropped but for its entry flags: what was there is gone.
    pub(super) fn rename_marks(&self, from: &str, to: &str) -> FopResult<()> {
        let mut st = self.store();
        let under = |p: &str, root: &str| {
            p == root || (p.starts_with(root) && p.as_bytes().get(root.len()) == Some(&b'/'))
        };
        let moved = |p: &str| format!("{to}{}", &p[from.len()..]);
        let mut ops: Vec<(u8, String, u32, u64, u64)> = Vec::new();
        // What the new name held goes (entry flags stay: they say the name changed).
        for (p, targets) in st.records.range(to.to_owned()..) {
            if !p.starts_with(to) {
                break;
            }
            if under(p, to) {
                for t in targets.keys() {
                    ops.push((b'C', p.clone(), *t, 0, m::WHOLE));
                }
            }
        }
        for (p, targets) in st.flags.range(to.to_owned()..) {
            if !p.starts_with(to) {
                break;
            }
            if under(p, to) {
                for t in targets.keys() {
                    ops.push((b'f', p.clone(), *t, u64::from(m::META), 0));
                }
            }
        }
        for (p, targets) in st.records.range(from.to_owned()..) {
            if !p.starts_with(from) {
                break;
            }
            if under(p, from) {
                for (t, r) in targets {
                    ops.push((b'C', p.clone(), *t, 0, m::WHOLE));
                    for (o, l) in r.iter() {
                        ops.push((b'A', moved(p), *t, o, l));
                    }
                }
            }
        }
        for (p, targets) in st.flags.range(from.to_owned()..) {
            if !p.starts_with(from) {
                break;
            }
            if under(p, from) {
                for (t, f) in targets {
                    // The old name keeps its entry flag: the target may still hold it.
                    ops.push((b'f', p.clone(), *t, u64::from(m::META), 0));
                    ops.push((b'F', moved(p), *t, u64::from(*f), 0));
                }
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        let refs: Vec<(u8, &str, u32, u64, u64)> = ops
            .iter()
            .map(|(k, p, t, o, l)| (*k, p.as_str(), *t, *o, *l))
            .collect();
        self.apply_locked(&mut st, &refs)
    }

    /// Drops a removed file's byte marks and metadata flags (its entry flags stay: the name
    /// may still be on a target that missed its creation or removal).
    pub(super) fn drop_marks(&self, path: &str) -> FopResult<()> {
        let mut st = self.store();
        let mut ops: Vec<(u8, &str, u32, u64, u64)> = Vec::new();
        if let Some(t) = st.records.get(path) {
            ops.extend(t.keys().map(|t| (b'C', path, *t, 0, m::WHOLE)));
        }
        if let Some(t) = st.flags.get(path) {
            ops.extend(
                t.iter()
                    .filter(|(_, f)| **f & m::META != 0)
                    .map(|(t, _)| (b'f', path, *t, u64::from(m::META), 0)),
            );
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.apply_locked(&mut st, &ops)
    }

    pub(super) fn sync_log(&self) -> FopResult<()> {
        let mut st = self.store();
        if !st.dirty {
            return Ok(());
        }
        if let Some(f) = &st.log {
            f.sync_data().map_err(|e| io_errno(&e))?;
        }
        st.dirty = false;
        Ok(())
    }
}

/// The errno for a failed log operation; a refused file (no OS error) is EIO.
pub(super) fn io_errno(e: &std::io::Error) -> u32 {
    e.raw_os_error().map_or(errno::EIO, |n| n as u32)
}

/// Opens `.kiln` beneath the brick `root` without following a symlink, making it when missing
/// and `create` (`None` when missing and not). A symlink or a non-directory there is refused.
pub(super) fn open_state_dir(root: &OwnedFd, create: bool) -> std::io::Result<Option<OwnedFd>> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let open = || rfs::openat(root, STATE_DIR, flags, Mode::empty());
    let r = match open() {
        Err(Errno::NOENT) if create => {
            match rfs::mkdirat(root, STATE_DIR, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => open(),
                Err(e) => return Err(e.into()),
            }
        }
        Err(Errno::NOENT) => return Ok(None),
        r => r,
    };
    match r {
        Ok(fd) => Ok(Some(fd)),
        // O_DIRECTORY | O_NOFOLLOW on a symlink: ENOTDIR (ELOOP on some kernels).
        Err(Errno::LOOP | Errno::NOTDIR) => {
            let link = rfs::statat(root, STATE_DIR, AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink);
            Err(refused(
                STATE_DIR,
                if link {
                    "is a symbolic link; kilnd does not follow it (the pending marks must be \
                     in a directory of the brick itself)"
                } else {
                    "is not a directory"
                },
            ))
        }
        Err(e) => Err(e.into()),
    }
}

/// Opens the log in the `.kiln` directory `state` without following a symlink; refuses any
/// file but a regular one with a single link (a hard link could name a file outside).
pub(super) fn open_log(state: &OwnedFd, flags: OFlags, mode: Mode) -> std::io::Result<File> {
    let name = format!("{STATE_DIR}/{LOG}");
    // NONBLOCK: a FIFO planted there must not hang the open (no effect on a regular file).
    let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK;
    let fd = rfs::openat(state, LOG, flags, mode).map_err(|e| match e {
        Errno::LOOP => refused(&name, "is a symbolic link; kilnd does not follow it"),
        e => e.into(),
    })?;
    let st = rfs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(refused(&name, "is not a regular file"));
    }
    if st.st_nlink != 1 {
        return Err(refused(
            &name,
            "has more than one hard link (one may be a file outside the brick)",
        ));
    }
    Ok(File::from(fd))
}

/// Writes the live `records` to a new log in `state` and renames it over the old one; returns
/// the new log, open for appending.
pub(super) fn compact(
    dir: &Path,
    state: &OwnedFd,
    records: &Records,
    flags: &Flags,
) -> std::io::Result<File> {
    // A leftover from a compaction that did not finish, or something planted: removed (a
    // symlink itself, never what it points to), then made afresh (O_EXCL follows nothing).
    if let Ok(st) = rfs::statat(state, LOG_NEW, AtFlags::SYMLINK_NOFOLLOW) {
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            tracing::warn!(
                "{}: {STATE_DIR}/{LOG_NEW} is not a regular file (planted?): removing it",
                dir.display()
            );
        }
        rfs::unlinkat(state, LOG_NEW, AtFlags::empty())?;
    }
    let fd = rfs::openat(
        state,
        LOG_NEW,
        OFlags::WRONLY
            | OFlags::APPEND
            | OFlags::CREATE
            | OFlags::EXCL
            | OFlags::NOFOLLOW
            | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )?;
    let mut f = File::from(fd);
    let mut buf = Vec::new();
    for (p, targets) in records {
        for (t, ranges) in targets {
            for (o, l) in ranges.iter() {
                record(&mut buf, b'A', p, *t, o, l);
            }
        }
    }
    for (p, targets) in flags {
        for (t, f) in targets {
            record(&mut buf, b'F', p, *t, u64::from(*f), 0);
        }
    }
    f.write_all(&buf)?;
    f.sync_data()?;
    rfs::renameat(state, LOG_NEW, state, LOG)?;
    rfs::fsync(state)?;
    Ok(f)
}

/// A state file kilnd will not use, with why.
pub(super) fn refused(name: &str, why: &str) -> std::io::Error {
    std::io::Error::other(format!("refusing {name} in the brick: it {why}"))
}

pub(super) fn record(buf: &mut Vec<u8>, kind: u8, path: &str, target: u32, offset: u64, len: u64) {
    buf.push(kind);
    buf.extend_from_slice(&target.to_le_bytes());
    buf.extend_from_slice(&offset.to_le_bytes());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&(path.len() as u16).to_le_bytes());
    buf.extend_from_slice(path.as_bytes());
}

/// Applies one record: `A`/`C` add/clear bytes `[offset, offset+len)`, `F`/`f` set/clear the
/// flag bits in `offset`.
pub(super) fn apply_one(
    records: &mut Records,
    flags: &mut Flags,
    kind: u8,
    path: &str,
    target: u32,
    offset: u64,
    len: u64,
) {
    if kind == b'F' {
        *flags
            .entry(path.to_owned())
            .or_default()
            .entry(target)
            .or_default() |= offset as u32;
    } else if kind == b'f' {
        if let Some(targets) = flags.get_mut(path) {
            if let Some(f) = targets.get_mut(&target) {
                *f &= !(offset as u32);
                if *f == 0 {
                    targets.remove(&target);
                }
            }
            if targets.is_empty() {
                flags.remove(path);
            }
        }
    } else if kind == b'A' {
        records
            .entry(path.to_owned())
            .or_default()
            .entry(target)
            .or_default()
            .add(offset, len);
    } else if let Some(targets) = records.get_mut(path) {
        if let Some(r) = targets.get_mut(&target) {
            r.remove(offset, len);
            if r.is_empty() {
                targets.remove(&target);
            }
        }
        if targets.is_empty() {
            records.remove(path);
        }
    }
}

/// Replays a log; returns the records read and whether the tail was torn or bad.
pub(super) fn replay(mut bytes: &[u8], records: &mut Records, flags: &mut Flags) -> (usize, bool) {
    let mut n = 0;
    while !bytes.is_empty() {
        if bytes.len() < 23 {
            return (n, true);
        }
        let kind = bytes[0];
        let target = u32::from_le_bytes(bytes[1..5].try_into().expect("4 bytes"));
        let offset = u64::from_le_bytes(bytes[5..13].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(bytes[13..21].try_into().expect("8 bytes"));
        let plen = u16::from_le_bytes(bytes[21..23].try_into().expect("2 bytes")) as usize;
        if bytes.len() < 23 + plen || !matches!(kind, b'A' | b'C' | b'F' | b'f') {
            return (n, true);
        }
        let Ok(path) = std::str::from_utf8(&bytes[23..23 + plen]) else {
            return (n, true);
        };
        apply_one(records, flags, kind, path, target, offset, len);
        bytes = &bytes[23 + plen..];
        n += 1;
    }
    (n, false)
}
