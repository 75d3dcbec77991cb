//! The distribute layer: one namespace over several subvolumes, each file on one of them.
//!
//! # Placement
//!
//! A file lives on the subvolume that owns the hash of its final name component in its parent
//! directory's *layout*. The hash is [`name_hash`]: 32-bit FNV-1a over the name's bytes followed
//! by the murmur3 finaliser, so that names differing only in their last characters still spread
//! over the whole range. It is part of the on-disk format and must never change.
//!
//! A layout ([`Layout`]) splits the 32-bit hash space into contiguous ranges, each owned by one
//! subvolume (by its index in the graph). The layout is the volume's, not each directory's: the
//! hash space in equal ranges over the subvolumes that take new files — all of them but those
//! the graph marks as draining (bricks on their way out). It is therefore versioned with the
//! graph: a graph with more subvolumes (bricks added) or some draining is a new layout for every
//! directory at once, with no walk over them, and a client learns it when it switches to that
//! graph ([`crate::volfile`]; a client following a managed volume polls for new versions). A
//! client still on the older graph places new files by the older layout; they are found all the
//! same (below), where they are; moving them where the current layout wants them is a
//! rebalance's work ([`migrate`]). (Directories made by earlier versions carry their layout
//! as the xattr [`LAYOUT_XATTR`]; it was always the equal split, and is no longer read or
//! written.)
//!
//! # Directories
//!
//! Directories exist on every subvolume. mkdir makes the directory on its hashed subvolume first
//! — so two racing mkdirs meet there and one gets `EEXIST` — then on the others; if one of those
//! fails (other than an existing directory left by an earlier partial mkdir) the copies just made
//! are removed and the error returned. rmdir removes the other copies first and the hashed one
//! last; when one fails (`ENOTEMPTY` because files of the directory sit on that subvolume) the
//! copies already removed are made again. rename of a directory renames every copy, undoing the
//! ones done if one fails. setattr and xattr changes on a directory go to every copy; reads of it
//! (lookup, getxattr) come from its hashed subvolume.
//!
//! A subvolume added to the volume starts with no directories. They are made there as they are
//! needed — when a name is to be created on it in a directory it lacks, that directory and any
//! missing ancestors are made with the mode and owner of their copy on another subvolume — so a
//! new brick takes files at once, without a walk of the tree first. A listing skips a subvolume
//! that lacks the directory.
//!
//! # Files
//!
//! Fops by path go to the hashed subvolume; if it says `ENOENT`, every other subvolume is asked
//! at once and whichever holds the name answers. That is what finds files placed under another
//! layout and files renamed across subvolumes. Before create, symlink and link, the other
//! subvolumes are asked whether the name exists there, so a name never lives on two
//! subvolumes (create of a name held elsewhere opens it there, or fails with `EEXIST` for
//! `O_EXCL`). This costs one parallel round of lookups per create; a directory flag meaning
//! "every file sits where its hash says" (set at mkdir, cleared by a cross-subvolume rename,
//! restored by rebalance) would let both lookup misses and creates skip it — not built yet.
//!
//! rename of a file renames it on the subvolume that holds it, whatever the new name hashes to:
//! no data moves, and the lookup fallback finds it under the new name. If the destination name
//! existed on another subvolume, that file is unlinked after the rename (rename replaces it);
//! there is a short window in which both are visible. `RENAME_EXCHANGE` of names on different
//! subvolumes fails with `EXDEV`. link makes the new name on the subvolume of the existing file.
//!
//! An open file's handle wraps (subvolume index, the subvolume's handle); fops on handles go
//! straight to that subvolume with nothing allocated on the way.
//!
//! # Listing
//!
//! readdir merges the subvolumes: first everything subvolume 0 lists, then each later
//! subvolume's entries that are not directories (directories, present everywhere, are listed
//! once, from subvolume 0). The `offset` is, as for a single brick, the index into that merged
//! listing (callers page with "entries seen so far"; the reply carries no cookie). To keep
//! paging linear, each page leaves a cursor (directory, merged index) → (subvolume, the
//! subvolume's own offset) in a small cache; a request whose offset has a cursor resumes there.
//! One without (evicted, or a seek) walks the listing from the start to find its position:
//! correct, only slower. As on one brick, entries added or removed while paging may be missed or
//! seen twice.
//!
//! statfs sums blocks, free blocks and inodes over the subvolumes (in the first one's fragment
//! size); it fails if any subvolume fails, rather than report a smaller volume.
//!
//! # Adding and removing bricks
//!
//! Subvolume indexes are positions in the graph, so bricks are added by appending subvolumes:
//! the layout gives them their share at once (above). Files whose hash now falls elsewhere stay
//! where they are, found through the lookup fallback, until a rebalance moves them
//! ([`migrate`]: open files keep working as they move). A subvolume the graph marks draining
//! takes no new files (the first step of removing bricks), and a rebalance moves everything on
//! it to the others. Names beginning with [`MOVING_PREFIX`] are a rebalance's copies in
//! progress and are never listed.
//!
//! Errors are errno values; no input makes this layer panic.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use crate::marks as m;
use crate::{fan_out_fops, for_each_fop};
use crate::{
    Attr, Ctx, Errno, ExtentList, Fd, FopResult, Fut, IoBufs, Layer, LayerRef, LeaseState, Opened,
    ReadDst, ReadOut, ReaddirReply, SetAttrs, StatfsReply, Written,
};

mod dirs;
mod layout;
mod migrate;
mod readdir;
#[cfg(test)]
mod tests;

pub use layout::{name_hash, Layout, Range};
pub use migrate::{find, Misplaced, Progress, MOVING_PREFIX};

/// The xattr holding a directory's layout, on each subvolume's copy of the directory.
pub const LAYOUT_XATTR: &str = "trusted.kiln.layout";

const ENOENT: Errno = libc::ENOENT as Errno;
const EEXIST: Errno = libc::EEXIST as Errno;
const EPERM: Errno = libc::EPERM as Errno;
const EISDIR: Errno = libc::EISDIR as Errno;
const EXDEV: Errno = libc::EXDEV as Errno;
const EBADF: Errno = libc::EBADF as Errno;
const EBUSY: Errno = libc::EBUSY as Errno;
const ENOTCONN: Errno = libc::ENOTCONN as Errno;

const O_CREAT: u32 = libc::O_CREAT as u32;
const O_EXCL: u32 = libc::O_EXCL as u32;
const RENAME_NOREPLACE: u32 = libc::RENAME_NOREPLACE;
const RENAME_EXCHANGE: u32 = libc::RENAME_EXCHANGE;

/// readdir cursors kept at most (oldest dropped first).
const CURSORS_MAX: usize = 1024;
/// Entries per child readdir when seeking to an offset without a cursor.
const SEEK_PAGE: u32 = 256;

/// An open file: which subvolume, and its handle there.
struct DistFd {
    kid: usize,
    fd: Fd,
}

/// Where a merged listing continues: a subvolume and its own readdir offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    sub: usize,
    off: u64,
}

#[derive(Default)]
struct Cursors {
    map: HashMap<(String, u64), Cursor>,
    order: VecDeque<(String, u64)>,
}

/// Spreads files over its subvolumes by a hash of the name (see the module documentation).
pub struct Distribute {
    name: String,
    kids: Vec<LayerRef>,
    layout: Layout,
    placement: Arc<dyn Placement>,
    cursors: Mutex<Cursors>,
}

/// Where distribute puts a name, beyond the hash of its final component: the seam through
/// which a layer that names its own files in a way that matters for placement says so
/// (shard's `Pieces` stripe a file's pieces over the subvolumes). Chosen when the graph is
/// built.
pub trait Placement: Send + Sync + 'static {
    /// The subvolume for `path` under `layout`, or None for the default: by the hash of the
    /// final component.
    fn place(&self, path: &str, layout: &Layout) -> Option<usize>;
}

/// Every name by the hash of its final component.
pub struct ByName;

impl Placement for ByName {
    fn place(&self, _: &str, _: &Layout) -> Option<usize> {
        None
    }
}

fn is_dir(a: &Attr) -> bool {
    a.mode & libc::S_IFMT == libc::S_IFDIR
}

/// Parent directory and final component of a path (`""` is the root).
fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

/// Runs all `futs` at once; results in the same order.
async fn join_all<'a, T: Send + 'a>(futs: Vec<Fut<'a, T>>) -> Vec<FopResult<T>> {
    let mut futs: Vec<Option<Fut<'a, T>>> = futs.into_iter().map(Some).collect();
    let mut out: Vec<Option<FopResult<T>>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(move |cx| {
        let mut pending = false;
        for (slot, o) in futs.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot {
                match Pin::as_mut(f).poll(cx) {
                    Poll::Ready(r) => {
                        *o = Some(r);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(
                out.iter_mut()
                    .map(|o| o.take().unwrap_or(Err(libc::EIO as Errno)))
                    .collect(),
            )
        }
    })
    .await
}

/// The first error that is not `ENOENT` among `results`, if any.
fn first_real_error<T>(results: &[FopResult<T>]) -> Option<Errno> {
    results.iter().find_map(|r| match r {
        Err(e) if *e != ENOENT => Some(*e),
        _ => None,
    })
}

crate::layer_options! {
    /// The options of a distribute layer: files spread over its subvolumes by a hash of the
    /// name (client side).
    pub struct DistributeConfig {
        /// Subvolumes (by name) that take no new files: sets being drained before their
        /// removal. Their files are still found, and moved off by a rebalance.
        #[option(ty = "list of subvolume names", default = "[]")]
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub draining: Vec<String>,
    }
}

impl Distribute {
    /// A distribute layer over `kids` (named `names`, in order), configured by `config`.
    pub fn configured(
        name: &str,
        kids: Vec<LayerRef>,
        names: &[String],
        config: &DistributeConfig,
    ) -> Distribute {
        let out: Vec<usize> = names
            .iter()
            .enumerate()
            .filter(|(_, n)| config.draining.contains(n))
            .map(|(i, _)| i)
            .collect();
        Distribute::draining(name, kids, &out)
    }

    /// A distribute layer over `kids`.
    pub fn new(name: &str, kids: Vec<LayerRef>) -> Distribute {
        Distribute::draining(name, kids, &[])
    }

    /// A distribute layer over `kids`, of which those at the indexes in `draining` take no new
    /// files (unless every subvolume is draining: then all take them, as nowhere else can).
    pub fn draining(name: &str, kids: Vec<LayerRef>, draining: &[usize]) -> Distribute {
        let mut active: Vec<usize> = (0..kids.len()).filter(|i| !draining.contains(i)).collect();
        if active.is_empty() {
            active = (0..kids.len()).collect();
        }
        Distribute {
            name: name.into(),
            kids,
            layout: Layout::over(&active),
            placement: Arc::new(ByName),
            cursors: Mutex::new(Cursors::default()),
        }
    }

    /// This layer, placing names as `placement` says.
    pub fn with_placement(mut self, placement: Arc<dyn Placement>) -> Distribute {
        self.placement = placement;
        self
    }

    /// The volume's layout (the same for every directory: see the module documentation).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Runs `f` on subvolume `i`, or fails with `ENOTCONN` if there is none.
    fn with<'b, T: Send + 'b>(
        &'b self,
        i: usize,
        f: impl FnOnce(&'b LayerRef) -> Fut<'b, T>,
    ) -> Fut<'b, T> {
        match self.kids.get(i) {
            Some(k) => f(k),
            None => crate::fail(ENOTCONN),
        }
    }

    /// Runs `f` on every subvolume but `skip` at once; results with their indexes.
    async fn on_others<'b, T: Send + 'b>(
        &'b self,
        skip: Option<usize>,
        f: impl Fn(&'b LayerRef) -> Fut<'b, T>,
    ) -> Vec<(usize, FopResult<T>)> {
        let idx: Vec<usize> = (0..self.kids.len()).filter(|&i| Some(i) != skip).collect();
        let futs = idx.iter().map(|&i| f(&self.kids[i])).collect();
        idx.into_iter().zip(join_all(futs).await).collect()
    }

    /// Drops the readdir cursors of `dir` and everything beneath it.
    fn forget(&self, dir: &str) {
        let under = |p: &str| {
            p == dir
                || (p.len() > dir.len() && p.starts_with(dir) && p.as_bytes()[dir.len()] == b'/')
        };
        if let Ok(mut c) = self.cursors.lock() {
            c.map.retain(|(p, _), _| !under(p));
            let Cursors { map, order } = &mut *c;
            order.retain(|k| map.contains_key(k));
        }
    }

    /// The subvolume `path` belongs on (0 for the root): where the placement puts it, else
    /// where its final component hashes to.
    fn hashed(&self, path: &str) -> FopResult<usize> {
        match self.kids.len() {
            0 => Err(ENOTCONN),
            1 => Ok(0),
            _ if path.is_empty() => Ok(0),
            n => Ok(self
                .placement
                .place(path, &self.layout)
                .unwrap_or_else(|| self.layout.subvol(name_hash(split(path).1)))
                .min(n - 1)),
        }
    }

    /// Looks `path` up on every subvolume but `skip`: the first that has it, else the first
    /// error other than `ENOENT`, else `ENOENT`.
    async fn find_elsewhere(&self, cx: &Ctx, path: &str, skip: usize) -> FopResult<(usize, Attr)> {
        let rs = self.on_others(Some(skip), |k| k.lookup(cx, path)).await;
        let mut err = ENOENT;
        for (i, r) in rs {
            match r {
                Ok(a) => return Ok((i, a)),
                Err(e) if e != ENOENT && err == ENOENT => err = e,
                Err(_) => {}
            }
        }
        Err(err)
    }

    /// The subvolume that holds `path` and its attributes there.
    async fn locate(&self, cx: &Ctx, path: &str) -> FopResult<(usize, Attr)> {
        let h = self.hashed(path)?;
        match self.with(h, |k| k.lookup(cx, path)).await {
            Ok(a) => Ok((h, a)),
            Err(e) if e == ENOENT || path.is_empty() => self
                .find_elsewhere(cx, path, h)
                .await
                .map_err(|e2| if path.is_empty() { e } else { e2 }),
            Err(e) => Err(e),
        }
    }

    /// Runs `f` on the hashed subvolume of `path`, and if that says `ENOENT`, on the one that
    /// holds it. Returns which subvolume answered.
    async fn on_file<'b, T: Send + 'b>(
        &'b self,
        cx: &'b Ctx,
        path: &'b str,
        f: impl Fn(&'b LayerRef) -> Fut<'b, T>,
    ) -> FopResult<(usize, T)> {
        let h = self.hashed(path)?;
        match self.with(h, &f).await {
            Err(ENOENT) if self.kids.len() > 1 => {
                let (j, _) = self.find_elsewhere(cx, path, h).await?;
                self.with(j, &f).await.map(|v| (j, v))
            }
            r => r.map(|v| (h, v)),
        }
    }

    /// Fails with `EEXIST` if `path` exists on a subvolume other than `skip`.
    async fn absent_elsewhere(&self, cx: &Ctx, path: &str, skip: usize) -> FopResult<()> {
        if self.kids.len() < 2 {
            return Ok(());
        }
        match self.find_elsewhere(cx, path, skip).await {
            Ok(_) => Err(EEXIST),
            Err(ENOENT) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn do_open(&self, cx: &Ctx, path: &str, flags: u32) -> FopResult<Fd> {
        let (i, fd) = if flags & O_CREAT != 0 {
            // Open where the name already is; create only on its hashed subvolume.
            let i = match self.locate(cx, path).await {
                Ok((i, _)) => i,
                Err(ENOENT) => self.hashed(path)?,
                Err(e) => return Err(e),
            };
            (i, self.making(i, path, |k| k.open(cx, path, flags)).await?)
        } else {
            self.on_file(cx, path, |k| k.open(cx, path, flags)).await?
        };
        Ok(Fd::new(DistFd { kid: i, fd }))
    }

    async fn do_create(
        &self,
        cx: &Ctx,
        path: &str,
        flags: u32,
        mode: u32,
    ) -> FopResult<(Fd, Attr)> {
        let h = self.hashed(path)?;
        if self.kids.len() > 1 && !path.is_empty() {
            match self.find_elsewhere(cx, path, h).await {
                Ok((j, _)) => {
                    if flags & O_EXCL != 0 {
                        return Err(EEXIST);
                    }
                    let fd = self
                        .with(j, |k| k.open(cx, path, flags & !(O_CREAT | O_EXCL)))
                        .await?;
                    let attr = match self.with(j, |k| k.fstat(cx, &fd)).await {
                        Ok(a) => a,
                        Err(e) => {
                            let _ = self.with(j, |k| k.release(cx, fd)).await;
                            return Err(e);
                        }
                    };
                    return Ok((Fd::new(DistFd { kid: j, fd }), attr));
                }
                Err(ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
        let (fd, attr) = self
            .making(h, path, |k| k.create(cx, path, flags, mode))
            .await?;
        Ok((Fd::new(DistFd { kid: h, fd }), attr))
    }

    async fn do_setattr(&self, cx: &Ctx, path: &str, attrs: &SetAttrs) -> FopResult<Attr> {
        let (i, a) = self
            .on_file(cx, path, |k| k.setattr(cx, path, attrs))
            .await?;
        if is_dir(&a) {
            let rs: Vec<_> = self
                .on_others(Some(i), |k| k.setattr(cx, path, attrs))
                .await
                .into_iter()
                .map(|(_, r)| r)
                .collect();
            if let Some(e) = first_real_error(&rs) {
                return Err(e);
            }
        }
        Ok(a)
    }

    async fn do_xattr_change<'b>(
        &'b self,
        cx: &'b Ctx,
        path: &'b str,
        name: &str,
        f: impl Fn(&'b LayerRef) -> Fut<'b, ()>,
    ) -> FopResult<()> {
        if let Some(e) = crate::reserved_xattr(name) {
            return Err(e);
        }
        let (i, a) = self.locate(cx, path).await?;
        if is_dir(&a) {
            self.dir_everywhere(i, f).await
        } else {
            self.with(i, f).await
        }
    }

    async fn do_link(&self, cx: &Ctx, existing: &str, path: &str) -> FopResult<Attr> {
        let (h, a) = self.locate(cx, existing).await?;
        if is_dir(&a) {
            return Err(EPERM);
        }
        if self.kids.len() > 1 {
            match self.locate(cx, path).await {
                Ok(_) => return Err(EEXIST),
                Err(ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
        self.making(h, path, |k| k.link(cx, existing, path)).await
    }

    async fn do_symlink(&self, cx: &Ctx, target: &str, path: &str) -> FopResult<Attr> {
        let h = self.hashed(path)?;
        self.absent_elsewhere(cx, path, h).await?;
        self.making(h, path, |k| k.symlink(cx, target, path)).await
    }

    async fn do_mknod(&self, cx: &Ctx, path: &str, mode: u32, rdev: u64) -> FopResult<Attr> {
        let h = self.hashed(path)?;
        self.absent_elsewhere(cx, path, h).await?;
        self.making(h, path, |k| k.mknod(cx, path, mode, rdev))
            .await
    }

    async fn do_statfs(&self, cx: &Ctx, path: &str) -> FopResult<StatfsReply> {
        let rs = self.on_others(None, |k| k.statfs(cx, path)).await;
        let mut sum: Option<StatfsReply> = None;
        for (_, r) in rs {
            let s = r?;
            match &mut sum {
                None => sum = Some(s),
                Some(t) => {
                    // Blocks are counted in fragments; bring each brick's to the first's size.
                    let scale = |v: u64| -> u64 {
                        if t.frsize == 0 || s.frsize == t.frsize {
                            v
                        } else {
                            let x = u128::from(v) * u128::from(s.frsize) / u128::from(t.frsize);
                            u64::try_from(x).unwrap_or(u64::MAX)
                        }
                    };
                    t.blocks = t.blocks.saturating_add(scale(s.blocks));
                    t.bfree = t.bfree.saturating_add(scale(s.bfree));
                    t.bavail = t.bavail.saturating_add(scale(s.bavail));
                    t.files = t.files.saturating_add(s.files);
                    t.ffree = t.ffree.saturating_add(s.ffree);
                    t.namemax = t.namemax.min(s.namemax);
                }
            }
        }
        sum.ok_or(ENOTCONN)
    }

    /// The subvolume and its handle behind one of this layer's handles.
    fn fd_kid<'b>(&'b self, fd: &'b Fd) -> FopResult<(&'b LayerRef, &'b Fd)> {
        let d = fd.get::<DistFd>()?;
        let k = self.kids.get(d.kid).ok_or(EBADF)?;
        Ok((k, &d.fd))
    }
}

/// Layer methods for fops on an open file, each sent to the subvolume that holds it.
macro_rules! on_file_kid {
    ($( $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty; )*) => {$(
        fn $name<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, $($arg: $ty),*) -> Fut<'a, $ret> {
            match self.fd_kid(fd) {
                Ok((k, fd)) => k.$name(cx, fd, $($arg),*),
                Err(e) => crate::fail(e),
            }
        }
    )*};
}

impl Layer for Distribute {
    fn name(&self) -> &str {
        &self.name
    }

    fn pin_local<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, std::os::fd::OwnedFd> {
        match self.fd_kid(fd) {
            Ok((k, f)) => k.pin_local(cx, f),
            Err(e) => crate::fail(e),
        }
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn children(&self) -> &[LayerRef] {
        &self.kids
    }

    fn open_small<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        flags: u32,
        max: u32,
    ) -> Fut<'a, Opened> {
        if flags & O_CREAT != 0 {
            return Box::pin(async move { self.do_open(cx, path, flags).await.map(Opened::Fd) });
        }
        Box::pin(async move {
            let (kid, o) = self
                .on_file(cx, path, |k| k.open_small(cx, path, flags, max))
                .await?;
            Ok(o.map_fd(|fd| Fd::new(DistFd { kid, fd })))
        })
    }

    for_each_fop!(fan_out_fops);
}

// Every fop, each said where it goes (see `FanOut`): a new fop does not compile until it is.
impl crate::FanOut for Distribute {
    fn lookup<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Attr> {
        Box::pin(async move { self.locate(cx, path).await.map(|(_, a)| a) })
    }

    fn fstat<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, Attr> {
        match self.fd_kid(fd) {
            Ok((k, fd)) => k.fstat(cx, fd),
            Err(e) => crate::fail(e),
        }
    }

    fn setattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        Box::pin(self.do_setattr(cx, path, attrs))
    }

    fn fsetattr<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        match self.fd_kid(fd) {
            Ok((k, fd)) => k.fsetattr(cx, fd, attrs),
            Err(e) => crate::fail(e),
        }
    }

    fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(self.do_open(cx, path, flags))
    }

    fn create<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        flags: u32,
        mode: u32,
    ) -> Fut<'a, (Fd, Attr)> {
        Box::pin(self.do_create(cx, path, flags, mode))
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        match self.fd_kid(fd) {
            Ok((k, fd)) => k.read(cx, fd, offset, dst),
            Err(e) => crate::fail(e),
        }
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        match self.fd_kid(fd) {
            Ok((k, fd)) => k.write(cx, fd, offset, data),
            Err(e) => crate::fail(e),
        }
    }

    fn fsync<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, datasync: bool) -> Fut<'a, ()> {
        match self.fd_kid(fd) {
            Ok((k, fd)) => k.fsync(cx, fd, datasync),
            Err(e) => crate::fail(e),
        }
    }

    fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        let (i, child) = match fd.get::<DistFd>() {
            Ok(d) => (d.kid, d.fd.clone()),
            Err(e) => return crate::fail(e),
        };
        drop(fd);
        self.with(i, |k| k.release(cx, child))
    }

    fn unlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        Box::pin(async move {
            self.on_file(cx, path, |k| k.unlink(cx, path))
                .await
                .map(|_| ())
        })
    }

    fn mkdir<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32) -> Fut<'a, Attr> {
        Box::pin(self.do_mkdir(cx, path, mode))
    }

    fn rmdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        Box::pin(self.do_rmdir(cx, path))
    }

    fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
        Box::pin(self.do_rename(cx, from, to, flags))
    }

    fn readdir<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        offset: u64,
        max: u32,
    ) -> Fut<'a, ReaddirReply> {
        Box::pin(self.readdir_merged(cx, path, offset, max))
    }

    fn symlink<'a>(&'a self, cx: &'a Ctx, target: &'a str, path: &'a str) -> Fut<'a, Attr> {
        Box::pin(self.do_symlink(cx, target, path))
    }

    fn mknod<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32, rdev: u64) -> Fut<'a, Attr> {
        Box::pin(self.do_mknod(cx, path, mode, rdev))
    }

    fn readlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, String> {
        Box::pin(async move {
            self.on_file(cx, path, |k| k.readlink(cx, path))
                .await
                .map(|(_, v)| v)
        })
    }

    fn link<'a>(&'a self, cx: &'a Ctx, existing: &'a str, path: &'a str) -> Fut<'a, Attr> {
        Box::pin(self.do_link(cx, existing, path))
    }

    fn syncdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        // Every child that has the directory makes its entries durable. A child without it
        // (one added since, which gets directories as names are made in them) has nothing to
        // sync; ENOENT only when none has it, and any other error is the answer.
        Box::pin(async move {
            let rs: Vec<_> = self.on_others(None, |k| k.syncdir(cx, path)).await;
            let rs: Vec<FopResult<()>> = rs.into_iter().map(|(_, r)| r).collect();
            match first_real_error(&rs) {
                Some(e) => Err(e),
                None if rs.iter().any(|r| r.is_ok()) => Ok(()),
                None => Err(ENOENT),
            }
        })
    }

    fn statfs<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, StatfsReply> {
        Box::pin(self.do_statfs(cx, path))
    }

    fn getxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, Vec<u8>> {
        Box::pin(async move {
            self.on_file(cx, path, |k| k.getxattr(cx, path, name))
                .await
                .map(|(_, v)| v)
        })
    }

    fn setxattr<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        name: &'a str,
        value: &'a [u8],
        flags: u32,
    ) -> Fut<'a, ()> {
        Box::pin(self.do_xattr_change(cx, path, name, move |k| {
            k.setxattr(cx, path, name, value, flags)
        }))
    }

    fn listxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Vec<String>> {
        Box::pin(async move {
            self.on_file(cx, path, |k| k.listxattr(cx, path))
                .await
                .map(|(_, v)| v)
        })
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, ()> {
        Box::pin(self.do_xattr_change(cx, path, name, move |k| k.removexattr(cx, path, name)))
    }

    // Fops on one open file go to the subvolume that holds it. (A snapshot's clone lands
    // beside it, on the image's subvolume: lookups find it there.)
    on_file_kid! {
        fallocate(mode: u32, offset: u64, len: u64) -> ();
        discard(offset: u64, len: u64) -> ();
        extents(at: u64, len: u64) -> ExtentList;
        lease(cmd: u32, ttl_ms: u32, holder: &'a str) -> LeaseState;
        snap(cmd: u32, name: &'a str, to: &'a str, ttl_ms: u32) -> crate::SnapReply;
        dirty(cmd: u32, name: &'a str, at: u64, len: u64) -> ExtentList;
        write_marked(offset: u64, data: IoBufs, missed: u32) -> Written;
    }

    // Addressed to one brick or replica set (heal, replication control, the layout a
    // child keeps): migration and the layout code send these to the child they mean,
    // so through distribute as a whole they are refused.
    fn heal_open<'a>(&'a self, _: &'a Ctx, _: &'a str, _: u32) -> Fut<'a, Fd> {
        crate::refused()
    }

    fn heal_session<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::HealReq) -> Fut<'a, ()> {
        crate::refused()
    }

    fn heal_info<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a ()) -> Fut<'a, m::HealInfo> {
        crate::refused()
    }

    fn layout_get<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a ()) -> Fut<'a, Vec<u8>> {
        crate::refused()
    }

    fn layout_set<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a Vec<u8>) -> Fut<'a, ()> {
        crate::refused()
    }

    fn mark_add<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::Mark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn mark_clear<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::Mark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn mark_clear_if<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::CondMark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn flag_add<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::FlagMark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn flag_clear_if<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::CondFlag) -> Fut<'a, ()> {
        crate::refused()
    }

    fn heal_lock<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::LockReq) -> Fut<'a, ()> {
        crate::refused()
    }

    fn pending<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a ()) -> Fut<'a, m::PendingPage> {
        crate::refused()
    }

    fn pending_index<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a ()) -> Fut<'a, m::IndexPage> {
        crate::refused()
    }

    fn member<'a>(
        &'a self,
        _: &'a Ctx,
        _: &'a str,
        _: &'a m::MemberReq,
    ) -> Fut<'a, m::MemberState> {
        crate::refused()
    }
}
