//! Opening and creating files: the flags the brick and the kernel are given, and small files
//! fetched whole with their open (see [`crate::files`] and [`crate::smalls`]).

use std::ffi::OsStr;

use fuser::{FileHandle, FopenFlags, Generation, INodeNo, ReplyCreate, ReplyOpen, Request};
use kiln_client::{Fd, Opened};

use crate::convert::errno;
use crate::gate::block_on;
use crate::{files, known, made, KilnFs, Mode};

impl KilnFs {
    /// The flags an open or create of the kernel's `flags` asks the brick for.
    pub(crate) fn open_flags(&self, flags: i32) -> i32 {
        // O_DIRECT is the kernel's business on this side (no page cache here); passed to the
        // brick it would demand aligned buffers there.
        let mut f = flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_NOCTTY | libc::O_DIRECT);
        if self.writeback {
            // With writeback caching the kernel may read pages of a write-only file and does
            // O_APPEND itself.
            if f & libc::O_ACCMODE == libc::O_WRONLY {
                f = (f & !libc::O_ACCMODE) | libc::O_RDWR;
            }
            f &= !libc::O_APPEND;
        }
        f
    }

    /// Gives file `ino`, open as `fd`, a FUSE file handle.
    pub(crate) fn register_open(&self, ino: u64, fd: Fd) -> u64 {
        self.files.add(ino, files::Held::Fd(fd))
    }

    /// How the kernel is to treat the mount's open files.
    pub(crate) fn fopen_flags(&self) -> FopenFlags {
        match self.mode {
            Mode::VmImage => FopenFlags::FOPEN_DIRECT_IO,
            Mode::General => FopenFlags::empty(),
        }
    }

    /// OPEN of inode `ino` with the kernel's `flags`.
    pub(crate) fn open_file(&self, req: &Request, ino: INodeNo, flags: i32, reply: ReplyOpen) {
        let path = match self.path(ino) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let _ = self.send_behind(ino.0);
        let flags = self.open_flags(flags);
        let small = self.small_max > 0 && flags & (libc::O_ACCMODE | libc::O_TRUNC) == 0;
        // A read-only handle holds no writes: its close needs no FLUSH.
        let ff = match flags & libc::O_ACCMODE == libc::O_RDONLY {
            true => self.fopen_flags() | FopenFlags::FOPEN_NOFLUSH,
            false => self.fopen_flags(),
        };
        let (caller, who) = self.asking(req);
        // In progress until its handle is registered and answered (see `files::Opening`).
        let opening = self.files.opening(ino.0);
        let seen = self.files.changes();
        let taken = match small {
            true => self.small_taken(&path, ino.0, &who),
            false => None,
        };
        let hit = taken.is_some();
        let stored = taken.as_ref().and_then(|t| t.stored);
        let opened = match taken {
            Some(c) => Ok(Opened::Whole(c.data, c.attr)),
            None if small => {
                // The next files' fetches go out first, to run beside this one's.
                self.small_next((&caller, &who), &path);
                block_on(caller.open_small(&path, flags, self.small_max))
            }
            None => block_on(caller.open(&path, flags)).map(Opened::Fd),
        };
        match opened {
            Ok(o) => {
                let o = (o, opening.count, stored);
                self.opened(ino.0, (&path, flags), &caller, o, (seen, ff), reply)
            }
            Err(e) => reply.error(errno(e)),
        }
        drop(opening);
        // Found fetched ahead: the reader was answered before the next fetches go out.
        if hit {
            self.small_next((&caller, &who), &path);
        }
    }

    /// CREATE of `name` in `parent` with `mode` (the umask applied) and the kernel's `flags`.
    pub(crate) fn create_file(
        &self,
        req: &Request,
        (parent, name): (INodeNo, &OsStr),
        mode: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let path = match self.child(parent, name) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let flags = self.open_flags(flags) | (flags & libc::O_EXCL);
        // It may open an existing file: nothing is stored ahead meanwhile.
        let _creating = self.files.creating();
        let r = block_on(self.caller(req).create(&path, flags, mode));
        self.named(&path, made(&r, known::Name::Exists));
        match r {
            Ok((fd, a)) => {
                let fa = self.fattr(&a);
                // An existing file may be opened this way: pages stored ahead are not kept.
                let _opening = self.files.opening(fa.ino.0);
                let id = self.register_open(fa.ino.0, fd);
                self.table().learn(fa.ino.0, &path);
                reply.created(
                    &self.ttl,
                    &fa,
                    Generation(0),
                    FileHandle(id),
                    self.fopen_flags(),
                )
            }
            Err(e) => reply.error(errno(e)),
        }
    }
}
