//! Directories: opening one takes a snapshot of its listing; pages are read from it.

use std::sync::atomic::Ordering;

use fuser::{
    Errno, FileHandle, FileType, FopenFlags, Generation, INodeNo, ReplyDirectory,
    ReplyDirectoryPlus, ReplyOpen, Request,
};
use kiln_client::Volume;
use kiln_proto::sync::MutexExt as _;

use crate::gate::{self, block_on};

use crate::ahead::{Job, Listing, Who};
use crate::convert::{errno, kind};
use crate::inodes::{join, split};
use crate::{DirSnapshot, KilnFs, Mode};

impl KilnFs {
    /// OPENDIR: one listing per open directory, so later pages come from this snapshot and
    /// a listing is stable while entries are created or removed concurrently. The listing
    /// comes from those fetched ahead when one is ready or on its way; the listings a walk
    /// reaches next are fetched ahead in turn (general mode, see [`crate::ahead`] and
    /// [`crate::walks`]).
    pub(crate) fn dir_open(&self, req: &Request, ino: INodeNo, reply: ReplyOpen) {
        let path = match self.path(ino) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let (caller, who) = self.asking(req);
        let general = self.mode == Mode::General;
        // Where a walk is: the subdirectories it opens next are fetched ahead (below).
        let (up, name) = split(&path);
        let siblings = match general && !path.is_empty() {
            true => self.walks.opened(self.listed.get(up).as_deref(), up, name),
            false => Vec::new(),
        };
        let (entries, seen) = match self.ahead.take_waiting(&path, &who, |w| gate::waiting(w)) {
            Some(listing) => listing,
            None => {
                let seen = self.no_xattrs.seen(self.ttl, &who);
                match block_on(caller.readdir(&path)) {
                    Ok(entries) => (entries, seen),
                    Err(e) => return reply.error(errno(e)),
                }
            }
        };
        if general {
            let listing = self.listed.put(&path, self.listing_of(&entries));
            // A depth-first walk goes into this directory's first subdirectories before
            // this one's next siblings.
            let first = self.walks.listed(&path, &listing);
            self.listings_ahead((&caller, &who), first.into_iter().chain(siblings));
        }
        let id = self.next_dir.fetch_add(1, Ordering::Relaxed);
        self.dirs.locked().insert(id, DirSnapshot { entries, seen });
        reply.opened(FileHandle(id), FopenFlags::empty())
    }

    /// READDIR: a page of the open directory's snapshot.
    pub(crate) fn dir_read(
        &self,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let dirs = self.dirs.locked();
        let Some(d) = dirs.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let mut i = offset;
        if i == 0 {
            if reply.add(ino, 1, FileType::Directory, ".") {
                return reply.ok();
            }
            i = 1;
        }
        if i == 1 {
            if reply.add(ino, 2, FileType::Directory, "..") {
                return reply.ok();
            }
            i = 2;
        }
        for (k, e) in d.entries.iter().enumerate().skip((i - 2) as usize) {
            let ino = INodeNo(self.fuse_ino(e.attr.ino));
            if reply.add(ino, k as u64 + 3, kind(e.attr.mode), &e.name) {
                break;
            }
        }
        reply.ok()
    }

    /// READDIRPLUS: a page of the snapshot, with attributes (each entry a lookup).
    pub(crate) fn dir_read_plus(
        &self,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        // Offsets match `readdir`'s (".", "..", then entry k at k + 3), so either can go on
        // from where the other stopped.
        let dirs = self.dirs.locked();
        let Some(d) = dirs.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let parent = match self.path(ino) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        if offset < 2 {
            // The kernel takes neither a lookup reference nor the attributes of "." and ".."
            // (fs/fuse/readdir.c, `fuse_direntplus_link`): only their type reaches the reader,
            // so no brick lookup of the directory is spent on them.
            let here = dot(ino);
            if offset == 0 && reply.add(ino, 1, ".", &self.ttl, &here, Generation(0)) {
                return reply.ok();
            }
            if reply.add(ino, 2, "..", &self.ttl, &here, Generation(0)) {
                return reply.ok();
            }
        }
        let first = offset.saturating_sub(2) as usize;
        let mut sent = 0;
        for (k, e) in d.entries.iter().enumerate().skip(first) {
            let fa = self.fattr_of(&e.attr);
            if reply.add(fa.ino, k as u64 + 3, &e.name, &self.ttl, &fa, Generation(0)) {
                break;
            }
            sent += 1;
        }
        // What the kernel was given, recorded with one lock per table, not per entry.
        let page = || d.entries[first..first + sent].iter();
        self.fresh_told(page().map(|e| &e.attr));
        {
            // Each entry handed to the kernel with attributes counts as a lookup.
            let mut t = self.table();
            for e in page() {
                t.learn(self.fuse_ino(e.attr.ino), &join(&parent, &e.name));
            }
        }
        // A directory's copies on several bricks may differ: only files are taken at their
        // word.
        self.no_xattrs.listed(
            page().map(|e| {
                let dir = kind(e.attr.mode) == FileType::Directory;
                (self.fuse_ino(e.attr.ino), e.xattrs || dir)
            }),
            &d.seen,
        );
        reply.ok()
    }

    /// Fetches the listings of directories `dirs` ahead for `caller` (credentials `who`).
    fn listings_ahead(
        &self,
        (caller, who): (&Volume, &Who),
        dirs: impl IntoIterator<Item = String>,
    ) {
        self.ahead.want(dirs, who, |dir| {
            let (vol, seen, dir) = (
                caller.clone(),
                self.no_xattrs.seen(self.ttl, who),
                dir.to_owned(),
            );
            let job: Job<Listing> = Box::new(move || {
                Box::pin(async move {
                    let entries = vol.readdir(&dir).await.ok()?;
                    let n = entries.len();
                    Some(((entries, seen), n))
                })
            });
            job
        });
    }
}

/// What a READDIRPLUS page says of "." and "..": a directory (the kernel uses nothing else).
fn dot(ino: INodeNo) -> fuser::FileAttr {
    let never = std::time::UNIX_EPOCH;
    fuser::FileAttr {
        ino,
        size: 0,
        blocks: 0,
        atime: never,
        mtime: never,
        ctime: never,
        crtime: never,
        kind: FileType::Directory,
        perm: 0o755,
        nlink: 2,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}
