//! The marks layer: a brick's records of what other replicas missed, and heal's range locks.
//!
//! The replicate layer (client side) writes marks on the replicas that took a change another
//! replica missed, and reads them to keep a replica that is behind from serving reads; heal
//! reads the index, copies the marked ranges and clears them. All of that travels as
//! `kiln.`-namespace xattrs ([`kiln_layer::marks`]) which this layer answers itself.
//!
//! Records live in memory and in an append-only log, `.kiln/pending.log` in the brick
//! directory (clients cannot name `.kiln`: the brick refuses the path). The log is written
//! before the setxattr is answered (page cache: it survives the brick process dying; an fsync
//! through this layer also syncs the log), replayed and compacted when the brick starts.
//!
//! kilnd runs as root and a local user may be able to write into the brick, so none of these
//! files is opened by a joined path: `.kiln` is opened relative to the brick root's fd, and the
//! log and its compaction's temporary file relative to `.kiln`'s fd, none of them following a
//! symlink (a planted symlink would make kilnd create, append to or truncate a file outside
//! the brick). `.kiln`, or the log, found to be a symlink or some other odd file when the brick
//! starts stops the brick from starting; found so later, the mark that needed it fails (EIO)
//! and the error is logged.
//!
//! Heal locks: a heal takes a lock on a file's range on every replica before it reads the
//! source and writes the target, so that no client write to that range runs on any replica in
//! between. A lock waits for writes in flight to the range to finish; writes to a locked range
//! by other connections wait for the lock to go (or its lease to lapse). When no lock exists
//! the cost of a write is one uncontended mutex and a short vector push/pop.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kiln_layer::marks::{self as m, IndexEntry, IndexPage, LockReq, Mark, PendingPage, RangeSet};
use kiln_layer::{
    errno, fail, Attr, Ctx, Fd, FopResult, Fut, IoBufs, Layer, LayerRef, ReadDst, ReadOut,
    SetAttrs, Written,
};
use kiln_proto::codec::Seq;
use kiln_proto::ops::SETATTR_SIZE;
use kiln_proto::Wire;
use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// The directory inside a brick that holds Kiln's own records.
pub const STATE_DIR: &str = ".kiln";
const LOG: &str = "pending.log";
/// The compaction's temporary file, renamed over [`LOG`].
const LOG_NEW: &str = "pending.log.new";

/// A heal lock.
struct Lock {
    owner: u64,
    start: u64,
    end: u64,
    expires: Instant,
}

/// Locks and writes in flight on one file.
#[derive(Default)]
struct FileState {
    locks: Vec<Lock>,
    /// (id, owner, start, end) of writes running now.
    inflight: Vec<(u64, u64, u64, u64)>,
    next: u64,
}

struct FileKey {
    st: Mutex<FileState>,
    changed: tokio::sync::Notify,
}

impl FileKey {
    fn state(&self) -> MutexGuard<'_, FileState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn span(offset: u64, len: u64) -> (u64, u64) {
    if len == m::WHOLE {
        (offset, u64::MAX)
    } else {
        (offset, offset.saturating_add(len).max(offset + 1))
    }
}

/// An open file seen through this layer.
struct MarkFd {
    key: Arc<FileKey>,
    inner: Fd,
}

/// Marks by file, then by target replica.
type Records = BTreeMap<String, BTreeMap<u32, RangeSet>>;

struct Store {
    records: Records,
    /// `.kiln`, once it exists (opened at start, or made at the first mark).
    state: Option<OwnedFd>,
    log: Option<File>,
    dirty: bool,
}

/// The marks layer.
pub struct Marks {
    name: String,
    kids: Vec<LayerRef>,
    /// The brick directory: for messages. Files are reached through `root` only.
    dir: PathBuf,
    /// The brick directory, opened at start.
    root: OwnedFd,
    store: Mutex<Store>,
    files: Mutex<HashMap<String, Arc<FileKey>>>,
}

fn unwrap(fd: &Fd) -> FopResult<&MarkFd> {
    fd.get::<MarkFd>()
}

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
                    let (n, bad) = replay(&bytes, &mut records);
                    if bad {
                        tracing::warn!(
                            records = n,
                            "{}: ignoring a torn record at the end",
                            path.display()
                        );
                    }
                    log = Some(compact(dir, state, &records).map_err(|e| {
                        std::io::Error::new(e.kind(), format!("compacting {}: {e}", path.display()))
                    })?);
                    tracing::info!(
                        files = records.len(),
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
        Ok(Marks {
            name: name.into(),
            kids: vec![child],
            dir: dir.to_owned(),
            root,
            store: Mutex::new(Store {
                records,
                state,
                log,
                dirty: false,
            }),
            files: Mutex::default(),
        })
    }

    fn child(&self) -> &LayerRef {
        &self.kids[0]
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn key(&self, path: &str) -> Arc<FileKey> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files
            .entry(path.to_owned())
            .or_insert_with(|| {
                Arc::new(FileKey {
                    st: Mutex::default(),
                    changed: tokio::sync::Notify::new(),
                })
            })
            .clone()
    }

    /// Forgets a file's lock state when nobody holds it.
    fn forget(&self, path: &str, key: &Arc<FileKey>) {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        // Ours, the map's: nobody else.
        if Arc::strong_count(key) <= 2
            && key.state().locks.is_empty()
            && files.get(path).is_some_and(|k| Arc::ptr_eq(k, key))
        {
            files.remove(path);
        }
    }

    /// Appends records to the log (creating `.kiln` on first use) and applies them.
    fn apply(&self, ops: &[(u8, &str, u32, u64, u64)]) -> FopResult<()> {
        let mut st = self.store();
        if st.log.is_none() {
            let opened = self.open_log_for_append(&mut st);
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
            apply_one(&mut st.records, *kind, path, *t, *o, *l);
        }
        Ok(())
    }

    /// Opens (making them if need be) `.kiln` and the log, for the first mark since start.
    fn open_log_for_append(&self, st: &mut Store) -> std::io::Result<File> {
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

    fn pending_page(&self, path: &str) -> Vec<u8> {
        let st = self.store();
        let mut page = PendingPage {
            targets: Seq(Vec::new()),
            more: false,
        };
        let mut size = 0;
        if let Some(targets) = st.records.get(path) {
            'outer: for (t, ranges) in targets {
                let mut tr = m::TargetRanges {
                    target: *t,
                    ranges: Seq(Vec::new()),
                };
                for (offset, len) in ranges.iter() {
                    if size + 16 > m::PAGE_BYTES {
                        page.more = true;
                        page.targets.0.push(tr);
                        break 'outer;
                    }
                    size += 16;
                    tr.ranges.0.push(m::Range { offset, len });
                }
                page.targets.0.push(tr);
            }
        }
        page.to_wire()
    }

    fn index_page(&self) -> Vec<u8> {
        let st = self.store();
        let mut page = IndexPage {
            entries: Seq(Vec::new()),
            more: false,
        };
        let mut size = 0;
        'outer: for (path, targets) in &st.records {
            for (t, ranges) in targets {
                let need = 32 + path.len();
                if size + need > m::PAGE_BYTES {
                    page.more = true;
                    break 'outer;
                }
                size += need;
                page.entries.0.push(IndexEntry {
                    path: path.clone(),
                    target: *t,
                    ranges: ranges.count() as u64,
                    bytes: ranges.bytes(),
                });
            }
        }
        page.to_wire()
    }

    /// Takes a heal lock, waiting for writes in flight and other connections' locks.
    async fn lock(&self, owner: u64, path: &str, start: u64, end: u64) -> FopResult<()> {
        let key = self.key(path);
        loop {
            let notified = key.changed.notified();
            let wait = {
                let mut st = key.state();
                let now = Instant::now();
                st.locks.retain(|l| l.expires > now);
                let blocked_by = st
                    .locks
                    .iter()
                    .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                    .map(|l| l.expires)
                    .min();
                let busy = st
                    .inflight
                    .iter()
                    .any(|w| w.1 != owner && overlap((w.2, w.3), (start, end)));
                if blocked_by.is_none() && !busy {
                    st.locks.push(Lock {
                        owner,
                        start,
                        end,
                        expires: now + m::LOCK_LEASE,
                    });
                    return Ok(());
                }
                blocked_by.map_or(m::LOCK_LEASE, |e| e.saturating_duration_since(now))
            };
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    fn unlock(&self, owner: u64, path: &str, start: u64, end: u64) {
        let key = self.key(path);
        key.state()
            .locks
            .retain(|l| !(l.owner == owner && l.start == start && l.end == end));
        key.changed.notify_waiters();
        self.forget(path, &key);
    }

    /// Waits until `[start, end)` of the file is not locked by another connection, then
    /// registers a write in flight there. Returns its id.
    async fn enter(key: &FileKey, owner: u64, start: u64, end: u64) -> u64 {
        loop {
            let notified = key.changed.notified();
            let wait = {
                let mut st = key.state();
                let mut wait = None;
                if !st.locks.is_empty() {
                    let now = Instant::now();
                    st.locks.retain(|l| l.expires > now);
                    wait = st
                        .locks
                        .iter()
                        .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                        .map(|l| l.expires.saturating_duration_since(now))
                        .min();
                }
                match wait {
                    Some(w) => w,
                    None => {
                        st.next += 1;
                        let id = st.next;
                        st.inflight.push((id, owner, start, end));
                        return id;
                    }
                }
            };
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    fn leave(key: &FileKey, id: u64) {
        let mut st = key.state();
        if let Some(i) = st.inflight.iter().position(|w| w.0 == id) {
            st.inflight.swap_remove(i);
        }
        if !st.locks.is_empty() {
            drop(st);
            key.changed.notify_waiters();
        }
    }

    /// Runs a change to `[start, end)` of an open file under the lock rules.
    fn gated<'a, T: Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        start: u64,
        end: u64,
        call: impl FnOnce(&'a Fd) -> Fut<'a, T> + Send + 'a,
    ) -> Fut<'a, T> {
        let mfd = match unwrap(fd) {
            Ok(f) => f,
            Err(e) => return fail(e),
        };
        Box::pin(async move {
            let id = Marks::enter(&mfd.key, cx.owner, start, end).await;
            let r = call(&mfd.inner).await;
            Marks::leave(&mfd.key, id);
            r
        })
    }

    fn set_virtual<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        name: &'a str,
        value: &'a [u8],
    ) -> Fut<'a, ()> {
        let bad = |e| {
            tracing::warn!(path, name, "bad {name} value: {e}");
            errno::EINVAL
        };
        match name {
            m::ADD | m::CLEAR => {
                let mark = match Mark::from_wire(value) {
                    Ok(v) => v,
                    Err(e) => return fail(bad(e)),
                };
                if let Err(e) = crate::brick::check_path(path) {
                    return fail(e);
                }
                let kind = if name == m::ADD { b'A' } else { b'C' };
                let r = self.apply(&[(kind, path, mark.target, mark.offset, mark.len)]);
                Box::pin(std::future::ready(r))
            }
            m::LOCK => {
                let req = match LockReq::from_wire(value) {
                    Ok(v) => v,
                    Err(e) => return fail(bad(e)),
                };
                let (start, end) = span(req.offset, req.len);
                if req.lock == 1 {
                    Box::pin(self.lock(cx.owner, path, start, end))
                } else {
                    self.unlock(cx.owner, path, start, end);
                    Box::pin(std::future::ready(Ok(())))
                }
            }
            _ => fail(EOPNOTSUPP),
        }
    }

    /// Moves a renamed file's marks to its new name. (A renamed directory's files keep theirs
    /// under the old names; heal finds those missing and reports them.)
    fn rename_marks(&self, from: &str, to: &str) -> FopResult<()> {
        let moved: Vec<(u32, Vec<(u64, u64)>)> = match self.store().records.get(from) {
            Some(targets) => targets
                .iter()
                .map(|(t, r)| (*t, r.iter().collect()))
                .collect(),
            None => return Ok(()),
        };
        let mut ops = Vec::new();
        for (t, ranges) in &moved {
            ops.push((b'C', from, *t, 0, m::WHOLE));
            for (o, l) in ranges {
                ops.push((b'A', to, *t, *o, *l));
            }
        }
        self.apply(&ops)
    }

    fn drop_marks(&self, path: &str) -> FopResult<()> {
        let targets: Vec<u32> = match self.store().records.get(path) {
            Some(t) => t.keys().copied().collect(),
            None => return Ok(()),
        };
        let ops: Vec<_> = targets
            .iter()
            .map(|t| (b'C', path, *t, 0, m::WHOLE))
            .collect();
        self.apply(&ops)
    }

    fn sync_log(&self) -> FopResult<()> {
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

/// Operation not supported (a `kiln.` name this layer does not know).
const EOPNOTSUPP: u32 = 95;

/// The errno for a failed log operation; a refused file (no OS error) is EIO.
fn io_errno(e: &std::io::Error) -> u32 {
    e.raw_os_error().map_or(errno::EIO, |n| n as u32)
}

/// Opens `.kiln` beneath the brick `root` without following a symlink, making it when missing
/// and `create` (`None` when missing and not). A symlink or a non-directory there is refused.
fn open_state_dir(root: &OwnedFd, create: bool) -> std::io::Result<Option<OwnedFd>> {
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
fn open_log(state: &OwnedFd, flags: OFlags, mode: Mode) -> std::io::Result<File> {
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
fn compact(dir: &Path, state: &OwnedFd, records: &Records) -> std::io::Result<File> {
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
    f.write_all(&buf)?;
    f.sync_data()?;
    rfs::renameat(state, LOG_NEW, state, LOG)?;
    rfs::fsync(state)?;
    Ok(f)
}

/// A state file kilnd will not use, with why.
fn refused(name: &str, why: &str) -> std::io::Error {
    std::io::Error::other(format!("refusing {name} in the brick: it {why}"))
}

fn record(buf: &mut Vec<u8>, kind: u8, path: &str, target: u32, offset: u64, len: u64) {
    buf.push(kind);
    buf.extend_from_slice(&target.to_le_bytes());
    buf.extend_from_slice(&offset.to_le_bytes());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&(path.len() as u16).to_le_bytes());
    buf.extend_from_slice(path.as_bytes());
}

fn apply_one(records: &mut Records, kind: u8, path: &str, target: u32, offset: u64, len: u64) {
    if kind == b'A' {
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
fn replay(mut bytes: &[u8], records: &mut Records) -> (usize, bool) {
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
        if bytes.len() < 23 + plen || !(kind == b'A' || kind == b'C') {
            return (n, true);
        }
        let Ok(path) = std::str::from_utf8(&bytes[23..23 + plen]) else {
            return (n, true);
        };
        apply_one(records, kind, path, target, offset, len);
        bytes = &bytes[23 + plen..];
        n += 1;
    }
    (n, false)
}

impl Layer for Marks {
    fn name(&self) -> &str {
        &self.name
    }

    fn children(&self) -> &[LayerRef] {
        &self.kids
    }

    fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(async move {
            let inner = self.child().open(cx, path, flags).await?;
            Ok(Fd::new(MarkFd {
                key: self.key(path),
                inner,
            }))
        })
    }

    fn create<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        flags: u32,
        mode: u32,
    ) -> Fut<'a, (Fd, Attr)> {
        Box::pin(async move {
            let (inner, attr) = self.child().create(cx, path, flags, mode).await?;
            Ok((
                Fd::new(MarkFd {
                    key: self.key(path),
                    inner,
                }),
                attr,
            ))
        })
    }

    fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        Box::pin(async move {
            let (inner, key) = {
                let mfd = unwrap(&fd)?;
                (mfd.inner.clone(), mfd.key.clone())
            };
            drop(fd);
            let r = self.child().release(cx, inner).await;
            // The path the key was made for is not kept; look it up by identity.
            let path = {
                let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
                files
                    .iter()
                    .find(|(_, k)| Arc::ptr_eq(k, &key))
                    .map(|(p, _)| p.clone())
            };
            if let Some(p) = path {
                self.forget(&p, &key);
            }
            r
        })
    }

    fn fstat<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, Attr> {
        match unwrap(fd) {
            Ok(f) => self.child().fstat(cx, &f.inner),
            Err(e) => fail(e),
        }
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        match unwrap(fd) {
            Ok(f) => self.child().read(cx, &f.inner, offset, dst),
            Err(e) => fail(e),
        }
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        let (start, end) = span(offset, data.len() as u64);
        self.gated(cx, fd, start, end, move |inner| {
            self.child().write(cx, inner, offset, data)
        })
    }

    fn fsync<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, datasync: bool) -> Fut<'a, ()> {
        let f = match unwrap(fd) {
            Ok(f) => f,
            Err(e) => return fail(e),
        };
        Box::pin(async move {
            self.child().fsync(cx, &f.inner, datasync).await?;
            let dirty = self.store().dirty;
            if dirty {
                // A rare, small sync: the log is only written when a replica missed a change.
                self.sync_log()?;
            }
            Ok(())
        })
    }

    fn fsetattr<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        if attrs.valid & SETATTR_SIZE != 0 {
            let start = attrs.size;
            return self.gated(cx, fd, start, u64::MAX, move |inner| {
                self.child().fsetattr(cx, inner, attrs)
            });
        }
        match unwrap(fd) {
            Ok(f) => self.child().fsetattr(cx, &f.inner, attrs),
            Err(e) => fail(e),
        }
    }

    fn setattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        if attrs.valid & SETATTR_SIZE == 0 {
            return self.child().setattr(cx, path, attrs);
        }
        Box::pin(async move {
            let key = self.key(path);
            let id = Marks::enter(&key, cx.owner, attrs.size, u64::MAX).await;
            let r = self.child().setattr(cx, path, attrs).await;
            Marks::leave(&key, id);
            drop(key);
            r
        })
    }

    fn fallocate<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Fut<'a, ()> {
        let (start, end) = span(offset, len);
        self.gated(cx, fd, start, end, move |inner| {
            self.child().fallocate(cx, inner, mode, offset, len)
        })
    }

    fn discard<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, len: u64) -> Fut<'a, ()> {
        let (start, end) = span(offset, len);
        self.gated(cx, fd, start, end, move |inner| {
            self.child().discard(cx, inner, offset, len)
        })
    }

    fn getxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, Vec<u8>> {
        if !name.starts_with(m::PREFIX) {
            return self.child().getxattr(cx, path, name);
        }
        let r = match name {
            m::PENDING => Ok(self.pending_page(path)),
            m::INDEX => Ok(self.index_page()),
            _ => Err(EOPNOTSUPP),
        };
        Box::pin(std::future::ready(r))
    }

    fn setxattr<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        name: &'a str,
        value: &'a [u8],
        flags: u32,
    ) -> Fut<'a, ()> {
        if name.starts_with(m::PREFIX) {
            return self.set_virtual(cx, path, name, value);
        }
        self.child().setxattr(cx, path, name, value, flags)
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, ()> {
        if name.starts_with(m::PREFIX) {
            return fail(EOPNOTSUPP);
        }
        self.child().removexattr(cx, path, name)
    }

    fn unlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        Box::pin(async move {
            self.child().unlink(cx, path).await?;
            self.drop_marks(path)
        })
    }

    fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
        Box::pin(async move {
            self.child().rename(cx, from, to, flags).await?;
            self.rename_marks(from, to)
        })
    }
}
