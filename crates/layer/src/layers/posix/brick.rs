//! The brick: every fop against the exported directory, with every path confined beneath it.
//!
//! Paths are resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` relative to the
//! brick root's descriptor — never by joining strings — so `..`, absolute symlinks and symlinks
//! that climb out are refused by the kernel. Fops that act on a name (unlink, mkdir, rename, …)
//! resolve the parent directory that way and then use the `*at` call on the final component, which
//! is never followed. Errors are Linux errno values, ready for the wire.
//!
//! A resolution first refuses every symlink (`RESOLVE_NO_SYMLINKS`); only a path that meets
//! one is resolved again following it, and then checked not to lead into `.kiln` (see
//! the `reach` module). Files are opened for I/O only after an `O_PATH` resolution showed a
//! regular file or a directory.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use kiln_proto::codec::Seq;
use kiln_proto::errno;
use kiln_proto::ops::*;
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, ResolveFlags};

pub use crate::{Errno, FopResult};

pub use super::reach::STATE_DIR;

fn err(e: rustix::io::Errno) -> Errno {
    e.raw_os_error() as u32
}

/// The exported directory.
#[derive(Debug)]
pub struct Brick {
    root: OwnedFd,
    /// The root's `(st_dev, st_ino)`: a parent resolved through a symlink may be the root,
    /// whose `.kiln` is then refused by name.
    root_id: (u64, u64),
    /// The block checksums of its files (`None`: the root cannot be looked at again; then no
    /// sums are kept or checked).
    sums: Option<super::sums::Registry>,
}

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_MAGICLINKS);
/// The first try: no symlink at all, so nothing can lead into `.kiln` (see [`Brick::resolve`]).
const RESOLVE_PLAIN: ResolveFlags = RESOLVE.union(ResolveFlags::NO_SYMLINKS);

/// `(st_dev, st_ino)` of a stat.
// `stat` field types differ between architectures; the casts are identities only on some.
#[allow(clippy::unnecessary_cast)]
fn id_of(st: &rfs::Stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

/// Open flags a client may ask for; everything else is dropped.
const ALLOWED_OPEN_FLAGS: u32 = (libc::O_ACCMODE
    | libc::O_CREAT
    | libc::O_EXCL
    | libc::O_TRUNC
    | libc::O_APPEND
    | libc::O_DIRECT
    | libc::O_SYNC
    | libc::O_DSYNC
    | libc::O_NOATIME
    | libc::O_DIRECTORY
    | libc::O_NOFOLLOW) as u32;

/// Checks a wire path: relative, `/`-separated, no `.`/`..` components, no empty components.
/// The empty string names the brick root.
pub fn check_path(path: &str) -> FopResult<&str> {
    if path.is_empty() {
        return Ok(".");
    }
    if path.starts_with('/') {
        return Err(errno::EACCES);
    }
    for c in path.split('/') {
        if c.is_empty() || c == "." || c == ".." {
            return Err(errno::EACCES);
        }
    }
    // The brick's own records (pending marks) are not part of the volume.
    if path.split('/').next() == Some(STATE_DIR) {
        return Err(errno::EACCES);
    }
    Ok(path)
}

/// Longest path one `openat2` takes (Linux's `PATH_MAX` counts the terminating NUL).
const RESOLVE_MAX: usize = 4095;

/// Splits a checked, non-root path into its parent (empty for the root) and final name.
fn split(path: &str) -> FopResult<(&str, &str)> {
    let path = check_path(path)?;
    if path == "." {
        return Err(errno::EINVAL);
    }
    Ok(match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    })
}

/// Converts `stat` to the wire's attributes.
// `stat` field types differ between architectures; the casts are identities only on some.
#[allow(clippy::unnecessary_cast)]
pub fn attr_of(st: &rfs::Stat) -> Attr {
    Attr {
        ino: st.st_ino as u64,
        mode: st.st_mode as u32,
        nlink: st.st_nlink as u64,
        uid: st.st_uid,
        gid: st.st_gid,
        rdev: st.st_rdev as u64,
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        blksize: st.st_blksize as u32,
        atime: Time {
            sec: st.st_atime as i64,
            nsec: st.st_atime_nsec as u32,
        },
        mtime: Time {
            sec: st.st_mtime as i64,
            nsec: st.st_mtime_nsec as u32,
        },
        ctime: Time {
            sec: st.st_ctime as i64,
            nsec: st.st_ctime_nsec as u32,
        },
    }
}

impl Brick {
    /// Opens the brick at `dir`, which must be an existing directory.
    pub fn open(dir: &Path) -> std::io::Result<Brick> {
        // A brick stores modes exactly as clients ask: the caller's umask was applied on the
        // client (by its kernel, or by the client itself), and applying the brick process's
        // own on top would turn `mkdir 0777` under umask 0 into 0755.
        rustix::process::umask(Mode::empty());
        let root = rfs::open(
            dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let root_id = id_of(&rfs::fstat(&root)?);
        let sums = super::sums::Registry::new(&root)
            .map_err(
                |e| tracing::warn!(dir = %dir.display(), "no block checksums on this brick: {e}"),
            )
            .ok();
        Ok(Brick {
            root,
            root_id,
            sums,
        })
    }

    /// Resolves `path` beneath the root and opens it with `flags` (`O_PATH`, or a directory
    /// read for a listing; files are opened by [`Brick::open_node`]). A path that meets no symlink is
    /// resolved once; one that does is resolved again following them and refused (`EACCES`,
    /// logged) if it ends in `.kiln` or beneath it.
    fn open_beneath(&self, path: &str, flags: OFlags, mode: u32) -> FopResult<OwnedFd> {
        let path = check_path(path)?;
        match self.resolve(path, flags, mode, RESOLVE_PLAIN) {
            Err(e) if e == libc::ELOOP as u32 => {}
            r => return r,
        }
        let fd = self.resolve(path, flags, mode, RESOLVE)?;
        if super::reach::in_state_dir(&self.root, &fd)? {
            tracing::warn!(
                path,
                "refused a path that leads into the brick's {STATE_DIR}"
            );
            return Err(errno::EACCES);
        }
        if super::reach::outside_subtree(&self.root, &fd)? {
            tracing::warn!(
                path,
                "refused a path that leads out of the caller's subtree"
            );
            return Err(errno::EACCES);
        }
        Ok(fd)
    }

    /// Resolves `path` (checked) beneath the root with `how`. A path longer than one
    /// system call takes (a deep tree) is resolved in pieces, each beneath the directory the
    /// previous one reached, so confinement holds (a symlink may then not climb above the
    /// directory its piece started from).
    fn resolve(
        &self,
        path: &str,
        flags: OFlags,
        mode: u32,
        how: ResolveFlags,
    ) -> FopResult<OwnedFd> {
        let confined = |e: rustix::io::Errno| {
            if e == rustix::io::Errno::XDEV {
                tracing::warn!(path, "refused a path that resolves outside the brick");
                errno::EACCES
            } else {
                err(e)
            }
        };
        let mut rest = path;
        let mut dir: Option<OwnedFd> = None;
        while rest.len() > RESOLVE_MAX {
            // Names are at most 255 bytes, so a cut exists; without one the name is too long.
            let cut = rest[..RESOLVE_MAX].rfind('/').ok_or(errno::ENAMETOOLONG)?;
            let at = dir.as_ref().unwrap_or(&self.root);
            let step = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
            let next = rfs::openat2(at, &rest[..cut], step, Mode::empty(), how);
            dir = Some(next.map_err(confined)?);
            rest = &rest[cut + 1..];
        }
        // openat2 refuses O_PATH combined with anything but O_DIRECTORY/O_NOFOLLOW/O_CLOEXEC.
        let extra = if flags.contains(OFlags::PATH) {
            OFlags::CLOEXEC
        } else {
            OFlags::CLOEXEC | OFlags::NOCTTY
        };
        let at = dir.as_ref().unwrap_or(&self.root);
        let mode = Mode::from_raw_mode(mode & 0o7777);
        rfs::openat2(at, rest, flags | extra, mode, how).map_err(confined)
    }

    /// True if `dir` is the brick root.
    fn is_root(&self, dir: &OwnedFd) -> FopResult<bool> {
        Ok(id_of(&rfs::fstat(dir).map_err(err)?) == self.root_id)
    }

    /// The parent directory of `path` (as an `O_PATH` descriptor) and its final name; never
    /// the root's `.kiln` (a parent reached through a symlink may be the root).
    fn parent<'p>(&self, path: &'p str) -> FopResult<(OwnedFd, &'p str)> {
        let (dir, name) = split(path)?;
        let fd = self.open_beneath(dir, OFlags::PATH | OFlags::DIRECTORY, 0)?;
        if name == STATE_DIR && self.is_root(&fd)? {
            tracing::warn!(
                path,
                "refused a path that leads into the brick's {STATE_DIR}"
            );
            return Err(errno::EACCES);
        }
        Ok((fd, name))
    }

    /// Opens `path` for I/O with `flags` (no `O_CREAT`): resolved to an `O_PATH` descriptor
    /// first (following a final symlink unless `O_NOFOLLOW`), then opened through it only if
    /// it is a regular file or a directory (see the `reach` module).
    fn open_node(&self, path: &str, flags: OFlags) -> FopResult<OwnedFd> {
        let how = OFlags::PATH | (flags & (OFlags::NOFOLLOW | OFlags::DIRECTORY));
        let node = self.open_beneath(path, how, 0)?;
        let st = rfs::fstat(&node).map_err(err)?;
        super::reach::openable(&st, path)?;
        super::reach::reopen(&node, flags)
    }

    /// Attributes of `path`, not following a final symlink.
    pub fn lookup(&self, path: &str) -> FopResult<Attr> {
        if check_path(path)? == "." {
            return rfs::fstat(&self.root).map(|s| attr_of(&s)).map_err(err);
        }
        let (dir, name) = self.parent(path)?;
        rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map(|s| attr_of(&s))
            .map_err(err)
    }

    /// Opens `path`; `O_CREAT` is honoured only through [`Brick::create`].
    pub fn open_file(&self, path: &str, flags: u32) -> FopResult<File> {
        let flags = flags & ALLOWED_OPEN_FLAGS & !((libc::O_CREAT | libc::O_EXCL) as u32);
        let fd = self.open_node(path, OFlags::from_bits_retain(flags))?;
        Ok(File::from(fd))
    }

    /// Creates (or, without `O_EXCL`, opens) `path`. A new file is made exclusively in the
    /// resolved parent (a new file is a regular file); an existing one is opened as
    /// [`Brick::open_file`] opens it. A final component that is a dangling symlink is not
    /// followed to create its target (`ENOENT`): a client's kernel resolves symlinks itself.
    pub fn create(&self, path: &str, flags: u32, mode: u32) -> FopResult<(File, Attr)> {
        let flags = OFlags::from_bits_retain(flags & ALLOWED_OPEN_FLAGS) - OFlags::CREATE;
        let (dir, name) = self.parent(path)?;
        let fresh = flags | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC | OFlags::NOCTTY;
        let mode = Mode::from_raw_mode(mode & 0o7777);
        // An existing name removed between the two tries is made afresh; a few rounds at most.
        let mut tries = 3;
        let fd = loop {
            match rfs::openat(&dir, name, fresh, mode) {
                Ok(fd) => break fd,
                Err(rustix::io::Errno::EXIST) if !flags.contains(OFlags::EXCL) => {}
                Err(e) => return Err(err(e)),
            }
            match self.open_node(path, flags) {
                Err(e) if e == errno::ENOENT && tries > 1 => tries -= 1,
                r => break r?,
            }
        };
        let st = rfs::fstat(&fd).map_err(err)?;
        Ok((File::from(fd), attr_of(&st)))
    }

    /// Applies the attributes `attrs.valid` selects to `path`.
    pub fn setattr(&self, path: &str, attrs: &SetAttrs) -> FopResult<Attr> {
        // The inode `path` names, never what a final symlink points to: a client's kernel
        // follows symlinks itself before asking, and lchown or utimensat(AT_SYMLINK_NOFOLLOW)
        // must change the link (a dangling one too).
        // A size is set through a descriptor open for writing: only a regular file gets one
        // (ENXIO for special files, never opened; EISDIR, ELOOP as before).
        if attrs.valid & SETATTR_SIZE != 0 {
            let file = File::from(self.open_node(path, OFlags::WRONLY | OFlags::NOFOLLOW)?);
            return match self.sums.as_ref().and_then(|r| r.of(&file)) {
                Some(s) => {
                    let reads = super::sums::read_side(&file);
                    let through = reads.as_ref().unwrap_or(&file);
                    s.truncate(through, attrs.size, || fsetattr(&file, attrs))
                }
                None => fsetattr(&file, attrs),
            };
        }
        let fd = self.open_beneath(path, OFlags::PATH | OFlags::NOFOLLOW, 0)?;
        apply_setattr(&fd, attrs)
    }

    /// The block checksums of its files, if it keeps them.
    pub fn sums(&self) -> Option<&super::sums::Registry> {
        self.sums.as_ref()
    }

    /// Removes a file.
    pub fn unlink(&self, path: &str) -> FopResult<()> {
        let (dir, name) = self.parent(path)?;
        let last = last_link(&dir, name);
        rfs::unlinkat(&dir, name, AtFlags::empty()).map_err(err)?;
        self.gone(last);
        Ok(())
    }

    /// Forgets the sums of a file whose last name was removed.
    fn gone(&self, last: Option<u64>) {
        if let (Some(ino), Some(sums)) = (last, &self.sums) {
            sums.removed(ino);
        }
    }

    /// Makes a directory.
    pub fn mkdir(&self, path: &str, mode: u32) -> FopResult<Attr> {
        let (dir, name) = self.parent(path)?;
        rfs::mkdirat(&dir, name, Mode::from_raw_mode(mode & 0o7777)).map_err(err)?;
        rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map(|s| attr_of(&s))
            .map_err(err)
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, path: &str) -> FopResult<()> {
        let (dir, name) = self.parent(path)?;
        rfs::unlinkat(&dir, name, AtFlags::REMOVEDIR).map_err(err)
    }

    /// Renames `from` to `to`.
    pub fn rename(&self, from: &str, to: &str, flags: u32) -> FopResult<()> {
        let (fdir, fname) = self.parent(from)?;
        let (tdir, tname) = self.parent(to)?;
        let flags = rfs::RenameFlags::from_bits(flags).ok_or(errno::EINVAL)?;
        // A file renamed over loses its last name (unless it is the same file).
        let last = if flags.contains(rfs::RenameFlags::EXCHANGE) {
            None
        } else {
            last_link(&tdir, tname).filter(|ino| {
                rfs::statat(&fdir, fname, AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|s| id_of(&s).1 != *ino)
            })
        };
        rfs::renameat_with(&fdir, fname, &tdir, tname, flags).map_err(err)?;
        self.gone(last);
        Ok(())
    }

    /// Lists up to `max` entries of a directory from index `offset`, with attributes — fewer
    /// where more would not fit one reply ([`READDIR_BYTES`]). `.` and `..` are not listed.
    pub fn readdir(&self, path: &str, offset: u64, max: u32) -> FopResult<ReaddirReply> {
        let fd = self.open_beneath(path, OFlags::RDONLY | OFlags::DIRECTORY, 0)?;
        let mut dir = rfs::Dir::read_from(&fd).map_err(err)?;
        let mut entries = Vec::new();
        let mut index = 0u64;
        let mut eof = true;
        let mut bytes = 0;
        while let Some(ent) = dir.read() {
            let ent = ent.map_err(err)?;
            let name = ent.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            // The root's `.kiln` is not listed, however the root was reached.
            if name == STATE_DIR.as_bytes() && self.is_root(&fd)? {
                continue;
            }
            if index < offset {
                index += 1;
                continue;
            }
            bytes += DIR_ENTRY_MAX + name.len();
            if entries.len() as u32 >= max || bytes > READDIR_BYTES {
                eof = false;
                break;
            }
            index += 1;
            let Ok(name) = std::str::from_utf8(name) else {
                tracing::warn!(path, "skipping a directory entry whose name is not UTF-8");
                continue;
            };
            // The entry may vanish between readdir and stat; skip it then.
            if let Ok(st) = rfs::statat(&fd, name, AtFlags::SYMLINK_NOFOLLOW) {
                entries.push(DirEntry {
                    name: name.to_owned(),
                    attr: attr_of(&st),
                    xattrs: has_xattrs(&fd, name),
                });
            }
        }
        Ok(ReaddirReply {
            entries: kiln_proto::codec::Seq(entries),
            eof,
        })
    }

    /// Makes `path` a symlink to `target`. The target is stored as given; following it later is
    /// confined like any other resolution.
    pub fn symlink(&self, target: &str, path: &str) -> FopResult<Attr> {
        if target.is_empty() {
            return Err(errno::ENOENT);
        }
        let (dir, name) = self.parent(path)?;
        rfs::symlinkat(target, &dir, name).map_err(err)?;
        rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map(|s| attr_of(&s))
            .map_err(err)
    }

    /// Makes `path` a FIFO, socket, device node or empty regular file (`mode` gives the type);
    /// other types are refused as mknod(2) refuses them.
    pub fn mknod(&self, path: &str, mode: u32, rdev: u64) -> FopResult<Attr> {
        let kind = rfs::FileType::from_raw_mode(mode);
        if !matches!(
            kind,
            rfs::FileType::Fifo
                | rfs::FileType::Socket
                | rfs::FileType::CharacterDevice
                | rfs::FileType::BlockDevice
                | rfs::FileType::RegularFile
        ) {
            return Err(errno::EINVAL);
        }
        let (dir, name) = self.parent(path)?;
        rfs::mknodat(&dir, name, kind, Mode::from_raw_mode(mode), rdev).map_err(err)?;
        rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map(|s| attr_of(&s))
            .map_err(err)
    }

    /// Reads a symlink's target.
    pub fn readlink(&self, path: &str) -> FopResult<String> {
        let (dir, name) = self.parent(path)?;
        let target = rfs::readlinkat(&dir, name, Vec::new()).map_err(err)?;
        target.into_string().map_err(|_| errno::EINVAL)
    }

    /// Makes `path` another name for `existing` (never following a symlink).
    pub fn link(&self, existing: &str, path: &str) -> FopResult<Attr> {
        let (odir, oname) = self.parent(existing)?;
        let (ndir, nname) = self.parent(path)?;
        rfs::linkat(&odir, oname, &ndir, nname, AtFlags::empty()).map_err(err)?;
        rfs::statat(&ndir, nname, AtFlags::SYMLINK_NOFOLLOW)
            .map(|s| attr_of(&s))
            .map_err(err)
    }

    /// File system statistics of the brick.
    pub fn statfs(&self, path: &str) -> FopResult<StatfsReply> {
        let fd = self.open_beneath(path, OFlags::PATH, 0)?;
        let s = rfs::fstatvfs(&fd).map_err(err)?;
        Ok(StatfsReply {
            bsize: s.f_bsize,
            frsize: s.f_frsize,
            blocks: s.f_blocks,
            bfree: s.f_bfree,
            bavail: s.f_bavail,
            files: s.f_files,
            ffree: s.f_ffree,
            namemax: s.f_namemax,
        })
    }

    /// Where `path`'s extended attributes live (see [`XattrOn`]).
    fn xattr_on(&self, path: &str) -> FopResult<XattrOn> {
        let fd = self.open_beneath(path, OFlags::PATH | OFlags::NOFOLLOW, 0)?;
        let st = rfs::fstat(&fd).map_err(err)?;
        Ok(match rfs::FileType::from_raw_mode(st.st_mode) {
            rfs::FileType::Symlink => XattrOn::Symlink,
            _ => XattrOn::Node(fd),
        })
    }

    /// Reads an extended attribute.
    pub fn getxattr(&self, path: &str, name: &str) -> FopResult<Vec<u8>> {
        let mut buf = vec![0u8; kiln_proto::codec::MAX_BYTES_LEN];
        let n = match self.xattr_on(path)? {
            XattrOn::Node(fd) => rfs::getxattr(proc_fd(&fd), name, &mut buf[..]),
            XattrOn::Symlink => return Err(errno::ENODATA),
        }
        .map_err(err)?;
        buf.truncate(n);
        Ok(buf)
    }

    /// Sets an extended attribute.
    pub fn setxattr(&self, path: &str, name: &str, value: &[u8], flags: u32) -> FopResult<()> {
        let flags = rfs::XattrFlags::from_bits(flags).ok_or(errno::EINVAL)?;
        match self.xattr_on(path)? {
            XattrOn::Node(fd) => rfs::setxattr(proc_fd(&fd), name, value, flags),
            XattrOn::Symlink => return Err(errno::EPERM),
        }
        .map_err(err)
    }

    /// Lists extended attribute names.
    pub fn listxattr(&self, path: &str) -> FopResult<Vec<String>> {
        let mut buf = vec![0u8; kiln_proto::codec::MAX_BYTES_LEN];
        let n = match self.xattr_on(path)? {
            XattrOn::Node(fd) => rfs::listxattr(proc_fd(&fd), &mut buf[..]),
            XattrOn::Symlink => return Ok(Vec::new()),
        }
        .map_err(err)?;
        Ok(buf[..n]
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .filter_map(|s| std::str::from_utf8(s).ok().map(str::to_owned))
            .collect())
    }

    /// Removes an extended attribute.
    pub fn removexattr(&self, path: &str, name: &str) -> FopResult<()> {
        match self.xattr_on(path)? {
            XattrOn::Node(fd) => rfs::removexattr(proc_fd(&fd), name),
            XattrOn::Symlink => return Err(errno::EPERM),
        }
        .map_err(err)
    }
}

/// Where a path's extended attributes are read and written: the inode behind an `O_PATH`
/// descriptor resolved beneath the brick, named through `/proc/self/fd`, which leads to that
/// inode and nowhere else. Nothing is opened for real (a FIFO would wait for a writer, a
/// socket refuses, a device would be opened), and one resolution of the path serves. Symlinks
/// hold no attribute a client may use (Linux refuses `user.*` on them; `trusted.*` and
/// `security.*` are reserved).
enum XattrOn {
    Node(OwnedFd),
    Symlink,
}

/// True if entry `name` of directory `dir` has extended attributes a client may see — not
/// Kiln's own (`trusted.kiln.*`) nor the brick host's security labels (`security.*`, which
/// clients may not set) — or if that cannot be told.
fn has_xattrs(dir: &OwnedFd, name: &str) -> bool {
    let mut buf = [0u8; 1024];
    let listed = match listxattrat(dir, name, &mut buf) {
        Some(r) => r,
        None => rfs::llistxattr(format!("{}/{name}", proc_fd(dir)), &mut buf[..]),
    };
    match listed {
        Ok(n) => buf[..n]
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .any(|s| !s.starts_with(b"trusted.kiln.") && !s.starts_with(b"security.")),
        // ERANGE (more names than fit here) among others: say yes, the client will ask.
        Err(_) => true,
    }
}

/// Most encoded bytes of a [`DirEntry`] besides its name.
const DIR_ENTRY_MAX: usize = 128;
/// Encoded entries one readdir reply carries at most: under the frame's argument limit.
pub const READDIR_BYTES: usize = kiln_proto::MAX_ARGS_LEN as usize - 4096;

/// Lists the extended attributes of entry `name` of `dir` itself (not a symlink's target)
/// into `buf` with `listxattrat(2)` (Linux 6.13): a third of a listing's cost when it went
/// through `/proc/self/fd/N/name` instead, a four-step path walk per entry. None where the
/// kernel lacks it (remembered) or the name cannot be passed; the caller goes through /proc.
fn listxattrat(dir: &OwnedFd, name: &str, buf: &mut [u8]) -> Option<rustix::io::Result<usize>> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static MISSING: AtomicBool = AtomicBool::new(false);
    /// The syscall's number on the architectures that share the generic table (alpha and
    /// MIPS offset theirs; there the /proc walk is used).
    const SYS_LISTXATTRAT: libc::c_long = 465;
    const SHARED_TABLE: bool = cfg!(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64",
        target_arch = "loongarch64"
    ));
    if !SHARED_TABLE || MISSING.load(Ordering::Relaxed) {
        return None;
    }
    let mut z = [0u8; 256];
    if name.len() >= z.len() || name.as_bytes().contains(&0) {
        return None;
    }
    z[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: `dir` is an open descriptor for the call's duration; `z` is a NUL-terminated
    // name (its length checked above, the rest of the array zero); the kernel writes at most
    // `buf.len()` bytes into `buf`, which is valid writable memory of that length.
    let n = unsafe {
        libc::syscall(
            SYS_LISTXATTRAT,
            dir.as_raw_fd(),
            z.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
            buf.as_mut_ptr(),
            buf.len(),
        )
    };
    if n >= 0 {
        return Some(Ok(n as usize));
    }
    let e = rustix::io::Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error()?);
    // ENOSYS: an older kernel; EPERM: a seccomp filter that refuses syscalls it does not
    // know. Either way, never again.
    if e == rustix::io::Errno::NOSYS || e == rustix::io::Errno::PERM {
        MISSING.store(true, Ordering::Relaxed);
        return None;
    }
    Some(Err(e))
}

/// `/proc/self/fd/N` for `fd`.
fn proc_fd(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// The inode number of `name` in `dir` if it is a regular file with one link (removing the
/// name removes the file).
fn last_link(dir: &OwnedFd, name: &str) -> Option<u64> {
    let st = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).ok()?;
    let regular = rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile;
    (regular && st.st_nlink == 1).then(|| id_of(&st).1)
}

/// Applies the fields `req.valid` selects to the file behind `fd` (an `O_PATH` descriptor or a
/// real one).
pub fn apply_setattr(fd: &OwnedFd, req: &SetAttrs) -> FopResult<Attr> {
    // The owner first: changing it clears the set-user-ID and set-group-ID bits, which the
    // mode asked for in the same request must survive (a copy given its file's mode and owner).
    if req.valid & (SETATTR_UID | SETATTR_GID) != 0 {
        let uid = (req.valid & SETATTR_UID != 0).then(|| rfs::Uid::from_raw(req.uid));
        let gid = (req.valid & SETATTR_GID != 0).then(|| rfs::Gid::from_raw(req.gid));
        rfs::chownat(
            fd,
            "",
            uid,
            gid,
            AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(err)?;
    }
    if req.valid & SETATTR_MODE != 0 {
        let mode = Mode::from_raw_mode(req.mode & 0o7777);
        // fchmod refuses an O_PATH descriptor (EBADF); then the inode is reached through
        // /proc/self/fd, never by opening it (a FIFO would wait, a socket refuse, a device
        // open). A symlink's own mode cannot be changed on Linux.
        if let Err(e) = rfs::fchmod(fd, mode) {
            if e != rustix::io::Errno::BADF {
                return Err(err(e));
            }
            let st = rfs::fstat(fd).map_err(err)?;
            if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Symlink {
                return Err(errno::EOPNOTSUPP);
            }
            rfs::chmod(proc_fd(fd), mode).map_err(err)?;
        }
    }
    if req.valid & SETATTR_SIZE != 0 {
        rfs::ftruncate(fd, req.size).map_err(err)?;
    }
    let time_mask = SETATTR_ATIME | SETATTR_MTIME | SETATTR_ATIME_NOW | SETATTR_MTIME_NOW;
    if req.valid & time_mask != 0 {
        let pick = |set: u32, now: u32, t: &Time| {
            if req.valid & now != 0 {
                rfs::Timespec {
                    tv_sec: 0,
                    tv_nsec: rfs::UTIME_NOW,
                }
            } else if req.valid & set != 0 {
                rfs::Timespec {
                    tv_sec: t.sec,
                    tv_nsec: t.nsec as _,
                }
            } else {
                rfs::Timespec {
                    tv_sec: 0,
                    tv_nsec: rfs::UTIME_OMIT,
                }
            }
        };
        let ts = rfs::Timestamps {
            last_access: pick(SETATTR_ATIME, SETATTR_ATIME_NOW, &req.atime),
            last_modification: pick(SETATTR_MTIME, SETATTR_MTIME_NOW, &req.mtime),
        };
        rfs::utimensat(fd, "", &ts, AtFlags::EMPTY_PATH).map_err(err)?;
    }
    rfs::fstat(fd).map(|s| attr_of(&s)).map_err(err)
}

/// Applies a setattr to an open file.
pub fn fsetattr(file: &File, attrs: &SetAttrs) -> FopResult<Attr> {
    let fd = file
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO) as u32)?;
    apply_setattr(&fd, attrs)
}

/// Attributes of an open file.
pub fn fstat(file: &File) -> FopResult<Attr> {
    rfs::fstat(file).map(|s| attr_of(&s)).map_err(err)
}

/// Reads into `buf` at `offset` until it is full or the file ends; returns the bytes read.
/// A short read ends it: on a brick's local file system that is the file's end (a read
/// racing an append sees the file as it was), and asking again would only cost a `pread`
/// that returns nothing — one per small file read whole, which asks a byte past its size.
pub fn read_full(file: &File, buf: &mut [u8], offset: u64) -> FopResult<usize> {
    let mut done = 0;
    while done < buf.len() {
        let want = buf.len() - done;
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) if n < want => {
                done += n;
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.raw_os_error().unwrap_or(errno::EIO as i32) as u32),
        }
    }
    Ok(done)
}

/// Writes all of `buf` at `offset`.
pub fn write_full(file: &File, buf: &[u8], offset: u64) -> FopResult<usize> {
    file.write_all_at(buf, offset)
        .map(|_| buf.len())
        .map_err(|e| e.raw_os_error().unwrap_or(errno::EIO as i32) as u32)
}

/// Flushes a file to stable storage.
pub fn fsync(file: &File, datasync: bool) -> FopResult<()> {
    if datasync {
        rfs::fdatasync(file)
    } else {
        rfs::fsync(file)
    }
    .map_err(err)
}

/// Allocates or punches space.
pub fn fallocate(file: &File, mode: u32, offset: u64, len: u64) -> FopResult<()> {
    let flags = rfs::FallocateFlags::from_bits(mode).ok_or(errno::EINVAL)?;
    rfs::fallocate(file.as_fd(), flags, offset, len).map_err(err)
}

/// Discards a range: punches a hole and keeps the size.
pub fn discard(file: &File, offset: u64, len: u64) -> FopResult<()> {
    let flags = rfs::FallocateFlags::PUNCH_HOLE | rfs::FallocateFlags::KEEP_SIZE;
    rfs::fallocate(file.as_fd(), flags, offset, len).map_err(err)
}

/// The runs of data and holes of `[offset, offset + len)` in an open file, from the file
/// system's `SEEK_DATA`/`SEEK_HOLE` (one data run where it has no such notion), at most
/// [`EXTENTS_MAX`] of them; past the end of the file is one hole.
pub fn extents(file: &File, offset: u64, len: u64) -> FopResult<ExtentList> {
    let size = rfs::fstat(file).map_err(err)?.st_size as u64;
    let end = offset.saturating_add(len);
    // Where the next data (or hole) starts at or after `at`: `none` on a file system without
    // the notion (data everywhere up to the end of the file).
    let seek = |pos: rfs::SeekFrom, none: u64| match rfs::seek(file, pos) {
        Ok(p) => Ok(p),
        Err(rustix::io::Errno::NXIO) => Ok(size),
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::OPNOTSUPP) => Ok(none),
        Err(e) => Err(err(e)),
    };
    let mut runs = Vec::new();
    let mut at = offset;
    while at < end && runs.len() < EXTENTS_MAX {
        if at >= size {
            runs.push(Extent {
                len: end - at,
                hole: true,
            });
            break;
        }
        let data = seek(rfs::SeekFrom::Data(at), at)?.max(at);
        let (stop, hole) = if data > at {
            (data, true)
        } else {
            // At data: a hole follows it, at the end of the file at the latest.
            (seek(rfs::SeekFrom::Hole(at), size)?.max(at + 1), false)
        };
        let stop = stop.min(end);
        runs.push(Extent {
            len: stop - at,
            hole,
        });
        at = stop;
    }
    Ok(ExtentList {
        size,
        runs: Seq(runs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_readdir_page_fits_one_reply() {
        use kiln_proto::codec::Wire;
        let t = Time {
            sec: i64::MAX,
            nsec: u32::MAX,
        };
        let attr = Attr {
            ino: u64::MAX,
            mode: u32::MAX,
            nlink: u64::MAX,
            uid: u32::MAX,
            gid: u32::MAX,
            rdev: u64::MAX,
            size: u64::MAX,
            blocks: u64::MAX,
            blksize: u32::MAX,
            atime: t.clone(),
            mtime: t.clone(),
            ctime: t,
        };
        let name = "n".repeat(255);
        let one = DirEntry {
            name: name.clone(),
            attr,
            xattrs: true,
        };
        assert!(one.to_wire().len() <= DIR_ENTRY_MAX + name.len());
        // As many as the brick lets into a page, plus the reply's own fields.
        let n = READDIR_BYTES / (DIR_ENTRY_MAX + name.len());
        let page = ReaddirReply {
            entries: kiln_proto::codec::Seq(vec![one; n]),
            eof: false,
        };
        assert!(page.to_wire().len() <= kiln_proto::MAX_ARGS_LEN as usize);
    }

    #[test]
    fn check_path_refuses_escapes() {
        for bad in [
            "/etc/passwd",
            "..",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a/.",
        ] {
            assert_eq!(check_path(bad), Err(errno::EACCES), "{bad}");
        }
        assert_eq!(check_path(""), Ok("."));
        assert_eq!(check_path("a/b.c/..d"), Ok("a/b.c/..d"));
        assert_eq!(split("a/b/c"), Ok(("a/b", "c")));
        assert_eq!(split("c"), Ok(("", "c")));
        assert_eq!(split(""), Err(errno::EINVAL));
    }
}
