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
//!
//! Heal sessions (see [`kiln_layer::marks`]): on the replica being healed, a heal `begin`s a
//! session on a file; from then until it `end`s (or its lease lapses) every change that another
//! connection makes to the file adds its range to the session's record, at the moment it is
//! let through (under the file's state mutex, with the write registered in flight), and the
//! changes already in flight when the session begins are recorded too. A write through a heal
//! handle ([`kiln_layer::marks::HEAL_OPEN`]) takes, under the same mutex, only the parts the
//! record does not hold, and registers itself in flight; a client change that overlaps a heal
//! write in flight waits for it (that only happens once heal's lock has lapsed). So on this
//! brick a client change and a heal write to the same bytes are ordered, and whichever order
//! they take, the client's bytes are what stays. Without a session the cost of a write is as
//! above: the session list is looked at only when the lock list or it is non-empty. (Like the
//! locks, sessions are per path: an open with `O_TRUNC`, or a change through another name of
//! the same file, is not seen.)
//!
//! Marks carry a generation per (file, target) in memory: a fresh number (from a counter that
//! starts at the wall clock, so a restarted brick never reuses one) each time a mark for the
//! target is added. `kiln.pending.clear.if` clears only when it is unchanged, which lets heal
//! clear what its writes skipped unless a miss was recorded meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kiln_layer::marks::{
    self as m, CondFlag, CondMark, FlagMark, HealInfo, HealReq, IndexEntry, IndexPage, LockReq,
    Mark, PendingPage, RangeSet,
};
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

/// A change to a file running now.
struct Inflight {
    id: u64,
    owner: u64,
    start: u64,
    end: u64,
    /// A heal write (through a heal handle).
    heal: bool,
}

/// A heal session on a file: what other connections changed since it began.
struct Session {
    owner: u64,
    expires: Instant,
    /// Ranges other connections changed (or were changing) since the session began.
    written: RangeSet,
    /// Ranges heal writes skipped that heal has not asked for yet.
    skipped: RangeSet,
    /// Clients had the file open, or were changing it, when the session began.
    busy: bool,
}

/// Locks, heal sessions and changes in flight on one file.
#[derive(Default)]
struct FileState {
    locks: Vec<Lock>,
    inflight: Vec<Inflight>,
    next: u64,
    sessions: Vec<Session>,
    /// Handles open on the file through this layer, heal's not counted.
    clients: u32,
    /// Lock requests waiting for changes in flight to leave.
    lockers: u32,
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

/// `[start, end)` as (offset, len) for a [`RangeSet`].
fn len_of(start: u64, end: u64) -> u64 {
    if end == u64::MAX {
        m::WHOLE
    } else {
        end - start
    }
}

/// An open file seen through this layer.
struct MarkFd {
    key: Arc<FileKey>,
    inner: Fd,
    /// Opened with [`m::HEAL_OPEN`]: writes are heal's.
    heal: bool,
}

impl MarkFd {
    fn new(key: Arc<FileKey>, inner: Fd, heal: bool) -> MarkFd {
        if !heal {
            key.state().clients += 1;
        }
        MarkFd { key, inner, heal }
    }
}

impl Drop for MarkFd {
    fn drop(&mut self) {
        if !self.heal {
            let mut st = self.key.state();
            st.clients = st.clients.saturating_sub(1);
        }
    }
}

/// A lock request waiting for changes in flight, counted in [`FileState::lockers`] until
/// dropped.
struct Locker<'a>(&'a FileKey);

impl Drop for Locker<'_> {
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.lockers = st.lockers.saturating_sub(1);
    }
}

/// A change registered in flight; leaves when dropped (also when its future is dropped).
struct Entered<'a> {
    key: &'a FileKey,
    id: u64,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        Marks::leave(self.key, self.id);
    }
}

/// Operation would block / try again.
const EAGAIN: u32 = 11;
/// Timed out: a heal write whose session lapsed.
const ETIMEDOUT: u32 = 110;

/// Marks by file, then by target replica.
type Records = BTreeMap<String, BTreeMap<u32, RangeSet>>;

/// Entry/metadata flags ([`m::ENTRY`], [`m::META`]) by path, then by target.
type Flags = BTreeMap<String, BTreeMap<u32, u32>>;

/// Generations by file, then by target: see the module documentation.
type Gens = BTreeMap<String, BTreeMap<u32, u64>>;

struct Store {
    records: Records,
    flags: Flags,
    gens: Gens,
    /// The next generation.
    next_gen: u64,
    /// `.kiln`, once it exists (opened at start, or made at the first mark).
    state: Option<OwnedFd>,
    log: Option<File>,
    dirty: bool,
}

impl Store {
    /// The generation of `target`'s marks on `path`: it changes whenever one is added.
    fn gen(&self, path: &str, target: u32) -> u64 {
        self.gens
            .get(path)
            .and_then(|g| g.get(&target))
            .copied()
            .unwrap_or(0)
    }
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
        Ok(Marks {
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
            && {
                let mut st = key.state();
                let now = Instant::now();
                st.sessions.retain(|s| s.expires > now);
                st.locks.is_empty() && st.sessions.is_empty()
            }
            && files.get(path).is_some_and(|k| Arc::ptr_eq(k, key))
        {
            files.remove(path);
        }
    }

    /// Appends records to the log (creating `.kiln` on first use) and applies them.
    fn apply(&self, ops: &[(u8, &str, u32, u64, u64)]) -> FopResult<()> {
        let mut st = self.store();
        self.apply_locked(&mut st, ops)
    }

    /// Clears `[offset, offset+len)` of `target`'s marks on `path` unless a mark for it was
    /// added since generation `gen` (`EAGAIN`).
    fn clear_if(&self, path: &str, target: u32, gen: u64, offset: u64, len: u64) -> FopResult<()> {
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
    fn clear_flags_if(
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
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.apply_locked(&mut st, &ops)
    }

    fn apply_locked(&self, st: &mut Store, ops: &[(u8, &str, u32, u64, u64)]) -> FopResult<()> {
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
        let empty = BTreeMap::new();
        let records = st.records.get(path).unwrap_or(&empty);
        let flags = st.flags.get(path);
        let mut targets: Vec<u32> = records.keys().copied().collect();
        targets.extend(flags.into_iter().flat_map(|f| f.keys().copied()));
        targets.sort_unstable();
        targets.dedup();
        if !targets.is_empty() {
            // The page's room, shared among the targets (each has a few marks, mostly).
            let per = ((m::PAGE_BYTES / targets.len().max(1)).saturating_sub(40) / 16).max(1);
            let none = RangeSet::default();
            for t in &targets {
                let ranges = records.get(t).unwrap_or(&none);
                let mut tr = m::TargetRanges {
                    target: *t,
                    ranges: Seq(Vec::new()),
                    gen: st.gen(path, *t),
                    cut: m::WHOLE,
                    flags: flags.and_then(|f| f.get(t)).copied().unwrap_or(0),
                };
                for (i, (offset, len)) in ranges.iter().enumerate() {
                    if i == per {
                        tr.cut = offset;
                        page.more = true;
                        break;
                    }
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
        // Paths with byte marks or flags, in path order (a parent before what is in it).
        let mut paths: Vec<&String> = st.records.keys().chain(st.flags.keys()).collect();
        paths.sort_unstable();
        paths.dedup();
        let none = BTreeMap::new();
        'outer: for path in paths {
            let records = st.records.get(path).unwrap_or(&none);
            let flags = st.flags.get(path);
            let mut targets: Vec<u32> = records.keys().copied().collect();
            targets.extend(flags.into_iter().flat_map(|f| f.keys().copied()));
            targets.sort_unstable();
            targets.dedup();
            for t in targets {
                let need = 40 + path.len();
                if size + need > m::PAGE_BYTES {
                    page.more = true;
                    break 'outer;
                }
                size += need;
                let ranges = records.get(&t);
                page.entries.0.push(IndexEntry {
                    path: path.clone(),
                    target: t,
                    ranges: ranges.map_or(0, |r| r.count() as u64),
                    bytes: ranges.map_or(0, |r| r.bytes()),
                    flags: flags.and_then(|f| f.get(&t)).copied().unwrap_or(0),
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
            let (wait, busy) = {
                let mut st = key.state();
                let now = Instant::now();
                st.locks.retain(|l| l.expires > now);
                // A heal at work on the file (waiting for a lock counts) keeps its session.
                for s in st.sessions.iter_mut().filter(|s| s.owner == owner) {
                    s.expires = s.expires.max(now + m::LOCK_LEASE);
                }
                let blocked_by = st
                    .locks
                    .iter()
                    .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                    .map(|l| l.expires)
                    .min();
                let busy = st
                    .inflight
                    .iter()
                    .any(|w| w.owner != owner && overlap((w.start, w.end), (start, end)));
                if blocked_by.is_none() && !busy {
                    st.locks.push(Lock {
                        owner,
                        start,
                        end,
                        expires: now + m::LOCK_LEASE,
                    });
                    return Ok(());
                }
                if busy {
                    // Counted (under the mutex, so no leave is missed): writes in flight wake
                    // us as they leave.
                    st.lockers += 1;
                }
                let wait = blocked_by.map_or(m::LOCK_LEASE, |e| e.saturating_duration_since(now));
                (wait, busy)
            };
            let _counted = busy.then_some(Locker(&key));
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

    /// Waits until `[start, end)` of the file is not locked by another connection (nor being
    /// written by another connection's heal), then registers a client change in flight there
    /// and records it in the file's heal sessions. Returns its id.
    async fn enter(key: &FileKey, owner: u64, start: u64, end: u64) -> u64 {
        Marks::enter_as(key, owner, start, end, true).await
    }

    /// A change of a name or of attributes (no bytes): waits for heal's locks on the path
    /// and registers in flight (so a lock waits for it), but is not a data change a heal
    /// session should keep its bytes for.
    async fn enter_ns(key: &FileKey, owner: u64) -> u64 {
        Marks::enter_as(key, owner, 0, u64::MAX, false).await
    }

    async fn enter_as(key: &FileKey, owner: u64, start: u64, end: u64, record: bool) -> u64 {
        loop {
            let notified = key.changed.notified();
            let wait = {
                let mut st = key.state();
                let mut wait = None;
                if !st.locks.is_empty() || !st.sessions.is_empty() {
                    let now = Instant::now();
                    st.locks.retain(|l| l.expires > now);
                    st.sessions.retain(|s| s.expires > now);
                    wait = st
                        .locks
                        .iter()
                        .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                        .map(|l| l.expires.saturating_duration_since(now))
                        .min();
                    let healing = st.inflight.iter().any(|w| {
                        w.heal && w.owner != owner && overlap((w.start, w.end), (start, end))
                    });
                    if wait.is_none() && healing {
                        // Woken when the heal write leaves.
                        wait = Some(m::LOCK_LEASE);
                    }
                }
                match wait {
                    Some(w) => w,
                    None => {
                        st.next += 1;
                        let id = st.next;
                        st.inflight.push(Inflight {
                            id,
                            owner,
                            start,
                            end,
                            heal: false,
                        });
                        if record {
                            for s in st.sessions.iter_mut().filter(|s| s.owner != owner) {
                                s.written.add(start, len_of(start, end));
                            }
                        }
                        return id;
                    }
                }
            };
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    /// Waits until `[start, end)` is not locked by another connection, then registers a heal
    /// write there and returns its id and the parts of the range no client changed since
    /// `owner`'s session began (the others are added to the session's skipped list). With
    /// `cut` (a size change from `start` on) it is all or nothing: `EAGAIN` if a client
    /// changed anything from `start` on. `ETIMEDOUT` without a live session.
    async fn enter_heal(
        key: &FileKey,
        owner: u64,
        start: u64,
        end: u64,
        cut: bool,
    ) -> FopResult<(u64, Vec<(u64, u64)>)> {
        loop {
            let notified = key.changed.notified();
            let wait = {
                let mut st = key.state();
                let now = Instant::now();
                st.locks.retain(|l| l.expires > now);
                st.sessions.retain(|s| s.expires > now);
                let wait = st
                    .locks
                    .iter()
                    .filter(|l| l.owner != owner && overlap((l.start, l.end), (start, end)))
                    .map(|l| l.expires.saturating_duration_since(now))
                    .min();
                if wait.is_none() {
                    let st = &mut *st;
                    let Some(s) = st.sessions.iter_mut().find(|s| s.owner == owner) else {
                        return Err(ETIMEDOUT);
                    };
                    s.expires = now + m::LOCK_LEASE;
                    let len = len_of(start, end);
                    let keep = if cut {
                        if s.written.overlaps(start, m::WHOLE) {
                            return Err(EAGAIN);
                        }
                        vec![(start, len)]
                    } else {
                        for (o, l) in s.written.inside(start, len) {
                            s.skipped.add(o, l);
                        }
                        s.written.outside(start, len)
                    };
                    st.next += 1;
                    let id = st.next;
                    st.inflight.push(Inflight {
                        id,
                        owner,
                        start,
                        end,
                        heal: true,
                    });
                    return Ok((id, keep));
                }
                wait.unwrap_or(m::LOCK_LEASE)
            };
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    fn leave(key: &FileKey, id: u64) {
        let mut st = key.state();
        let mut heal = false;
        if let Some(i) = st.inflight.iter().position(|w| w.id == id) {
            heal = st.inflight.swap_remove(i).heal;
        }
        if heal || st.lockers > 0 || !st.locks.is_empty() {
            drop(st);
            key.changed.notify_waiters();
        }
    }

    /// Begins (afresh) `owner`'s heal session on `path`: changes in flight now count as
    /// changed since it began.
    fn heal_begin(&self, owner: u64, path: &str) {
        let key = self.key(path);
        let mut st = key.state();
        let now = Instant::now();
        st.sessions.retain(|s| s.expires > now && s.owner != owner);
        let mut written = RangeSet::default();
        for w in st.inflight.iter().filter(|w| !w.heal && w.owner != owner) {
            written.add(w.start, len_of(w.start, w.end));
        }
        let busy = st.clients > 0 || !written.is_empty();
        st.sessions.push(Session {
            owner,
            expires: now + m::LOCK_LEASE,
            written,
            skipped: RangeSet::default(),
            busy,
        });
    }

    fn heal_end(&self, owner: u64, path: &str) {
        let key = self.key(path);
        key.state().sessions.retain(|s| s.owner != owner);
        self.forget(path, &key);
    }

    /// `owner`'s session on `path`, as [`HealInfo`]; hands over (and forgets) what its writes
    /// skipped.
    fn heal_info(&self, owner: u64, path: &str) -> Vec<u8> {
        let key = self.key(path);
        let mut info = HealInfo::default();
        {
            let mut st = key.state();
            let now = Instant::now();
            st.sessions.retain(|s| s.expires > now);
            if let Some(s) = st.sessions.iter_mut().find(|s| s.owner == owner) {
                s.expires = now + m::LOCK_LEASE;
                info.live = 1;
                info.busy = u32::from(s.busy);
                let skipped = std::mem::take(&mut s.skipped);
                let room = m::PAGE_BYTES / 16 - 1;
                let mut rest: Option<(u64, u64)> = None;
                for (i, (o, l)) in skipped.iter().enumerate() {
                    if i < room {
                        info.skipped.0.push(m::Range { offset: o, len: l });
                    } else {
                        // Past the page's room: one range over all the rest.
                        let end = if l == m::WHOLE { u64::MAX } else { o + l };
                        rest = Some(rest.map_or((o, end), |(a, b)| (a, b.max(end))));
                    }
                }
                if let Some((a, b)) = rest {
                    info.skipped.0.push(m::Range {
                        offset: a,
                        len: len_of(a, b),
                    });
                }
            }
        }
        self.forget(path, &key);
        info.to_wire()
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
            let _in = Entered { key: &mfd.key, id };
            call(&mfd.inner).await
        })
    }

    /// Runs a change of names or attributes of `path` (and `also`: a rename's other name)
    /// once no other connection's heal lock holds them, registered in flight meanwhile (a heal
    /// lock waits for it). Costs, without locks, what a write's gate costs.
    fn named<'a, T: Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        also: Option<&'a str>,
        call: impl FnOnce() -> Fut<'a, T> + Send + 'a,
    ) -> Fut<'a, T> {
        Box::pin(async move {
            let key = self.key(path);
            let other = also.map(|p| (p, self.key(p)));
            let id = Marks::enter_ns(&key, cx.owner).await;
            let first = Entered { key: &key, id };
            let second = match &other {
                Some((_, k)) => Some(Entered {
                    key: k,
                    id: Marks::enter_ns(k, cx.owner).await,
                }),
                None => None,
            };
            let r = call().await;
            drop(second);
            drop(first);
            self.forget(path, &key);
            if let Some((p, k)) = &other {
                self.forget(p, k);
            }
            r
        })
    }

    /// A write through a heal handle: only the parts no client changed since the session
    /// began; the reply counts the bytes written (fewer than sent when some were skipped).
    fn heal_write<'a>(
        &'a self,
        cx: &'a Ctx,
        mfd: &'a MarkFd,
        offset: u64,
        data: IoBufs,
    ) -> Fut<'a, Written> {
        Box::pin(async move {
            let len = data.len() as u64;
            if len == 0 {
                return self.child().write(cx, &mfd.inner, offset, data).await;
            }
            let (start, end) = span(offset, len);
            let (id, keep) = Marks::enter_heal(&mfd.key, cx.owner, start, end, false).await?;
            let _in = Entered { key: &mfd.key, id };
            if keep == [(offset, len)] {
                let w = self.child().write(cx, &mfd.inner, offset, data).await?;
                // Heal's writes are whole or an error: a short one would read as "skipped".
                return if w.n as u64 == len {
                    Ok(w)
                } else {
                    Err(errno::EIO)
                };
            }
            let mut n = 0;
            for (o, l) in keep {
                let bytes = copy_out(&data, (o - offset) as usize, l as usize);
                let w = self
                    .child()
                    .write(cx, &mfd.inner, o, IoBufs::owned(vec![bytes]))
                    .await?;
                if w.n as u64 != l {
                    return Err(errno::EIO);
                }
                n += w.n;
            }
            Ok(Written { n, bufs: data })
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
            m::FLAG => {
                let f = match FlagMark::from_wire(value) {
                    Ok(v) => v,
                    Err(e) => return fail(bad(e)),
                };
                if let Err(e) = crate::brick::check_path(path) {
                    return fail(e);
                }
                let r = self.apply(&[(b'F', path, f.target, u64::from(f.flags), 0)]);
                Box::pin(std::future::ready(r))
            }
            m::FLAG_CLEAR_IF => {
                let c = match CondFlag::from_wire(value) {
                    Ok(v) => v,
                    Err(e) => return fail(bad(e)),
                };
                if let Err(e) = crate::brick::check_path(path) {
                    return fail(e);
                }
                let r = self.clear_flags_if(path, c.target, c.gen, c.flags, c.data == 1);
                Box::pin(std::future::ready(r))
            }
            m::CLEAR_IF => {
                let c = match CondMark::from_wire(value) {
                    Ok(v) => v,
                    Err(e) => return fail(bad(e)),
                };
                if let Err(e) = crate::brick::check_path(path) {
                    return fail(e);
                }
                let r = self.clear_if(path, c.target, c.gen, c.offset, c.len);
                Box::pin(std::future::ready(r))
            }
            m::HEAL => {
                let req = match HealReq::from_wire(value) {
                    Ok(v) => v,
                    Err(e) => return fail(bad(e)),
                };
                if req.begin == 1 {
                    self.heal_begin(cx.owner, path);
                } else {
                    self.heal_end(cx.owner, path);
                }
                Box::pin(std::future::ready(Ok(())))
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

    /// Moves a renamed path's marks, and those of everything beneath it (a renamed
    /// directory), to the new name. Marks held at the new name (and beneath) before are
    /// dropped but for its entry flags: what was there is gone.
    fn rename_marks(&self, from: &str, to: &str) -> FopResult<()> {
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
    fn drop_marks(&self, path: &str) -> FopResult<()> {
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

/// `len` bytes of a write's data from byte `from` on, copied out.
fn copy_out(data: &IoBufs, from: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut skip = from;
    for v in data.iov() {
        if out.len() == len {
            break;
        }
        if skip >= v.len {
            skip -= v.len;
            continue;
        }
        // SAFETY: a write's vectors point to memory that its `IoBufs` keeps valid, and that
        // nobody writes, for as long as it lives; `data` is borrowed for this whole call.
        let s = unsafe { std::slice::from_raw_parts(v.base as *const u8, v.len) };
        let take = (v.len - skip).min(len - out.len());
        out.extend_from_slice(&s[skip..skip + take]);
        skip = 0;
    }
    out
}

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
fn compact(dir: &Path, state: &OwnedFd, records: &Records, flags: &Flags) -> std::io::Result<File> {
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

/// Applies one record: `A`/`C` add/clear bytes `[offset, offset+len)`, `F`/`f` set/clear the
/// flag bits in `offset`.
fn apply_one(
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
fn replay(mut bytes: &[u8], records: &mut Records, flags: &mut Flags) -> (usize, bool) {
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

impl Layer for Marks {
    fn name(&self) -> &str {
        &self.name
    }

    fn children(&self) -> &[LayerRef] {
        &self.kids
    }

    fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(async move {
            let heal = flags & m::HEAL_OPEN != 0;
            let inner = self.child().open(cx, path, flags & !m::HEAL_OPEN).await?;
            Ok(Fd::new(MarkFd::new(self.key(path), inner, heal)))
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
            let heal = flags & m::HEAL_OPEN != 0;
            let (inner, attr) = self
                .named(cx, path, None, || {
                    self.child().create(cx, path, flags & !m::HEAL_OPEN, mode)
                })
                .await?;
            Ok((Fd::new(MarkFd::new(self.key(path), inner, heal)), attr))
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
        if let Some(f) = unwrap(fd).ok().filter(|f| f.heal) {
            return self.heal_write(cx, f, offset, data);
        }
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
            if let Some(f) = unwrap(fd).ok().filter(|f| f.heal) {
                // Heal sets the size only where no client changed anything since it began.
                return Box::pin(async move {
                    let (id, _) =
                        Marks::enter_heal(&f.key, cx.owner, start, u64::MAX, true).await?;
                    let _in = Entered { key: &f.key, id };
                    self.child().fsetattr(cx, &f.inner, attrs).await
                });
            }
            return self.gated(cx, fd, start, u64::MAX, move |inner| {
                self.child().fsetattr(cx, inner, attrs)
            });
        }
        match unwrap(fd) {
            Ok(f) if !f.heal => Box::pin(async move {
                let id = Marks::enter_ns(&f.key, cx.owner).await;
                let _in = Entered { key: &f.key, id };
                self.child().fsetattr(cx, &f.inner, attrs).await
            }),
            Ok(f) => self.child().fsetattr(cx, &f.inner, attrs),
            Err(e) => fail(e),
        }
    }

    fn setattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        if attrs.valid & SETATTR_SIZE == 0 {
            return self.named(cx, path, None, move || {
                self.child().setattr(cx, path, attrs)
            });
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
            m::HEAL => Ok(self.heal_info(cx.owner, path)),
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
        self.named(cx, path, None, move || {
            self.child().setxattr(cx, path, name, value, flags)
        })
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, ()> {
        if name.starts_with(m::PREFIX) {
            return fail(EOPNOTSUPP);
        }
        self.named(cx, path, None, move || {
            self.child().removexattr(cx, path, name)
        })
    }

    fn unlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        self.named(cx, path, None, move || {
            Box::pin(async move {
                self.child().unlink(cx, path).await?;
                self.drop_marks(path)
            })
        })
    }

    fn mkdir<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32) -> Fut<'a, Attr> {
        self.named(cx, path, None, move || self.child().mkdir(cx, path, mode))
    }

    fn rmdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        self.named(cx, path, None, move || {
            Box::pin(async move {
                self.child().rmdir(cx, path).await?;
                self.drop_marks(path)
            })
        })
    }

    fn symlink<'a>(&'a self, cx: &'a Ctx, target: &'a str, path: &'a str) -> Fut<'a, Attr> {
        self.named(cx, path, None, move || {
            self.child().symlink(cx, target, path)
        })
    }

    fn link<'a>(&'a self, cx: &'a Ctx, existing: &'a str, path: &'a str) -> Fut<'a, Attr> {
        self.named(cx, path, None, move || {
            self.child().link(cx, existing, path)
        })
    }

    fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
        self.named(cx, from, Some(to), move || {
            Box::pin(async move {
                self.child().rename(cx, from, to, flags).await?;
                self.rename_marks(from, to)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1024;

    fn stack(dir: &Path) -> Marks {
        let brick = Arc::new(crate::Brick::open(dir).unwrap());
        let posix: LayerRef = Arc::new(crate::posix::Posix::new("posix", brick));
        Marks::new("marks", posix, dir).unwrap()
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    fn cx(owner: u64) -> Ctx {
        Ctx::NONE.with_owner(owner)
    }

    async fn write(l: &Marks, cx: &Ctx, fd: &Fd, off: u64, byte: u8, len: u64) -> FopResult<u64> {
        let data = vec![byte; len as usize];
        l.write(cx, fd, off, IoBufs::owned(vec![data]))
            .await
            .map(|w| w.n as u64)
    }

    async fn session(l: &Marks, cx: &Ctx, begin: u32) {
        let v = HealReq { begin }.to_wire();
        l.setxattr(cx, "f", m::HEAL, &v, 0).await.unwrap();
    }

    async fn info(l: &Marks, cx: &Ctx) -> HealInfo {
        HealInfo::from_wire(&l.getxattr(cx, "f", m::HEAL).await.unwrap()).unwrap()
    }

    fn ranges(info: &HealInfo) -> Vec<(u64, u64)> {
        info.skipped.0.iter().map(|r| (r.offset, r.len)).collect()
    }

    #[test]
    fn heal_writes_skip_what_clients_changed_since_the_session_began() {
        let root = tempfile::tempdir().unwrap();
        let l = stack(root.path());
        let (c, h) = (cx(1), cx(2));
        run(async {
            let flags = (libc::O_CREAT | libc::O_RDWR) as u32;
            let (fd, _) = l.create(&c, "f", flags, 0o644).await.unwrap();
            assert_eq!(write(&l, &c, &fd, 0, b'a', 64 * K).await, Ok(64 * K));
            let hflags = libc::O_WRONLY as u32 | m::HEAL_OPEN;
            let hfd = l.open(&h, "f", hflags).await.unwrap();
            // No session: a heal write has nothing to go by.
            assert_eq!(write(&l, &h, &hfd, 0, b'h', 10).await, Err(ETIMEDOUT));

            session(&l, &h, 1).await;
            let i = info(&l, &h).await;
            assert_eq!((i.live, i.busy), (1, 1), "a client has the file open");
            assert_eq!(write(&l, &c, &fd, 8 * K, b'c', 8 * K).await, Ok(8 * K));
            // The client's newer bytes stay; the reply counts what was written.
            assert_eq!(write(&l, &h, &hfd, 0, b'h', 64 * K).await, Ok(56 * K));
            let got = std::fs::read(root.path().join("f")).unwrap();
            let mut want = vec![b'h'; 64 * K as usize];
            want[8 * K as usize..16 * K as usize].fill(b'c');
            assert!(got == want, "the heal write overwrote the client's bytes");
            assert_eq!(ranges(&info(&l, &h).await), vec![(8 * K, 8 * K)]);
            assert_eq!(
                ranges(&info(&l, &h).await),
                vec![],
                "asking empties the list"
            );
            // The record lasts the whole session.
            assert_eq!(write(&l, &h, &hfd, 4 * K, b'h', 8 * K).await, Ok(4 * K));
            assert_eq!(ranges(&info(&l, &h).await), vec![(8 * K, 4 * K)]);

            // A heal size change that would cut what a client wrote is refused.
            assert_eq!(write(&l, &c, &fd, 100 * K, b'c', 4 * K).await, Ok(4 * K));
            let cut = SetAttrs {
                valid: SETATTR_SIZE,
                size: 64 * K,
                ..Default::default()
            };
            assert_eq!(l.fsetattr(&h, &hfd, &cut).await.err(), Some(EAGAIN));
            assert_eq!(l.fstat(&c, &fd).await.unwrap().size, 104 * K);

            session(&l, &h, 0).await;
            assert_eq!(info(&l, &h).await.live, 0);
            assert_eq!(write(&l, &h, &hfd, 0, b'h', 10).await, Err(ETIMEDOUT));
            // A new session starts with nothing recorded.
            session(&l, &h, 1).await;
            assert_eq!(write(&l, &h, &hfd, 0, b'h', 64 * K).await, Ok(64 * K));
            assert!(l.fsetattr(&h, &hfd, &cut).await.is_ok());
            assert_eq!(l.fstat(&c, &fd).await.unwrap().size, 64 * K);
            session(&l, &h, 0).await;

            l.release(&c, fd).await.unwrap();
            session(&l, &h, 1).await;
            let i = info(&l, &h).await;
            assert_eq!((i.live, i.busy), (1, 0), "no client has the file open");
            session(&l, &h, 0).await;
            l.release(&h, hfd).await.unwrap();
        });
    }

    #[test]
    fn a_change_in_flight_when_the_session_begins_counts() {
        let root = tempfile::tempdir().unwrap();
        let l = stack(root.path());
        run(async {
            let key = l.key("f");
            let id = Marks::enter(&key, 1, 4 * K, 8 * K).await;
            session(&l, &cx(2), 1).await;
            Marks::leave(&key, id);
            let (id, keep) = Marks::enter_heal(&key, 2, 0, 16 * K, false).await.unwrap();
            Marks::leave(&key, id);
            assert_eq!(keep, vec![(0, 4 * K), (8 * K, 8 * K)]);
            let i = info(&l, &cx(2)).await;
            assert_eq!(i.busy, 1);
            assert_eq!(ranges(&i), vec![(4 * K, 4 * K)]);
        });
    }

    #[test]
    fn a_lock_waiting_for_a_write_in_flight_is_woken_when_it_leaves() {
        let root = tempfile::tempdir().unwrap();
        let l = Arc::new(stack(root.path()));
        run(async {
            let key = l.key("f");
            let id = Marks::enter(&key, 1, 0, 4 * K).await;
            let l2 = l.clone();
            let lock = tokio::spawn(async move { l2.lock(2, "f", 0, 8 * K).await });
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            assert!(!lock.is_finished(), "the lock waits for the write");
            let t = Instant::now();
            Marks::leave(&key, id);
            lock.await.unwrap().unwrap();
            // Not the lease (10 s): woken as the write left.
            assert!(t.elapsed() < std::time::Duration::from_secs(2));
        });
    }

    #[test]
    fn a_conditional_clear_is_refused_after_a_new_mark() {
        let root = tempfile::tempdir().unwrap();
        let l = stack(root.path());
        let c = cx(1);
        run(async {
            let set = |name: &'static str, v: Vec<u8>| {
                let l = &l;
                let c = &c;
                async move { l.setxattr(c, "f", name, &v, 0).await }
            };
            let gen = || {
                let p = PendingPage::from_wire(&l.pending_page("f")).unwrap();
                p.targets.0.iter().find(|t| t.target == 1).map(|t| t.gen)
            };
            let mark = |offset, len| {
                Mark {
                    target: 1,
                    offset,
                    len,
                }
                .to_wire()
            };
            let cond = |offset, len, gen| {
                CondMark {
                    target: 1,
                    offset,
                    len,
                    gen,
                }
                .to_wire()
            };
            set(m::ADD, mark(0, 4 * K)).await.unwrap();
            let g1 = gen().unwrap();
            assert!(g1 > 0);
            set(m::ADD, mark(8 * K, 4 * K)).await.unwrap();
            let g2 = gen().unwrap();
            assert_ne!(g1, g2);
            assert_eq!(set(m::CLEAR_IF, cond(0, 4 * K, g1)).await, Err(EAGAIN));
            set(m::CLEAR_IF, cond(0, 4 * K, g2)).await.unwrap();
            let p = PendingPage::from_wire(&l.pending_page("f")).unwrap();
            let r: Vec<_> = p.targets.0[0].ranges.0.iter().map(|r| r.offset).collect();
            assert_eq!(r, vec![8 * K]);
            // Nothing held for a target: a clear against generation 0 is a no-op.
            let none = CondMark {
                target: 2,
                offset: 0,
                len: m::WHOLE,
                gen: 0,
            };
            set(m::CLEAR_IF, none.to_wire()).await.unwrap();
            // Cleared out, the generation is gone; a new mark gets a new one.
            set(m::CLEAR, mark(0, m::WHOLE)).await.unwrap();
            assert_eq!(gen(), None);
            set(m::ADD, mark(0, 4 * K)).await.unwrap();
            assert!(gen().is_some_and(|g| g != g1 && g != g2));
        });
    }

    #[test]
    fn flags_survive_a_restart_and_move_with_a_renamed_directory() {
        let root = tempfile::tempdir().unwrap();
        let flags = |l: &Marks, path: &str| {
            let p = PendingPage::from_wire(&l.pending_page(path)).unwrap();
            p.targets
                .0
                .iter()
                .map(|t| (t.target, t.flags))
                .collect::<Vec<_>>()
        };
        {
            let l = stack(root.path());
            l.apply(&[
                (b'F', "d", 1, u64::from(m::ENTRY), 0),
                (b'F', "d/f", 2, u64::from(m::META), 0),
                (b'A', "d/f", 2, 0, 4 * K),
                (b'F', "dx", 1, u64::from(m::META), 0),
            ])
            .unwrap();
            l.rename_marks("d", "e").unwrap();
            assert_eq!(
                flags(&l, "d"),
                vec![(1, m::ENTRY)],
                "the old name keeps ENTRY"
            );
            assert_eq!(flags(&l, "d/f"), vec![], "META moved");
            assert_eq!(flags(&l, "dx"), vec![(1, m::META)], "not beneath d");
            assert_eq!(flags(&l, "e/f"), vec![(2, m::META)]);
            let gen = PendingPage::from_wire(&l.pending_page("e"))
                .unwrap()
                .targets
                .0[0]
                .gen;
            let no = CondFlag {
                target: 1,
                flags: m::ENTRY,
                gen: gen + 1,
                data: 0,
            };
            let set = |v: Vec<u8>| run(l.setxattr(&cx(1), "e", m::FLAG_CLEAR_IF, &v, 0));
            assert_eq!(set(no.to_wire()), Err(EAGAIN));
            set(CondFlag { gen, ..no }.to_wire()).unwrap();
            assert_eq!(flags(&l, "e"), vec![]);
        }
        let l = stack(root.path());
        assert_eq!(flags(&l, "d"), vec![(1, m::ENTRY)]);
        assert_eq!(flags(&l, "e/f"), vec![(2, m::META)]);
        let idx = IndexPage::from_wire(&l.index_page()).unwrap();
        let e = idx.entries.0.iter().find(|e| e.path == "e/f").unwrap();
        assert_eq!((e.flags, e.bytes), (m::META, 4 * K));
    }

    #[test]
    fn a_pending_page_shares_its_room_and_says_where_it_cut() {
        let root = tempfile::tempdir().unwrap();
        let l = stack(root.path());
        let mut ops = Vec::new();
        for i in 0..5000u64 {
            ops.push((b'A', "f", 0u32, i * 32, 16u64));
        }
        for i in 0..3u64 {
            ops.push((b'A', "f", 1u32, i * 32, 16u64));
        }
        l.apply(&ops).unwrap();
        let p = PendingPage::from_wire(&l.pending_page("f")).unwrap();
        assert!(p.more);
        let (t0, t1) = (&p.targets.0[0], &p.targets.0[1]);
        let n = t0.ranges.0.len() as u64;
        assert!(n > 100 && n < 5000, "{n}");
        assert_eq!(t0.cut, n * 32, "the first range not listed");
        assert_eq!((t1.ranges.0.len(), t1.cut), (3, m::WHOLE));
    }
}
