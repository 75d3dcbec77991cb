//! The marks layer: a brick's records of what other replicas missed, and heal's range locks.
//!
//! The replicate layer (client side) writes marks on the replicas that took a change another
//! replica missed, and reads them to keep a replica that is behind from serving reads; heal
//! reads the index, copies the marked ranges and clears them. All of that travels as
//! typed replication control fops ([`crate::marks`]) which this layer answers itself.
//!
//! Records live in memory and in an append-only log, `.kiln/pending.log` in the brick
//! directory (clients cannot name `.kiln`: the brick refuses the path). The log is written
//! before the control fop is answered (page cache: it survives the brick process dying; an fsync
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
//! Heal sessions (see [`crate::marks`]): on the replica being healed, a heal `begin`s a
//! session on a file; from then until it `end`s (or its lease lapses) every change that another
//! connection makes to the file adds its range to the session's record, at the moment it is
//! let through (under the file's state mutex, with the write registered in flight), and the
//! changes already in flight when the session begins are recorded too. A write through a heal
//! handle (`heal_open`) takes, under the same mutex, only the parts the
//! record does not hold, and registers itself in flight; a client change that overlaps a heal
//! write in flight waits for it (that only happens once heal's lock has lapsed). So on this
//! brick a client change and a heal write to the same bytes are ordered, and whichever order
//! they take, the client's bytes are what stays. Without a session the cost of a write is as
//! above: the session list is looked at only when the lock list or it is non-empty. (Like the
//! locks, sessions are per path: an open with `O_TRUNC`, or a change through another name of
//! the same file, is not seen.)
//!
//! Migration sessions ([`migrate`]): a rebalance moving the file to another subvolume records
//! clients' changes the same way, freezes the file for its cut-over, and marks it moved.
//!
//! The brick's identity (its volume's id and its place there, [`identity`]) lives beside the
//! log in `.kiln/identity`; a brick without one is new until heal has rebuilt it.
//!
//! Marks carry a generation per (file, target) in memory: a fresh number (from a counter that
//! starts at the wall clock, so a restarted brick never reuses one) each time a mark for the
//! target is added. `mark_clear_if` clears only when it is unchanged, which lets heal
//! clear what its writes skipped unless a miss was recorded meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::marks::{self as m, RangeSet};
use crate::{Fd, FopResult, LayerRef};
use kiln_proto::sync::MutexExt as _;
use kiln_proto::Error;

mod control;
mod identity;
mod images;
mod keep;
mod layer;
mod locks;
mod log;
mod migrate;
mod ran;
mod recent;
mod sessions;
mod snaps;
#[cfg(test)]
mod tests;

pub use crate::layers::posix::brick::STATE_DIR;
pub use identity::Identity;
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
    /// A change of a name or of attributes (not of bytes).
    ns: bool,
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
    /// What of the name and its attributes other connections changed since the session
    /// began ([`aspect`] bits): heal's own changes of those are skipped.
    touched: u32,
    /// A migration's session ([`migrate`]): its freeze and mark fail once the name was
    /// touched (`touched` has [`aspect::ENTRY`]).
    migrate: bool,
    /// The migration is cutting over: other connections' fops on the file fail with
    /// `EMOVED` while the session lives.
    frozen: bool,
}

/// What a change of a name or of its attributes touches, as a heal session records it (see
/// [`sessions`]).
pub(super) mod aspect {
    /// The entry itself: made, removed, renamed, linked.
    pub const ENTRY: u32 = 1;
    /// Permissions.
    pub const MODE: u32 = 2;
    /// Owner and group.
    pub const OWNER: u32 = 4;
    /// Access and modification times.
    pub const TIMES: u32 = 8;
    /// Extended attributes (and the distribute layout, one of them).
    pub const XATTR: u32 = 16;
    /// Everything: an entry made anew has new attributes too.
    pub const ALL: u32 = 31;

    /// The aspects a setattr without a size touches.
    pub fn of_setattr(valid: u32) -> u32 {
        use kiln_proto::ops::*;
        let mut a = 0;
        if valid & SETATTR_MODE != 0 {
            a |= MODE;
        }
        if valid & (SETATTR_UID | SETATTR_GID) != 0 {
            a |= OWNER;
        }
        let times = SETATTR_ATIME | SETATTR_MTIME | SETATTR_ATIME_NOW | SETATTR_MTIME_NOW;
        if valid & times != 0 {
            a |= TIMES;
        }
        a
    }
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
    /// What client handles changed lately ([`recent`]).
    recent: Vec<recent::Recent>,
    /// The file's exclusive lease, if one is held ([`images`]).
    lease: Option<images::Lease>,
    /// Dirty records by name: the ranges changed since each started ([`images`]).
    dirty: Vec<(String, RangeSet)>,
    /// A snapshot's write barrier, if one stands ([`snaps`]).
    freeze: Option<snaps::Freeze>,
    /// How long the connection that raised the last barrier may hold writers, however often
    /// it renews it ([`snaps`]).
    hold: Option<snaps::Hold>,
    /// A snapshot being taken: its name, the connection taking it, and the ranges changed
    /// since its first copy.
    delta: Option<(String, u64, RangeSet)>,
    /// The brick is stopping and kept this file's dirty records ([`keep`]): no change of its
    /// bytes may run unrecorded now.
    sealed: bool,
    /// The replicated changes run on the file, by writer ([`ran`]).
    ran: ran::RanLog,
}

#[derive(Default)]
struct FileKey {
    st: Mutex<FileState>,
    changed: tokio::sync::Notify,
    /// Some session froze the file once ([`migrate`]): the state says whether one still
    /// does. Lets a read skip the mutex in the usual case.
    frozen: std::sync::atomic::AtomicBool,
    /// The file moved to another subvolume for good: every handle on it fails with `EMOVED`.
    moved: std::sync::atomic::AtomicBool,
}

impl FileKey {
    fn state(&self) -> MutexGuard<'_, FileState> {
        self.st.locked()
    }
}

/// An open file seen through this layer.
struct MarkFd {
    key: Arc<FileKey>,
    /// This handle, among all of the brick's ([`recent`]).
    id: u64,
    /// The connection that opened it.
    owner: u64,
    inner: Fd,
    /// Opened with `heal_open`: writes are heal's.
    heal: bool,
    /// The path it was opened by (where a write's misses are recorded).
    path: String,
    /// Opened for writing: may take the file's lease, raise a barrier, start dirty records.
    writable: bool,
}

/// The next handle id.
static NEXT_FD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl MarkFd {
    fn new(key: Arc<FileKey>, inner: Fd, heal: bool, path: &str, owner: u64, flags: u32) -> MarkFd {
        if !heal {
            key.state().clients += 1;
        }
        MarkFd {
            key,
            id: NEXT_FD.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            owner,
            inner,
            heal,
            path: path.to_owned(),
            writable: flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32,
        }
    }
}

impl Drop for MarkFd {
    fn drop(&mut self) {
        if !self.heal {
            let mut st = self.key.state();
            st.clients = st.clients.saturating_sub(1);
            // Released, or its connection's leftovers were taken already.
            st.recent.retain(|r| r.fd != self.id);
        }
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
    /// Who this brick must be ([`identity`]); `None`: a brick outside any managed volume.
    identity: Option<Identity>,
    /// No identity yet: the brick is new to its volume.
    joining: std::sync::atomic::AtomicBool,
    /// Names each client connection changed lately ([`recent`]).
    names: Mutex<HashMap<u64, recent::Names>>,
    /// Names whose files moved to another subvolume lately ([`migrate`]).
    moved: migrate::MovedNames,
}

fn unwrap(fd: &Fd) -> FopResult<&MarkFd> {
    fd.get::<MarkFd>()
}

crate::layer_options! {
    /// The options of a marks layer: per-file records of what other replicas missed, and
    /// range locks for heal (brick side).
    pub struct MarksConfig {
        /// The brick directory (its `.kiln` holds the records).
        #[option(ty = "path", default = "required")]
        pub directory: PathBuf,
        /// Who the brick is: its volume's id and its index there (`.kiln/identity`); a
        /// directory without one is a new brick, rebuilt by heal before it is read from.
        #[option(ty = "{ volume_id, brick }", default = "none (a brick outside any volume)")]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub identity: Option<Identity>,
        /// The volume's first start: a directory without an identity takes it at once.
        #[option(ty = "bool", default = "false")]
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub adopt: bool,
    }
}

impl MarksConfig {
    /// Marks kept in `directory`, no identity.
    pub fn at(directory: impl Into<PathBuf>) -> MarksConfig {
        MarksConfig {
            directory: directory.into(),
            identity: None,
            adopt: false,
        }
    }
}

impl Marks {
    /// The marks layer named `name` over `child`, configured by `config`.
    pub fn configured(name: &str, child: LayerRef, config: &MarksConfig) -> Result<Marks, Error> {
        let dir = &config.directory;
        let m = Marks::new(name, child, dir).map_err(|e| {
            Error::io(
                format_args!("cannot load pending marks of {}", dir.display()),
                &e,
            )
        })?;
        match &config.identity {
            Some(id) => m
                .with_identity(id.clone(), config.adopt)
                .map_err(|e| Error::io("the brick's identity", &e)),
            None => Ok(m),
        }
    }

    /// Checks the brick directory against `id` (see [`identity`]): a directory of another
    /// volume or place is an error; one without an identity is new, unless `adopt` (the
    /// volume's first start) makes it take `id` now.
    pub fn with_identity(mut self, id: Identity, adopt: bool) -> std::io::Result<Marks> {
        let new = identity::check(&self.dir, &self.root, &id, adopt)?;
        self.joining = new.into();
        self.identity = Some(id);
        Ok(self)
    }

    /// MEMBER: asks, or makes the brick a member (heal rebuilt it), or new again.
    fn membership(&self, op: u32) -> FopResult<m::MemberState> {
        use std::sync::atomic::Ordering::SeqCst;
        let joining = |j: bool| m::MemberState {
            joining: u32::from(j),
        };
        let Some(id) = &self.identity else {
            // Not part of a managed volume: always a member, nothing to record.
            return Ok(joining(false));
        };
        let done = match op {
            m::MEMBER_ASK => return Ok(joining(self.joining.load(SeqCst))),
            m::MEMBER_JOIN => identity::write(&self.root, id).map(|()| false),
            m::MEMBER_LEAVE => identity::remove(&self.root).map(|()| true),
            _ => return Err(crate::errno::EINVAL),
        };
        match done {
            Ok(j) => {
                if self.joining.swap(j, SeqCst) != j {
                    tracing::info!(
                        "{}: {}",
                        self.dir.display(),
                        if j {
                            "left its volume: new again, until heal rebuilds it"
                        } else {
                            "rebuilt: a member of its volume again"
                        }
                    );
                }
                Ok(joining(j))
            }
            Err(e) => {
                tracing::error!(
                    "{}: cannot record the brick identity: {e}",
                    self.dir.display()
                );
                Err(crate::errno::EIO)
            }
        }
    }

    fn child(&self) -> &LayerRef {
        &self.kids[0]
    }

    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.locked()
    }

    fn key(&self, path: &str) -> Arc<FileKey> {
        let mut files = self.files.locked();
        files.entry(path.to_owned()).or_default().clone()
    }

    /// Forgets a file's lock state when nobody holds it.
    fn forget(&self, path: &str, key: &Arc<FileKey>) {
        let mut files = self.files.locked();
        // Ours, the map's: nobody else.
        if Arc::strong_count(key) <= 2
            && {
                let mut st = key.state();
                let now = Instant::now();
                st.sessions.retain(|s| s.expires > now);
                st.locks.is_empty()
                    && st.sessions.is_empty()
                    && st.lease.is_none()
                    && st.dirty.is_empty()
                    && st.freeze.is_none()
                    && st.delta.is_none()
            }
            && files.get(path).is_some_and(|k| Arc::ptr_eq(k, key))
        {
            files.remove(path);
        }
    }
}
