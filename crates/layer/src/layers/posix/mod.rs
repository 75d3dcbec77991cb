//! The posix layer: the bottom of a brick's stack, storing files in the brick directory.
//!
//! Every fop runs its system calls synchronously and returns a future that is ready at once, so
//! the protocol server completes page-cache reads and writes inline (layers that may wait — the
//! dispatch layer for fsync, delay-gen — sit above). Traced requests get a stamp just before
//! and just after the storage calls.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use crate::{
    errno, fail, Attr, Ctx, ExtentList, Fd, FopResult, Fut, IoBufs, Layer, RawIov, ReadDst,
    ReadOut, ReaddirReply, SetAttrs, StatfsReply, Written,
};

use crate::distribute::{Layout, LAYOUT_XATTR};

use brick::Brick;

mod behind;
pub mod brick;
mod cred;
mod reach;
pub mod sums;
#[cfg(test)]
mod tests;
pub mod trouble;

/// Reads at or above this size are handed up as a file region, sent with `sendfile`; smaller
/// ones are read into a buffer and gathered with their header into one `sendmsg`.
pub const SENDFILE_MIN: u32 = 64 * 1024;

/// Label stamped before a fop's storage calls.
pub const STORAGE_CALL: &str = "posix: storage call";
/// Label stamped after them.
pub const STORAGE_DONE: &str = "posix: storage done";

pub use behind::DEFAULT_WINDOW as DEFAULT_FLUSH_BEHIND;

crate::layer_options! {
    /// The options of a posix layer: a brick's files in a directory (brick side).
    pub struct PosixConfig {
        /// The brick directory; every path is resolved beneath it (openat2 RESOLVE_BENEATH).
        #[option(ty = "path", default = "required")]
        pub directory: PathBuf,
        /// A request on behalf of root runs as nobody (65534), like NFS `root_squash`.
        #[option(ty = "bool", default = "false")]
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub root_squash: bool,
        /// Bytes written through one open file after which its dirty pages are written back,
        /// so a snapshot's reflink or an fsync waits for about three of these per writer at
        /// most; 0 leaves write-back to the kernel.
        #[option(ty = "bytes", default = "0")]
        #[serde(default = "default_flush_behind", skip_serializing_if = "is_default_flush_behind")]
        pub flush_behind: u64,
        /// Files opened for writing are opened `O_DSYNC`: every write through this brick is
        /// on stable storage before it is answered, for clients that never flush.
        #[option(ty = "bool", default = "false")]
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub sync_writes: bool,
    }
}

impl PosixConfig {
    /// Posix over `directory`, every other option at its default.
    pub fn at(directory: impl Into<PathBuf>) -> PosixConfig {
        PosixConfig {
            directory: directory.into(),
            root_squash: false,
            flush_behind: DEFAULT_FLUSH_BEHIND,
            sync_writes: false,
        }
    }
}

fn default_flush_behind() -> u64 {
    DEFAULT_FLUSH_BEHIND
}

fn is_default_flush_behind(v: &u64) -> bool {
    *v == DEFAULT_FLUSH_BEHIND
}

/// An open file of the brick.
struct PosixFd {
    file: Arc<File>,
    /// The path it was opened by, for error reports.
    path: Arc<str>,
    /// Flush-behind, for a file open for writing.
    behind: Option<Arc<behind::Behind>>,
    /// Its block checksums (`None`: it keeps none).
    sums: Option<Arc<sums::Sums>>,
    /// What the sums read blocks through: the file, or for one open for writing only, the
    /// same file open for reading ([`sums::read_side`]).
    reads: Arc<File>,
}

/// What a fop works on, for error reports (resolved only when one is made).
#[derive(Clone, Copy)]
enum On<'a> {
    Path(&'a str),
    Fd(&'a Fd),
}

impl On<'_> {
    fn name(self) -> String {
        match self {
            On::Path(p) => p.to_owned(),
            On::Fd(fd) => fd
                .get::<PosixFd>()
                .map_or_else(|_| "(an open file)".to_owned(), |p| p.path.to_string()),
        }
    }
}

/// The posix layer over one brick directory.
pub struct Posix {
    name: String,
    brick: Arc<Brick>,
    /// Its options (the directory is the one `brick` was opened at).
    config: PosixConfig,
}

impl Posix {
    /// Posix storage named `name` over an opened brick, every option at its default.
    pub fn new(name: &str, brick: Arc<Brick>) -> Posix {
        Posix::configured(name, brick, &PosixConfig::at(PathBuf::new()))
    }

    /// Posix storage named `name` over an opened brick, configured by `config` (whose
    /// directory `brick` is).
    pub fn configured(name: &str, brick: Arc<Brick>, config: &PosixConfig) -> Posix {
        Posix {
            name: name.into(),
            brick,
            config: config.clone(),
        }
    }

    /// Writes a file's dirty pages back after every `window` bytes written to it, bounding
    /// what a reflink or fsync must wait for (see [`behind`]); 0 leaves it to the kernel.
    pub fn flush_behind(mut self, window: u64) -> Posix {
        self.config.flush_behind = window;
        self
    }

    /// `flags` as this brick opens a file with them: with `O_DSYNC` added for writing when
    /// `sync_writes` is on.
    fn open_flags(&self, flags: u32) -> u32 {
        let writes = flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32;
        if self.config.sync_writes && writes {
            flags | libc::O_DSYNC as u32
        } else {
            flags
        }
    }

    /// The open file `f` of `path`, with flush-behind when open for writing; truncated first
    /// when `flags` ask for it (see [`Posix::untruncated`]).
    fn posix_fd(&self, f: File, path: &str, flags: u32) -> FopResult<Fd> {
        let sums = self.brick.sums().and_then(|r| r.of(&f));
        if flags & libc::O_TRUNC as u32 != 0 && self.untruncated(flags) & libc::O_TRUNC as u32 == 0
        {
            match &sums {
                Some(s) => s.truncate(&f, 0, || rustix::fs::ftruncate(&f, 0).map_err(errno_of))?,
                None => rustix::fs::ftruncate(&f, 0).map_err(errno_of)?,
            }
        }
        let file = Arc::new(f);
        let writes = flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32;
        let write_only = flags & libc::O_ACCMODE as u32 == libc::O_WRONLY as u32;
        let reads = match sums.is_some() && write_only {
            true => sums::read_side(&file).map_or_else(|| file.clone(), Arc::new),
            false => file.clone(),
        };
        let window = self.config.flush_behind;
        let behind = (writes && window > 0).then(|| behind::Behind::new(file.clone(), window));
        Ok(Fd::new(PosixFd {
            file,
            path: path.into(),
            behind,
            sums,
            reads,
        }))
    }

    /// `flags` as the file is opened on a brick that keeps checksums: a file open for
    /// writing is truncated after it is open ([`Posix::posix_fd`]), so that its sums go with
    /// its bytes; and never `O_DIRECT` — sums are computed and checked over blocks read through
    /// the page cache, and the client's buffers are not the brick's to align.
    fn untruncated(&self, flags: u32) -> u32 {
        if self.brick.sums().is_none() {
            return flags;
        }
        let writes = flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32;
        let mut f = flags & !(libc::O_DIRECT as u32);
        if writes {
            f &= !(libc::O_TRUNC as u32);
        }
        f
    }

    /// With `on`, a request on behalf of root runs as nobody (like NFS `root_squash`); requests
    /// without credentials (the brick's own work, heal) still run as root.
    pub fn root_squash(mut self, on: bool) -> Posix {
        self.config.root_squash = on;
        self
    }

    /// Runs storage calls now, as the caller (see [`cred`]), stamping a traced request around
    /// them.
    /// A full, failing or read-only file system is reported (see [`trouble`]).
    fn now<'a, T: Send + 'a>(
        &self,
        cx: &Ctx,
        on: On<'_>,
        f: impl FnOnce() -> FopResult<T>,
    ) -> Fut<'a, T> {
        Box::pin(std::future::ready(self.run(cx, on, f)))
    }

    /// [`Posix::now`]'s result, not yet a future.
    fn run<T>(&self, cx: &Ctx, on: On<'_>, f: impl FnOnce() -> FopResult<T>) -> FopResult<T> {
        let squashed;
        let mut caller = cx.cred.as_deref();
        if self.config.root_squash && caller.is_some_and(|c| c.uid == 0) {
            squashed = cred::nobody();
            caller = Some(&squashed);
        }
        run_as(cx, caller, on, f)
    }
}

/// Runs storage calls now as `caller`, stamping a traced request around them.
fn run_as<T>(
    cx: &Ctx,
    caller: Option<&kiln_proto::Cred>,
    on: On<'_>,
    f: impl FnOnce() -> FopResult<T>,
) -> FopResult<T> {
    let f = || {
        let _as = cred::AsCaller::new(caller)?;
        let _in = reach::Confined::new(cx.subtree.clone());
        f()
    };
    let r = match &cx.trace {
        None => f(),
        Some(t) => {
            t.stamp(STORAGE_CALL);
            let r = f();
            t.stamp(STORAGE_DONE);
            r
        }
    };
    if let Err(e) = &r {
        trouble::observe(*e, &on.name());
    }
    r
}

fn file(fd: &Fd) -> FopResult<&Arc<File>> {
    fd.get::<PosixFd>().map(|p| &p.file)
}

fn errno_of(e: rustix::io::Errno) -> u32 {
    e.raw_os_error() as u32
}

fn io_errno(e: std::io::Error) -> u32 {
    e.raw_os_error().unwrap_or(errno::EIO as i32) as u32
}

/// `preadv` until the vectors are full or the file ends (`write` false), or `pwritev` of every
/// byte of them (`write` true); returns the bytes moved.
///
/// # Safety
/// The vectors must be valid for the direction's access (the [`IoBufs`] contract).
unsafe fn iov_loop(f: &File, iov: &[RawIov], offset: u64, write: bool) -> FopResult<usize> {
    use std::os::fd::AsRawFd;
    let mut cur = kiln_proto::iov::IovCursor::new(iov.iter().copied(), usize::MAX);
    let mut done = 0usize;
    while !cur.is_done() {
        let v = cur.pending(kiln_proto::iov::IOV_MAX);
        let (fd, ptr, n, at) = (
            f.as_raw_fd(),
            v.as_ptr().cast(),
            v.len() as i32,
            (offset + done as u64) as i64,
        );
        // SAFETY: per the caller's contract the vectors are valid for this access; `RawIov` has
        // the layout of `struct iovec`.
        let r = unsafe {
            if write {
                libc::pwritev(fd, ptr, n, at)
            } else {
                libc::preadv(fd, ptr, n, at)
            }
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io_errno(e));
        }
        match (r, write) {
            (0, false) => break, // end of file
            (0, true) => return Err(errno::EIO),
            _ => {}
        }
        done += r as usize;
        cur.advance(r as usize);
    }
    Ok(done)
}

impl Layer for Posix {
    fn name(&self) -> &str {
        &self.name
    }

    fn lookup<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Attr> {
        self.now(cx, On::Path(path), || self.brick.lookup(path))
    }

    fn fstat<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, Attr> {
        self.now(cx, On::Fd(fd), || brick::fstat(file(fd)?))
    }

    fn backing<'f>(&self, _cx: &Ctx, fd: &'f Fd) -> FopResult<&'f File> {
        Ok(file(fd)?)
    }

    fn backing_sums(&self, _cx: &Ctx, fd: &Fd) -> FopResult<Option<File>> {
        let p = fd.get::<PosixFd>()?;
        Ok(p.sums.as_ref().and_then(|s| s.reader()))
    }

    fn setattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        self.now(cx, On::Path(path), || self.brick.setattr(path, attrs))
    }

    fn fsetattr<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        self.now(cx, On::Fd(fd), || {
            let p = fd.get::<PosixFd>()?;
            match &p.sums {
                Some(s) if attrs.valid & kiln_proto::ops::SETATTR_SIZE != 0 => {
                    s.truncate(&p.reads, attrs.size, || brick::fsetattr(&p.file, attrs))
                }
                _ => brick::fsetattr(&p.file, attrs),
            }
        })
    }

    fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        self.now(cx, On::Path(path), || {
            let f = self
                .brick
                .open_file(path, self.untruncated(self.open_flags(flags)))?;
            self.posix_fd(f, path, flags)
        })
    }

    fn create<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        flags: u32,
        mode: u32,
    ) -> Fut<'a, (Fd, Attr)> {
        self.now(cx, On::Path(path), || {
            let (f, mut attr) =
                self.brick
                    .create(path, self.untruncated(self.open_flags(flags)), mode)?;
            let fd = self.posix_fd(f, path, flags)?;
            if flags & libc::O_TRUNC as u32 != 0 {
                attr = brick::fstat(file(&fd)?)?;
            }
            Ok((fd, attr))
        })
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        let (f, sums) = match fd.get::<PosixFd>() {
            Ok(p) => (p.file.clone(), p.sums.as_deref()),
            Err(e) => return fail(e),
        };
        // Every block read is checked against its sum before the read is answered.
        self.now(cx, On::Fd(fd), move || match dst {
            ReadDst::Any(len) if len >= SENDFILE_MIN => {
                // The reply header announces the length, so clamp to the file's size now; the
                // data itself moves file → socket with sendfile.
                let size = brick::fstat(&f)?.size;
                let len = size.saturating_sub(offset).min(len as u64) as usize;
                // A reader that checks the blocks itself gets their sums; otherwise the brick
                // reads the bytes to check them before they go.
                let sums = match sums {
                    Some(s) if cx.ship_sums => s.shipped(&f, offset, len, size)?,
                    Some(s) => {
                        s.check_file(&f, offset, len)?;
                        None
                    }
                    None => None,
                };
                Ok(ReadOut::File {
                    file: f,
                    offset,
                    len,
                    sums,
                })
            }
            ReadDst::Any(len) => {
                let mut buf = vec![0u8; len as usize];
                let n = brick::read_full(&f, &mut buf, offset)?;
                buf.truncate(n);
                if let Some(s) = sums {
                    s.check(&f, offset, &buf, len as usize)?;
                }
                Ok(ReadOut::Buf(buf))
            }
            ReadDst::Into(bufs) => {
                // SAFETY: the IoBufs contract keeps the vectors valid and unaliased until this
                // fop completes, which it does before returning.
                let n = unsafe { iov_loop(&f, bufs.iov(), offset, false)? };
                if let Some(s) = sums {
                    match bufs.iov() {
                        [v] => {
                            // SAFETY: as above; `n` bytes of the one vector were just filled
                            // and nothing writes them before the fop completes.
                            let got = unsafe {
                                std::slice::from_raw_parts(v.base as *const u8, n.min(v.len))
                            };
                            s.check(&f, offset, got, v.len)?
                        }
                        _ => s.check_file(&f, offset, n)?,
                    }
                }
                Ok(ReadOut::Into { n, bufs })
            }
        })
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        // One lookup of the open file serves the write and flush-behind.
        let open = fd.get::<PosixFd>();
        let r = self.run(cx, On::Fd(fd), move || {
            let p = open?;
            let f = &p.file;
            // SAFETY: the IoBufs contract keeps the vectors valid until this fop completes.
            let write = || unsafe { iov_loop(f, data.iov(), offset, true) };
            let n = match &p.sums {
                Some(s) => s.write(&p.reads, offset, data.iov(), data.len(), write)?,
                None => write()?,
            };
            Ok(Written { n, bufs: data })
        });
        let behind = open.ok().and_then(|p| p.behind.as_ref());
        if let (Ok(w), Some(b)) = (&r, behind) {
            // Two windows ahead of the disk: the write is answered once it caught up.
            if let Some(wait) = b.wrote(w.n as u64) {
                return Box::pin(async move {
                    wait.await;
                    r
                });
            }
        }
        Box::pin(std::future::ready(r))
    }

    fn fsync<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, datasync: bool) -> Fut<'a, ()> {
        self.now(cx, On::Fd(fd), || {
            let p = fd.get::<PosixFd>()?;
            brick::fsync(&p.file, datasync)?;
            p.sums.as_ref().map_or(Ok(()), |s| s.sync())
        })
    }

    fn release<'a>(&'a self, _cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        // The file closes when the last clone of the handle is dropped (a sendfile in flight
        // may still hold one).
        drop(fd);
        Box::pin(std::future::ready(Ok(())))
    }

    fn unlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        self.now(cx, On::Path(path), || self.brick.unlink(path))
    }

    fn mkdir<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32) -> Fut<'a, Attr> {
        self.now(cx, On::Path(path), || self.brick.mkdir(path, mode))
    }

    fn rmdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        self.now(cx, On::Path(path), || self.brick.rmdir(path))
    }

    fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
        self.now(cx, On::Path(from), || self.brick.rename(from, to, flags))
    }

    fn readdir<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        offset: u64,
        max: u32,
    ) -> Fut<'a, ReaddirReply> {
        self.now(cx, On::Path(path), || self.brick.readdir(path, offset, max))
    }

    fn symlink<'a>(&'a self, cx: &'a Ctx, target: &'a str, path: &'a str) -> Fut<'a, Attr> {
        self.now(cx, On::Path(path), || self.brick.symlink(target, path))
    }

    fn mknod<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32, rdev: u64) -> Fut<'a, Attr> {
        // A device node gives whoever may open it the host's device: only the brick's own work
        // (no credentials: heal recreating one) or a caller with the capability makes one.
        let kind = mode & libc::S_IFMT;
        if (kind == libc::S_IFCHR || kind == libc::S_IFBLK) && cx.cred.is_some() && !cx.devices {
            tracing::warn!(
                path,
                "refused to make a device node: the caller may not make devices"
            );
            return fail(errno::EPERM);
        }
        self.now(cx, On::Path(path), || self.brick.mknod(path, mode, rdev))
    }

    fn readlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, String> {
        self.now(cx, On::Path(path), || self.brick.readlink(path))
    }

    fn link<'a>(&'a self, cx: &'a Ctx, existing: &'a str, path: &'a str) -> Fut<'a, Attr> {
        self.now(cx, On::Path(path), || self.brick.link(existing, path))
    }

    fn syncdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        self.now(cx, On::Path(path), || {
            let dir = self
                .brick
                .open_file(path, (libc::O_RDONLY | libc::O_DIRECTORY) as u32)?;
            dir.sync_all()
                .map_err(|e| e.raw_os_error().map_or(errno::EIO, |n| n as crate::Errno))
        })
    }

    fn statfs<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, StatfsReply> {
        self.now(cx, On::Path(path), || self.brick.statfs(path))
    }

    fn getxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, Vec<u8>> {
        self.now(cx, On::Path(path), || self.brick.getxattr(path, name))
    }

    fn setxattr<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        name: &'a str,
        value: &'a [u8],
        flags: u32,
    ) -> Fut<'a, ()> {
        self.now(cx, On::Path(path), || {
            self.brick.setxattr(path, name, value, flags)
        })
    }

    fn layout_get<'a>(&'a self, cx: &'a Ctx, path: &'a str, _: &'a ()) -> Fut<'a, Vec<u8>> {
        self.now(cx, On::Path(path), || {
            self.brick.getxattr(path, LAYOUT_XATTR)
        })
    }

    fn layout_set<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a Vec<u8>) -> Fut<'a, ()> {
        // Any number of subvolumes: this checks the form; distribute checks the ranges.
        if Layout::decode(arg, usize::MAX).is_none() {
            tracing::warn!(path, "refused a malformed directory layout");
            return fail(errno::EINVAL);
        }
        self.now(cx, On::Path(path), || {
            self.brick.setxattr(path, LAYOUT_XATTR, arg, 0)
        })
    }

    fn listxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Vec<String>> {
        self.now(cx, On::Path(path), || self.brick.listxattr(path))
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, ()> {
        self.now(cx, On::Path(path), || self.brick.removexattr(path, name))
    }

    fn fallocate<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Fut<'a, ()> {
        self.now(cx, On::Fd(fd), || {
            let p = fd.get::<PosixFd>()?;
            let run = || brick::fallocate(&p.file, mode, offset, len);
            let Some(s) = &p.sums else { return run() };
            let zeroes = (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) as u32;
            let moves = (libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE) as u32;
            if mode & moves != 0 {
                s.forget_from(offset, run)
            } else if mode & zeroes != 0 {
                s.zero(&p.reads, offset, len, run)
            } else {
                // Space allocated reads as zeros, which is what a sum takes past the end.
                run()
            }
        })
    }

    fn discard<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, len: u64) -> Fut<'a, ()> {
        self.now(cx, On::Fd(fd), || {
            let p = fd.get::<PosixFd>()?;
            match &p.sums {
                Some(s) => s.zero(&p.reads, offset, len, || {
                    brick::discard(&p.file, offset, len)
                }),
                None => brick::discard(&p.file, offset, len),
            }
        })
    }

    fn extents<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        offset: u64,
        len: u64,
    ) -> Fut<'a, ExtentList> {
        self.now(cx, On::Fd(fd), || brick::extents(file(fd)?, offset, len))
    }
}

/// The dispatch layer: fops that may block for long (fsync, fallocate, discard) run on the
/// blocking thread pool so the connection keeps serving; everything else passes inline.
pub struct Dispatch {
    name: String,
    children: [crate::LayerRef; 1],
}

impl Dispatch {
    /// A dispatch layer above `child`. Must run inside a Tokio runtime.
    pub fn new(name: &str, child: crate::LayerRef) -> Dispatch {
        Dispatch {
            name: name.into(),
            children: [child],
        }
    }

    /// Runs `f` (a fop on the child) on the blocking pool.
    fn offload<'a>(
        &'a self,
        f: impl FnOnce(crate::LayerRef) -> FopResult<()> + Send + 'static,
    ) -> Fut<'a, ()> {
        let child = self.children[0].clone();
        let h = tokio::task::spawn_blocking(move || f(child));
        Box::pin(async move { h.await.unwrap_or(Err(errno::EIO)) })
    }
}

impl Layer for Dispatch {
    fn name(&self) -> &str {
        &self.name
    }

    fn children(&self) -> &[crate::LayerRef] {
        &self.children
    }

    fn fsync<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, datasync: bool) -> Fut<'a, ()> {
        let (cx, fd) = (cx.clone(), fd.clone());
        self.offload(move |c| crate::exec::block_on(c.fsync(&cx, &fd, datasync)))
    }

    fn fallocate<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Fut<'a, ()> {
        let (cx, fd) = (cx.clone(), fd.clone());
        self.offload(move |c| crate::exec::block_on(c.fallocate(&cx, &fd, mode, offset, len)))
    }

    fn discard<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, len: u64) -> Fut<'a, ()> {
        let (cx, fd) = (cx.clone(), fd.clone());
        self.offload(move |c| crate::exec::block_on(c.discard(&cx, &fd, offset, len)))
    }
}
