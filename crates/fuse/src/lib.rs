//! `kiln mount`: a Kiln volume as a FUSE file system.
//!
//! A thin adapter between fuser's `Filesystem` trait and the client layer stack
//! ([`kiln_client::Volume`]), so a mount serves any volume graph — one brick, or distribute and
//! replicate over several — and its io-stats points show in the mount's `/metrics`. Reads are
//! handed to the stack without blocking the FUSE thread: the reply goes back to the kernel from
//! the connection's receive thread, straight from the buffer the payload was received into.
//! Writes are sent from the kernel's request buffer (no copy) and wait for the stack's answer on
//! the FUSE thread; several FUSE threads keep several in flight. Requests are up to 1 MiB
//! (`max_write` and `max_pages`), so a 1 MiB `O_DIRECT` `preadv` of 256 × 4 KiB iovecs reaches
//! the brick as one READ.
//!
//! Two modes:
//! - `vm-image` (`cache=none` semantics): every file is opened `FOPEN_DIRECT_IO`, so nothing is
//!   cached in the kernel and every read and write reaches the brick — what QEMU images want.
//! - `general`: the kernel page cache, attribute and entry timeouts, readdirplus, small
//!   files read whole with their open ([`files`]) and close-to-open across clients
//!   ([`fresh`]) — what people living in a tree of small files want. Writeback caching is
//!   opt-in (`--writeback-cache`): the kernel then trusts its own file sizes.

#![deny(unsafe_op_in_unsafe_fn)]

mod ahead;
mod args;
mod behind;
mod bufs;
mod callers;
mod changes;
mod convert;
mod data;
mod dirs;
mod files;
mod fresh;
mod gate;
pub mod inodes;
mod known;
mod listed;
mod mount;
mod opens;
mod options;
mod passthrough;
mod smalls;
mod splice;
#[cfg(test)]
mod tests;
mod walks;
mod xattr;

pub use args::*;
pub use files::Counters;
pub use mount::*;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, Generation, INodeNo, InitFlags, KernelConfig, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
};
use kiln_client::{Attr, DirEntry, Fd, SetAttrs, Volume};
use kiln_proto::sync::MutexExt as _;

use crate::gate::block_on;
use kiln_proto::ops::*;

use crate::bufs::BufPool;
use crate::convert::{errno, kind, systime, wire_time};
use crate::inodes::{join, Inodes, ROOT};

/// Largest read or write the kernel sends in one request.
pub const MAX_IO: u32 = 1 << 20;

/// Default of `--small-file-max`: 99% of the files of a source tree or a documentation tree
/// are smaller (`/usr/include` and `/usr/share/doc` here: 12,201 files, 21 KB on average, 99
/// over 256 KiB). A cold read of that tree, alternating, medians of 8: 2.08 s at 64 KiB,
/// 1.81 s at 256 KiB, 1.79 s at 1 MiB (bench/README.md).
pub const SMALL_FILE_MAX: u32 = 256 << 10;

/// Caching mode of a mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Direct I/O, no page cache (`cache=none` for QEMU images).
    VmImage,
    /// Page cache, attribute/entry caching, readdirplus and close-to-open.
    General,
}

struct DirSnapshot {
    entries: Vec<DirEntry>,
    /// What the listing may tell of extended attributes: taken before it was fetched.
    seen: xattr::Seen,
}

/// The FUSE file system.
pub struct KilnFs {
    bufs: Arc<BufPool>,
    /// The client stack: every fop goes to its top layer.
    vol: Arc<Volume>,
    /// Recent callers' credentials (name and metadata fops act as the caller on the bricks).
    callers: callers::Callers,
    /// What each FUSE file handle holds.
    files: Arc<files::Files>,
    /// Read-only opens of files of at most this size fetch them whole (see [`files`]); 0: never.
    small_max: u32,
    mode: Mode,
    ttl: Duration,
    inodes: Arc<Mutex<Inodes>>,
    dirs: Mutex<HashMap<u64, DirSnapshot>>,
    next_dir: AtomicU64,
    /// Backing files of inodes open for passthrough reads.
    pass: passthrough::Passthrough,
    /// Inodes listed without extended attributes (see [`xattr`]).
    no_xattrs: Arc<xattr::NoXattrs>,
    /// POSIX ACLs stored and enforced (`--acl`), or not supported.
    acl: bool,
    /// Close-to-open: what the kernel has been told of sizes (see [`fresh`]).
    fresh: Arc<fresh::Fresh>,
    /// The kernel's writeback cache (`--writeback-cache`): it then trusts its own sizes.
    writeback: bool,
    /// Directory listings fetched ahead of a walk (see [`ahead`]).
    ahead: Arc<ahead::Listings>,
    /// Small files' content fetched ahead of a reader (see [`ahead`] and [`smalls`]).
    contents: Arc<ahead::Contents>,
    /// The directories listed lately: what walks go through ([`walks`], [`smalls`]).
    listed: Arc<listed::Listed>,
    /// The order walks take (see [`walks`]).
    walks: walks::Walks,
    /// The volume root's brick inode (FUSE's is [`ROOT`]).
    root_brick_ino: u64,
    /// Directories whose every name this mount knows (see [`known`]).
    known: Arc<known::Known>,
    /// Writes held behind (see [`behind`]), when `write_behind`.
    behind: behind::Behind,
    write_behind: bool,
    /// What the mount answered itself (see [`Counters`]).
    counters: Arc<Counters>,
    /// Which FUSE threads wait on the kernel (see [`gate`]).
    gate: Arc<gate::Gate>,
    /// Reads answered from the brick's socket by splice (see [`splice`]).
    splice: Arc<splice::Splice>,
}

impl KilnFs {
    /// A file system over the client stack `vol`.
    pub fn new(vol: Arc<Volume>, mode: Mode, attr_timeout: Duration) -> std::io::Result<KilnFs> {
        let root = block_on(vol.lookup(""))?;
        let counters: Arc<Counters> = Arc::default();
        let ready = counters.clone();
        Ok(KilnFs {
            bufs: Arc::default(),
            vol,
            callers: callers::Callers::default(),
            files: Arc::default(),
            small_max: if mode == Mode::General {
                SMALL_FILE_MAX
            } else {
                0
            },
            mode,
            ttl: attr_timeout,
            inodes: Arc::new(Mutex::new(Inodes::new(root.ino))),
            dirs: Mutex::new(HashMap::new()),
            next_dir: AtomicU64::new(1),
            pass: passthrough::Passthrough::new(mode == Mode::VmImage),
            no_xattrs: Arc::default(),
            acl: false,
            fresh: Arc::default(),
            writeback: false,
            ahead: Arc::new(ahead::Listings::listings(attr_timeout)),
            contents: Arc::new(ahead::Contents::contents_noting(attr_timeout, move || {
                ready
                    .ahead_ready
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })),
            listed: Arc::default(),
            walks: walks::Walks::default(),
            root_brick_ino: root.ino,
            known: Arc::new(known::Known::new(attr_timeout)),
            behind: behind::Behind::default(),
            write_behind: mode == Mode::General,
            counters,
            gate: gate::Gate::new(1),
            splice: Arc::default(),
        })
    }

    /// Counts of what this mount does, readable while it serves.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// The volume on behalf of the request's caller: name and metadata fops run on the bricks
    /// with the caller's uid, gid and groups. Data fops on open files use `self.vol`: access
    /// was checked when the file was opened.
    fn caller(&self, req: &Request) -> Volume {
        self.asking(req).0
    }

    /// What other clients' changes, pushed by the bricks, make stale (see [`changes`]).
    fn caches(&self) -> changes::Caches {
        changes::Caches {
            inodes: self.inodes.clone(),
            no_xattrs: self.no_xattrs.clone(),
            fresh: self.fresh.clone(),
            ahead: self.ahead.clone(),
            contents: self.contents.clone(),
            known: self.known.clone(),
            listed: self.listed.clone(),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Inodes> {
        self.inodes.locked()
    }

    fn path(&self, ino: INodeNo) -> Result<String, Errno> {
        self.table().path(ino.0).ok_or(Errno::ENOENT)
    }

    /// The path of `ino` and an attribute name, as UTF-8.
    fn path_and_name<'n>(&self, ino: INodeNo, name: &'n OsStr) -> Result<(String, &'n str), Errno> {
        Ok((self.path(ino)?, name.to_str().ok_or(Errno::EINVAL)?))
    }

    /// A name in `path`'s directory changed through this mount, with outcome `made`:
    /// listings fetched ahead of it are stale, and what is known of its names follows.
    fn named(&self, path: &str, made: known::Name) {
        let (parent, name) = inodes::split(path);
        self.ahead.spoil(parent);
        self.contents.spoil(path);
        self.listed.forget(parent);
        self.known.named(parent, name, made);
    }

    /// `ino`'s attributes changed through this mount: the listing its entry is in is stale.
    fn touched(&self, ino: u64) {
        if !self.ahead.holds() && !self.contents.holds() {
            return;
        }
        if let Some(p) = self.table().path(ino) {
            self.named(&p, known::Name::Exists);
        }
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<String, Errno> {
        let name = name.to_str().ok_or(Errno::EINVAL)?;
        Ok(join(&self.path(parent)?, name))
    }

    /// The FUSE inode of brick inode `brick_ino`.
    fn fuse_ino(&self, brick_ino: u64) -> u64 {
        inodes::fuse_ino(self.root_brick_ino, brick_ino)
    }

    /// `a` as the kernel is to be told it, recording the size it is told (see [`fresh`]).
    fn fattr(&self, a: &Attr) -> FileAttr {
        self.fresh_told(std::iter::once(a));
        self.fattr_of(a)
    }

    /// Records the sizes the kernel is told in `attrs` (close-to-open, see [`fresh`]).
    fn fresh_told<'a>(&self, attrs: impl Iterator<Item = &'a Attr>) {
        if self.mode == Mode::General && !self.writeback {
            self.fresh
                .told(attrs.map(|a| (self.fuse_ino(a.ino), a.size)));
        }
    }

    /// `a` as the kernel sees it.
    fn fattr_of(&self, a: &Attr) -> FileAttr {
        let ino = self.fuse_ino(a.ino);
        // Writes held behind make the file longer than the brick says yet.
        let size = self.behind.end(ino).map_or(a.size, |end| end.max(a.size));
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: a.blocks,
            atime: systime(&a.atime),
            mtime: systime(&a.mtime),
            ctime: systime(&a.ctime),
            crtime: systime(&a.ctime),
            kind: kind(a.mode),
            perm: (a.mode & 0o7777) as u16,
            nlink: a.nlink as u32,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev as u32,
            blksize: a.blksize,
            flags: 0,
        }
    }

    /// Replies with an entry for `path` and counts the kernel's new lookup.
    fn entry(&self, path: &str, a: &Attr, reply: ReplyEntry) {
        self.entry_for(path, a, &self.ttl, reply)
    }

    /// [`KilnFs::entry`], for the kernel to keep `ttl`.
    fn entry_for(&self, path: &str, a: &Attr, ttl: &Duration, reply: ReplyEntry) {
        let fa = self.fattr(a);
        self.table().learn(fa.ino.0, path);
        // A new name for this inode number (perhaps a new file): nothing known of it.
        self.no_xattrs.drop_entry(fa.ino.0);
        reply.entry(ttl, &fa, Generation(0));
    }

    /// A handle of some open file of inode `ino`: `fstat` on an open file whose names are all
    /// gone reaches us without a handle (the kernel asks by inode).
    fn any_open(&self, ino: u64) -> Option<Fd> {
        self.files.any_fd(ino)
    }

    /// unlink or rmdir `name`, and forget the path.
    fn remove(&self, req: &Request, parent: INodeNo, name: &OsStr, dir: bool, reply: ReplyEmpty) {
        let path = match self.child(parent, name) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let r = if dir {
            block_on(self.caller(req).rmdir(&path))
        } else {
            self.keep_whole_files_open(req, &path);
            block_on(self.caller(req).unlink(&path))
        };
        self.named(&path, made(&r, known::Name::Gone));
        match r {
            Ok(()) => {
                self.table().unlinked(&path);
                reply.ok()
            }
            Err(e) => reply.error(errno(e)),
        }
    }
}

impl fuser::Filesystem for KilnFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_IO);
        let _ = config.set_max_readahead(MAX_IO);
        let _ = config.set_max_background(64);
        let mut caps = InitFlags::FUSE_ASYNC_READ
            | InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_MAX_PAGES
            | InitFlags::FUSE_BIG_WRITES
            // Set-ID bits and file capabilities are the bricks' to drop on a write, truncate
            // or chown (their kernels do it, acting as the caller; see `data_write`), so the
            // kernel need not ask for `security.capability` before every WRITE.
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        if self.mode == Mode::General {
            // Always readdirplus, never the kernel's choice (READDIRPLUS_AUTO): the brick's
            // listing carries every entry's attributes anyway, and with plain READDIR pages
            // (the kernel's choice past a big directory's first page) each name opened later
            // costs a LOOKUP — a third of the files of a cold tree read.
            caps |= InitFlags::FUSE_DO_READDIRPLUS;
        }
        if self.writeback {
            caps |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        if self.acl {
            caps |= InitFlags::FUSE_POSIX_ACL;
        }
        if self.pass.is_on() {
            caps |= InitFlags::FUSE_PASSTHROUGH;
            // Bricks on ext4, XFS, tmpfs: one file system under ours.
            let _ = config.set_max_stack_depth(1);
        }
        if let Err(missing) = config.add_capabilities(caps) {
            tracing::info!("kernel lacks FUSE capabilities {missing:?}; continuing without them");
            if missing.contains(InitFlags::FUSE_PASSTHROUGH) {
                self.pass.off("the kernel does not offer it");
            }
            if missing.contains(InitFlags::FUSE_POSIX_ACL) && self.acl {
                tracing::warn!("--acl: the kernel cannot enforce POSIX ACLs; the mount has none");
                self.acl = false;
            }
            if missing.contains(InitFlags::FUSE_WRITEBACK_CACHE) {
                self.writeback = false;
            }
            let _ = config.add_capabilities(caps - missing);
        }
        Ok(())
    }

    fn destroy(&mut self) {
        tracing::info!(counters = ?self.counters, "unmounted");
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _g = self.gate.enter();
        let path = match self.child(parent, name) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let (caller, who) = self.asking(req);
        let name = name.to_str().unwrap_or_default();
        if self.known.absent(ahead::parent(&path), name, &who) {
            return reply.error(Errno::ENOENT);
        }
        if let Some((a, left)) = self.small_attr(&path, &who, None) {
            // Kept by the kernel no longer than the fetch may be used.
            return self.entry_for(&path, &a, &left, reply);
        }
        match block_on(caller.lookup(&path)) {
            Ok(a) => self.entry(&path, &a, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.table().forget(ino.0, nlookup);
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let _g = self.gate.enter();
        let _ = self.send_behind(ino.0);
        let r = match fh {
            Some(fh) if ino.0 != ROOT && !matches!(self.open_fd(fh), Ok(None)) => {
                match self.fd(fh) {
                    Ok(f) => block_on(self.caller(req).fstat(&f)),
                    Err(e) => return reply.error(e),
                }
            }
            // By path; the open file only when no name leads to it any more (all its names
            // gone, or the name now another file's): the list of open files is not walked
            // on every stat.
            _ => {
                let (caller, who) = self.asking(req);
                let path = self.path(ino);
                // As a lookup would be answered (the kernel may ask again right after one).
                let ahead = path
                    .as_ref()
                    .ok()
                    .and_then(|p| self.small_attr(p, &who, Some(ino.0)));
                if let Some((a, left)) = ahead {
                    return reply.attr(&left, &self.fattr(&a));
                }
                let by_path = path.map(|p| block_on(caller.lookup(&p)));
                let gone = match &by_path {
                    Ok(Ok(a)) => self.fuse_ino(a.ino) != ino.0,
                    Ok(Err(e)) => e.raw_os_error() == Some(libc::ENOENT),
                    Err(_) => true,
                };
                match (by_path, gone.then(|| self.any_open(ino.0)).flatten()) {
                    (_, Some(f)) => block_on(caller.fstat(&f)),
                    (Ok(r), None) => r,
                    (Err(e), None) => return reply.error(e),
                }
            }
        };
        match r {
            Ok(a) => reply.attr(&self.ttl, &self.fattr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _g = self.gate.enter();
        let mut set = SetAttrs::default();
        if let Some(m) = mode {
            set.valid |= SETATTR_MODE;
            set.mode = m;
        }
        if let Some(u) = uid {
            set.valid |= SETATTR_UID;
            set.uid = u;
        }
        if let Some(g) = gid {
            set.valid |= SETATTR_GID;
            set.gid = g;
        }
        if let Some(s) = size {
            set.valid |= SETATTR_SIZE;
            set.size = s;
        }
        if let Some(t) = atime {
            let (t, now) = wire_time(t);
            set.valid |= if now {
                SETATTR_ATIME_NOW
            } else {
                SETATTR_ATIME
            };
            set.atime = t;
        }
        if let Some(t) = mtime {
            let (t, now) = wire_time(t);
            set.valid |= if now {
                SETATTR_MTIME_NOW
            } else {
                SETATTR_MTIME
            };
            set.mtime = t;
        }
        let _ = self.send_behind(ino.0);
        // With a handle (the kernel passes one from ftruncate and from writeback of an open
        // file), act on the open file: its name may be gone already. Otherwise by path.
        if size.is_some() {
            self.files.changing(ino.0);
        }
        let r = match fh {
            Some(fh) => match self.fd(fh) {
                Ok(f) => block_on(self.caller(req).fsetattr(&f, set)),
                Err(e) => return reply.error(e),
            },
            None => match self.path(ino) {
                Ok(p) => block_on(self.caller(req).setattr(&p, set)),
                Err(e) => return reply.error(e),
            },
        };
        if size.is_some() {
            self.files.changed_done();
        }
        self.touched(ino.0);
        match r {
            Ok(a) => reply.attr(&self.ttl, &self.fattr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let _g = self.gate.enter();
        match self
            .path(ino)
            .map(|p| block_on(self.caller(req).readlink(&p)))
        {
            Ok(Ok(t)) => reply.data(t.as_bytes()),
            Ok(Err(e)) => reply.error(errno(e)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _g = self.gate.enter();
        let path = match self.child(parent, name) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let epoch = self.known.epoch();
        let (caller, who) = self.asking(req);
        let r = block_on(caller.mkdir(&path, mode & !umask));
        self.named(&path, made(&r, known::Name::Exists));
        if r.is_ok() {
            self.known.made_dir(&path, epoch, &who);
        }
        match r {
            Ok(a) => self.entry(&path, &a, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _g = self.gate.enter();
        let path = match self.child(parent, name) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let mode = mode & (libc::S_IFMT | !umask);
        let r = block_on(self.caller(req).mknod(&path, mode, rdev as u64));
        self.named(&path, made(&r, known::Name::Exists));
        match r {
            Ok(a) => self.entry(&path, &a, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _g = self.gate.enter();
        self.remove(req, parent, name, false, reply)
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _g = self.gate.enter();
        self.remove(req, parent, name, true, reply)
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _g = self.gate.enter();
        let (path, target) = match (self.child(parent, link_name), target.to_str()) {
            (Ok(p), Some(t)) => (p, t),
            (Err(e), _) => return reply.error(e),
            (_, None) => return reply.error(Errno::EINVAL),
        };
        let r = block_on(self.caller(req).symlink(target, &path));
        self.named(&path, made(&r, known::Name::Exists));
        match r {
            Ok(a) => self.entry(&path, &a, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        let (from, to) = match (self.child(parent, name), self.child(newparent, newname)) {
            (Ok(f), Ok(t)) => (f, t),
            (Err(e), _) | (_, Err(e)) => return reply.error(e),
        };
        self.keep_whole_files_open(req, &to);
        let r = block_on(self.caller(req).rename(&from, &to, flags.bits()));
        let exchange = flags.bits() & libc::RENAME_EXCHANGE != 0;
        let left = if exchange {
            known::Name::Exists
        } else {
            known::Name::Gone
        };
        self.named(&from, made(&r, left));
        self.named(&to, made(&r, known::Name::Exists));
        // A directory moved: what was fetched or known below either name is not there now.
        for p in [&from, &to] {
            self.ahead.spoil_tree(p);
            self.contents.spoil_tree(p);
            self.listed.forget_tree(p);
            self.known.forget_tree(p);
        }
        match r {
            Ok(()) => {
                self.table().renamed(&from, &to);
                reply.ok()
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _g = self.gate.enter();
        let (existing, path) = match (self.path(ino), self.child(newparent, newname)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return reply.error(e),
        };
        let r = block_on(self.caller(req).link(&existing, &path));
        self.named(&existing, known::Name::Exists);
        self.named(&path, made(&r, known::Name::Exists));
        match r {
            Ok(a) => self.entry(&path, &a, reply),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: fuser::OpenFlags, reply: ReplyOpen) {
        let _g = self.gate.enter();
        self.open_file(req, ino, flags.0, reply)
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _g = self.gate.enter();
        self.create_file(req, (parent, name), mode & !umask, flags, reply)
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        let _g = self.gate.enter();
        self.data_read((req.unique().0, ino), fh, offset, size, reply)
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: fuser::WriteFlags,
        flags: fuser::OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        let _g = self.gate.enter();
        let by = if write_flags.contains(fuser::WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            Some(self.callers.cred(req.pid(), req.uid(), req.gid()))
        } else {
            None
        };
        self.data_write((ino, fh), by, offset, data, flags.0, reply)
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        self.data_flush(ino, fh, reply)
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        self.data_release(fh, reply)
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        self.data_fsync(ino, fh, datasync, reply)
    }

    fn fsyncdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        let path = match self.path(ino) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        match block_on(self.caller(req).syncdir(&path)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: fuser::OpenFlags, reply: ReplyOpen) {
        let _g = self.gate.enter();
        self.dir_open(req, ino, reply)
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        let _g = self.gate.enter();
        self.dir_read(ino, fh, offset, reply)
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        let _g = self.gate.enter();
        self.dir_read_plus(ino, fh, offset, reply)
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: fuser::OpenFlags,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        self.dirs.locked().remove(&fh.0);
        reply.ok()
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _g = self.gate.enter();
        match block_on(self.caller(req).statfs("")) {
            Ok(s) => reply.statfs(
                s.blocks,
                s.bfree,
                s.bavail,
                s.files,
                s.ffree,
                s.bsize as u32,
                s.namemax as u32,
                s.frsize as u32,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        self.xattr_set(req, ino, name, value, flags, reply)
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _g = self.gate.enter();
        self.xattr_get(req, ino, name, size, reply)
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _g = self.gate.enter();
        self.xattr_list(req, ino, size, reply)
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _g = self.gate.enter();
        self.xattr_remove(req, ino, name, reply)
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        let _g = self.gate.enter();
        // Permissions are checked by the kernel (default_permissions).
        reply.ok()
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _g = self.gate.enter();
        let _ = self.send_behind(ino.0);
        self.files.changing(ino.0);
        let r = self.fd(fh).and_then(|f| {
            block_on(self.caller(req).fallocate(&f, mode as u32, offset, length)).map_err(errno)
        });
        self.files.changed_done();
        self.touched(ino.0);
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

/// The outcome for [`known`] of a change that would leave a name `ok` if it succeeded.
fn made<T, E>(r: &Result<T, E>, ok: known::Name) -> known::Name {
    if r.is_ok() {
        ok
    } else {
        known::Name::Unknown
    }
}
