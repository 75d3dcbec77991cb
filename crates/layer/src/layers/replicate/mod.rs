//! The replicate layer: every file on all subvolumes (replicas), safe first and fast second.
//!
//! - **Changes** (write, truncate, fallocate, discard, create, and namespace changes) go to
//!   every replica in parallel from the caller's memory (no copy: each replica's request holds a
//!   share of the memory's owner, so it stays valid until the last replica is done even if the
//!   caller's future is dropped). A change succeeds when `quorum` replicas (default: a majority)
//!   took it; with fewer it fails, so two halves of a split volume can never both accept writes.
//! - **Misses are marked on the bricks.** When a replica missed a change (it was down, or the
//!   change failed there), the layer records on every replica that took it which range the
//!   other one missed ([`crate::marks`]), *before* acknowledging — an acknowledged write is on a
//!   quorum, and whatever replica lacks it is named on the ones that have it. With every
//!   replica up a change costs nothing extra: no pre-operation, no post-operation.
//! - **Reads** go to one replica that is up and has no marks against it for the file; each
//!   open handle prefers one replica — one on this host when there is one ([`Layer::local`]),
//!   handles taking turns among those (so a sequential stream stays on one brick and many
//!   files spread over the local ones) — and a read that fails on one replica is retried on
//!   the next. A replica that is behind never serves a read: marks are read when the file is opened, and a
//!   miss seen by this client marks the replica bad for the file at once.
//! - **fsync** reaches every replica that holds the file and needs a quorum.
//! - A replica that comes back (its protocol-client reconnects by itself) gets the changes
//!   that follow at once: its handles are reopened on first use. Heal ([`crate::heal`]) copies
//!   what it missed and clears the marks, after which reads use it again; a write it takes
//!   whole makes it current for that range at once ([`current`]).
//! - **Replicas away are waited for, not reported** ([`patience`]): a change short of a
//!   quorum only because replicas could not be reached waits for them (up to the layer's
//!   `timeout`, 30 s) and is sent again to those that missed it; a read with no replica to
//!   serve it waits the same way. When every replica is behind somewhere in a file, a read
//!   goes to one whose marks leave the bytes it reads alone.
//!
//! - **Names and attributes are marked too.** A change of a name (create, mkdir, symlink,
//!   link, unlink, rmdir; a rename's both names) that misses a replica flags the name
//!   [`m::ENTRY`] for it; a change of attributes or xattrs (setattr without a size, setxattr,
//!   removexattr) flags the path [`m::META`]. Heal makes the replica's entry, and then its
//!   attributes, match. A replica flagged `ENTRY` for a name does not serve its reads.
//!
//! - **New bricks** ([`Layer::joining`]: wiped, replaced, no identity yet) take every change
//!   but serve no read, no lookup and no listing, and count toward no quorum, until heal has
//!   rebuilt them ([`heal`]).
//!
//! - **A client that dies mid-change** leaves *suspect* marks ([`m::ANY`]) on the bricks,
//!   which record what its connection changed lately. A file with suspect marks is read from
//!   its suspect source alone ([`m::suspect_source`]), the replica heal makes the others like,
//!   so no read before the heal is contradicted by one after it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

use crate::exec::{join2, join_all};
use crate::marks::{self as m};
use crate::shared::Shared;
use crate::{
    errno, fail, Attr, Ctx, Errno, ExtentList, Fd, FopResult, Fut, IoBufs, Layer, LayerRef,
    LeaseState, ReadDst, ReadOut, ReaddirReply, SetAttrs, StatfsReply, Written,
};
use crate::{fan_out_fops, for_each_fop};
use kiln_proto::sync::MutexExt as _;

mod behind;
mod current;
pub mod heal;
mod images;
pub mod marks;
mod migrate;
mod patience;
mod read;
mod settle;
mod snaps;
mod stamps;
#[cfg(test)]
mod tests;

/// Stale handle: the replica's connection was re-established since the handle was opened.
pub const ESTALE: Errno = 116;
const ENOENT: Errno = errno::ENOENT;
const SETATTR_SIZE: u32 = kiln_proto::ops::SETATTR_SIZE;

/// What this client knows about one file.
#[derive(Default)]
struct FileState {
    /// Replicas (bit i = subvolume i) that are behind for this file.
    bad: AtomicU32,
    /// Replicas that serve no read only because the file is suspect ([`m::ANY`]): all but
    /// its suspect source. Not behind by any mark, so writes ask nothing about them.
    suspect: AtomicU32,
    /// Stamps this client's changes of the file's bytes ([`stamps`]).
    stamps: stamps::Stamper,
}

impl FileState {
    /// Replicas that must not serve a read of the file.
    fn unread(&self) -> u32 {
        self.bad.load(Relaxed) | self.suspect.load(Relaxed)
    }
}

/// A replica's handle for an open file.
enum ChildFd {
    /// Opened.
    Open(Fd),
    /// Not opened yet (the replica was down at open time).
    Absent,
    /// Reopening failed (the file is missing there): changes are marked as missed.
    Missing,
}

/// An open file: a handle per replica.
struct RepFd {
    /// The replica this handle reads from while it is up and current: handles spread over
    /// replicas, a handle sticks to one (a sequential stream stays on one brick).
    prefer: usize,
    path: String,
    flags: u32,
    kids: Vec<Mutex<ChildFd>>,
    state: Arc<FileState>,
}

/// The replicas on which `rfd`'s file is missing (a bit per replica).
fn missing(rfd: &RepFd) -> u32 {
    rfd.kids.iter().enumerate().fold(0, |b, (i, k)| {
        let gone = matches!(*k.locked(), ChildFd::Missing);
        if gone {
            b | bit(i)
        } else {
            b
        }
    })
}

/// The replicate layer.
pub struct Replicate {
    name: String,
    kids: Vec<LayerRef>,
    quorum: usize,
    rr: AtomicUsize,
    files: Mutex<HashMap<String, Weak<FileState>>>,
    /// How long a change waits for a quorum to come back ([`patience`]).
    timeout: std::time::Duration,
}

/// What a replica that missed a change needs healed.
#[derive(Clone, Copy, Default)]
struct Miss<'a> {
    /// Bytes (`None`: nothing data-wise).
    range: Option<(u64, u64)>,
    /// [`m::ENTRY`] / [`m::META`] flags for the path.
    flags: u32,
    /// Another path flagged the same (a rename's new name).
    also: Option<&'a str>,
    /// Replicas (a bit each) whose miss every replica that took the change recorded with
    /// it (a write-marked): not marked again.
    marked: u32,
}

impl Miss<'_> {
    fn bytes(offset: u64, len: u64) -> Miss<'static> {
        Miss {
            range: Some((offset, len)),
            ..Default::default()
        }
    }

    fn flags(flags: u32) -> Miss<'static> {
        Miss {
            flags,
            ..Default::default()
        }
    }

    /// A setattr's: bytes from the new size on, metadata for anything else it sets.
    fn setattr(attrs: &SetAttrs) -> Miss<'static> {
        Miss {
            range: (attrs.valid & SETATTR_SIZE != 0).then_some((attrs.size, m::WHOLE)),
            flags: if attrs.valid & !SETATTR_SIZE != 0 {
                m::META
            } else {
                0
            },
            ..Default::default()
        }
    }
}

fn bit(i: usize) -> u32 {
    1 << i
}

/// The errno a change that lacks a quorum reports: a replica's own error if one said why,
/// else "not connected".
fn quorum_errno(errs: &[Errno]) -> Errno {
    errs.iter()
        .copied()
        .find(|e| *e != errno::ENOTCONN && *e != ESTALE)
        .unwrap_or(errno::ENOTCONN)
}

fn reopen_flags(flags: u32) -> u32 {
    flags & !((libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC) as u32)
}

crate::layer_options! {
    /// The options of a replicate layer: every file on all its subvolumes (client side).
    #[derive(Default)]
    pub struct ReplicateConfig {
        /// Successful replicas a change needs, between 1 and the subvolumes.
        #[option(ty = "integer", default = "majority")]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub quorum: Option<u32>,
        /// Seconds a change waits for a quorum of replicas to come back before it fails.
        #[option(ty = "seconds", default = "30")]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub timeout: Option<u32>,
    }
}

impl Replicate {
    /// A replicate layer over `kids`, configured by `config`.
    pub fn configured(name: &str, kids: Vec<LayerRef>, config: &ReplicateConfig) -> Replicate {
        let timeout = config
            .timeout
            .map(|s| std::time::Duration::from_secs(s.into()));
        Replicate::new(name, kids, config.quorum).with_timeout(timeout)
    }

    /// A replicate layer over `kids`; a change needs `quorum` of them (default: a majority).
    pub fn new(name: &str, kids: Vec<LayerRef>, quorum: Option<u32>) -> Replicate {
        let n = kids.len();
        assert!(n <= 32, "replicate takes at most 32 subvolumes");
        Replicate {
            name: name.into(),
            quorum: quorum.map_or(n / 2 + 1, |q| q as usize).clamp(1, n.max(1)),
            kids,
            rr: AtomicUsize::new(0),
            files: Mutex::default(),
            timeout: patience::DEFAULT_TIMEOUT,
        }
    }

    /// The replicas.
    pub fn replicas(&self) -> &[LayerRef] {
        &self.kids
    }

    /// Successful replicas a change needs.
    pub fn quorum(&self) -> usize {
        self.quorum
    }

    fn state(&self, path: &str) -> Arc<FileState> {
        let mut files = self.files.locked();
        if let Some(s) = files.get(path).and_then(Weak::upgrade) {
            return s;
        }
        if files.len() > 4096 {
            files.retain(|_, w| w.strong_count() > 0);
        }
        let s = Arc::new(FileState::default());
        files.insert(path.to_owned(), Arc::downgrade(&s));
        s
    }

    /// Bit set of replicas that are behind for `path`, known to this client.
    fn known_bad(&self, path: &str) -> u32 {
        let files = self.files.locked();
        files
            .get(path)
            .and_then(Weak::upgrade)
            .map_or(0, |s| s.unread())
    }

    /// Replicas that are new bricks (see [`Layer::joining`]): they take every change but serve
    /// no read and count for no quorum until heal has rebuilt them.
    fn joining_set(&self) -> u32 {
        (0..self.kids.len())
            .filter(|i| self.kids[*i].joining())
            .fold(0, |b, i| b | bit(i))
    }

    /// The replica a new handle reads from first: the replicas on this host that are up
    /// take turns (spreading handles over them); with none, all replicas do.
    fn pick_preferred(&self) -> usize {
        let turn = self.rr.fetch_add(1, Relaxed);
        let local: Vec<usize> = (0..self.kids.len())
            .filter(|i| self.kids[*i].local() && self.kids[*i].up())
            .collect();
        if local.is_empty() {
            turn
        } else {
            local[turn % local.len()]
        }
    }

    /// The order to try replicas in for a read: up, not behind, starting at `start`.
    fn read_order(&self, bad: u32, start: usize) -> Vec<usize> {
        let n = self.kids.len();
        let start = start % n;
        (0..n)
            .map(|k| (start + k) % n)
            .filter(|i| bad & bit(*i) == 0 && self.kids[*i].up() && !self.kids[*i].joining())
            .collect()
    }

    /// A fop on a handle answered by the first replica that may be read (up to date, up,
    /// not joining), in read order; patient while none is up.
    fn on_readable<'a, T: Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        rfd: &'a RepFd,
        f: impl Fn(LayerRef, Fd) -> Fut<'a, T> + Send + Sync + Copy + 'a,
    ) -> Fut<'a, T> {
        Box::pin(self.patiently(move || {
            Box::pin(async move {
                let mut last = errno::ENOTCONN;
                for i in self.read_order(rfd.state.unread(), rfd.prefer) {
                    let op = move |k: &LayerRef, fd: Fd| f(k.clone(), fd);
                    match self.on_child(cx, rfd, i, &op).await {
                        Ok(a) => return Ok(a),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            })
        }))
    }

    fn child_fd(&self, rfd: &RepFd, i: usize) -> Option<Fd> {
        match &*rfd.kids[i].locked() {
            ChildFd::Open(fd) => Some(fd.clone()),
            _ => None,
        }
    }

    /// Reopens a replica's handle (after its connection came back, or it was down at open).
    async fn reopen(&self, cx: &Ctx, rfd: &RepFd, i: usize) -> Option<Fd> {
        if !self.kids[i].up() {
            return None;
        }
        let r = self.kids[i]
            .open(cx, &rfd.path, reopen_flags(rfd.flags))
            .await;
        let mut slot = rfd.kids[i].locked();
        match r {
            Ok(fd) => {
                *slot = ChildFd::Open(fd.clone());
                Some(fd)
            }
            Err(e) => {
                tracing::info!(replica = i, path = rfd.path, "cannot reopen: errno {e}");
                if e == ENOENT {
                    *slot = ChildFd::Missing;
                }
                None
            }
        }
    }

    /// Runs `op` on replica `i`'s handle, reopening it if it is stale or was never opened.
    async fn on_child<'b, T: Send + 'b>(
        &'b self,
        cx: &'b Ctx,
        rfd: &'b RepFd,
        i: usize,
        op: &'b (dyn Fn(&'b LayerRef, Fd) -> Fut<'b, T> + Send + Sync),
    ) -> FopResult<T> {
        let kid = &self.kids[i];
        let fd = match self.child_fd(rfd, i) {
            Some(fd) => fd,
            None => {
                let missing = matches!(&*rfd.kids[i].locked(), ChildFd::Missing);
                if missing {
                    return Err(ENOENT);
                }
                self.reopen(cx, rfd, i).await.ok_or(errno::ENOTCONN)?
            }
        };
        match op(kid, fd).await {
            Err(ESTALE) => {
                let fd = self.reopen(cx, rfd, i).await.ok_or(ESTALE)?;
                op(kid, fd).await
            }
            r => r,
        }
    }

    /// Runs a change on every replica that is up (waiting for a quorum, see [`patience`]);
    /// returns each replica's outcome (`None`: not reached).
    async fn fan_out<'b, T: Send + 'b>(
        &'b self,
        cx: &'b Ctx,
        rfd: &'b RepFd,
        op: &'b (dyn Fn(&'b LayerRef, Fd) -> Fut<'b, T> + Send + Sync),
    ) -> Vec<Option<FopResult<T>>> {
        let run = move |i: usize| Box::pin(self.on_child(cx, rfd, i, op)) as Fut<'b, T>;
        self.on_quorum(&run).await
    }

    /// Opens `path` on every replica that is up; fails only when none opened it.
    async fn open_once(&self, cx: &Ctx, path: &str, flags: u32) -> FopResult<Fd> {
        let up: Vec<usize> = (0..self.kids.len())
            .filter(|i| self.kids[*i].up())
            .collect();
        let opens = (0..self.kids.len())
            .map(|i| up.contains(&i).then(|| self.kids[i].open(cx, path, flags)))
            .collect();
        let (opened, (behind, suspect)) = join2(join_all(opens), self.behind(cx, path, &up)).await;
        let mut bad = behind;
        let mut kids = Vec::with_capacity(self.kids.len());
        let mut any = false;
        let mut err = errno::ENOTCONN;
        for (i, r) in opened.into_iter().enumerate() {
            kids.push(Mutex::new(match r {
                Some(Ok(fd)) => {
                    any = true;
                    ChildFd::Open(fd)
                }
                Some(Err(e)) => {
                    bad |= bit(i);
                    if err == errno::ENOTCONN {
                        err = e;
                    }
                    if e == ENOENT {
                        ChildFd::Missing
                    } else {
                        ChildFd::Absent
                    }
                }
                None => ChildFd::Absent,
            }));
        }
        if !any {
            return Err(err);
        }
        let state = self.state(path);
        state.bad.store(bad, Relaxed);
        state.suspect.store(suspect, Relaxed);
        Ok(Fd::new(RepFd {
            prefer: self.pick_preferred(),
            path: path.to_owned(),
            flags,
            kids,
            state,
        }))
    }

    /// Runs a path fop on every replica that is up and settles it.
    fn change_path<'a, T: Send + 'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        miss: Miss<'a>,
        op: impl Fn(&'a LayerRef) -> Fut<'a, T> + Send + Sync + 'a,
    ) -> Fut<'a, T> {
        Box::pin(async move {
            let run = |i: usize| op(&self.kids[i]);
            let mut res = self.on_quorum(&run).await;
            self.settle(cx, path, None, &outcomes(&res), miss).await?;
            first_ok(&mut res)
        })
    }

    /// Runs a path fop on replicas that are up, in parallel; the first success wins (a
    /// replica that missed a create says ENOENT while others have the file).
    fn query_path<'a, T: Send + 'a>(
        &'a self,
        path: &'a str,
        op: impl Fn(&'a LayerRef) -> Fut<'a, T> + Send + Sync + 'a,
    ) -> Fut<'a, T> {
        Box::pin(async move {
            let op = &op;
            self.patiently(|| {
                let bad = self.known_bad(path);
                let futs = self
                    .kids
                    .iter()
                    .enumerate()
                    .map(|(i, k)| (k.up() && !k.joining() && bad & bit(i) == 0).then(|| op(k)))
                    .collect();
                Box::pin(async move { first_ok(&mut join_all(futs).await) })
            })
            .await
        })
    }
}

/// A create's miss: the whole file, and the name.
fn create_miss() -> Miss<'static> {
    Miss {
        range: Some((0, m::WHOLE)),
        flags: m::ENTRY,
        ..Default::default()
    }
}

/// Each replica's outcome without its value.
fn outcomes<T>(res: &[Option<FopResult<T>>]) -> Vec<Option<FopResult<()>>> {
    res.iter()
        .map(|o| o.as_ref().map(|r| r.as_ref().map(|_| ()).map_err(|e| *e)))
        .collect()
}

fn first_ok<T>(res: &mut [Option<FopResult<T>>]) -> FopResult<T> {
    let mut err = errno::ENOTCONN;
    let mut have_err = false;
    for r in res.iter_mut() {
        match r.take() {
            Some(Ok(v)) => return Ok(v),
            // Prefer a real answer (ENOENT, EEXIST, …) over "not connected".
            Some(Err(e)) if !have_err || err == errno::ENOTCONN => {
                err = e;
                have_err = true;
            }
            Some(Err(_)) => {}
            None => {}
        }
    }
    Err(err)
}

fn rep(fd: &Fd) -> FopResult<&RepFd> {
    fd.get::<RepFd>()
}

/// This layer's handle state, or a fop future that fails with `EBADF`.
macro_rules! try_rep {
    ($fd:expr) => {
        match rep($fd) {
            Ok(r) => r,
            Err(e) => return fail(e),
        }
    };
}

// After the macro its fops use.
mod fops;

impl Layer for Replicate {
    fn pin_local<'a>(&'a self, _: &'a Ctx, _: &'a Fd) -> Fut<'a, std::os::fd::OwnedFd> {
        // A replica that misses a write cannot tell a reader that bypasses the stack: reads
        // of replicated files stay where replicate chooses, and checks, them.
        fail(errno::EOPNOTSUPP)
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn children(&self) -> &[LayerRef] {
        &self.kids
    }

    fn up(&self) -> bool {
        let members = self.kids.iter().filter(|k| k.up() && !k.joining());
        members.count() >= self.quorum
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    for_each_fop!(fan_out_fops);
}
