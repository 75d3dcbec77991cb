//! Extended attributes through the mount, and what it answers without asking a brick.
//!
//! `ls -l` asks every entry for two attributes (`security.selinux` and
//! `system.posix_acl_access`); asked of the brick, that was 72 µs an entry, two thirds of a
//! cold `ls -lR`. So:
//! - `security.*`: not supported (on a brick they are the brick host's security labels, which
//!   mean nothing to a client): reading, setting or removing one is `EOPNOTSUPP`, answered
//!   without asking, and listings leave them out. `ls` takes the `EOPNOTSUPP` to mean the whole
//!   file system has no labels and stops asking.
//! - POSIX ACLs (`system.posix_acl_*`) the same, unless the mount was made with `--acl`: then
//!   they are stored on the bricks and the kernel enforces and caches them (`FUSE_POSIX_ACL`).
//!   Off, `ls -l` asks once per mount instead of once per entry, and `setfacl` says "Operation
//!   not supported", as on a local file system mounted without ACLs.
//! - An entry that `readdirplus` listed, and whose brick said it has no extended attributes a
//!   client may see: `getxattr` answers `ENODATA` and `listxattr` an empty list without asking,
//!   until the attribute timeout counted from when the listing was fetched — the bound the
//!   kernel keeps attributes for — and only to the caller the listing was fetched for (the
//!   brick may refuse another the file's attributes: it answers them). A set or remove through this mount forgets that at once (and
//!   a listing fetched before it cannot bring it back); another client's is seen after the
//!   timeout at the latest. Directories are always asked (their copies on several bricks may
//!   differ), and so are replicated volumes' files (replicate lists one replica).

use rustc_hash::FxHashMap as HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kiln_proto::sync::MutexExt as _;
use kiln_proto::Cred;

use crate::gate::block_on;
use fuser::{Errno, INodeNo, ReplyEmpty, ReplyXattr, Request};

use crate::callers::same_caller;
use crate::convert::errno;
use crate::KilnFs;

/// Inodes known to have no extended attributes a client may see, until when, and to whom
/// (the caller whose listing said so); and a count of this mount's xattr changes, so that a
/// listing fetched before one cannot undo it.
#[derive(Default)]
pub(crate) struct NoXattrs {
    until: Mutex<HashMap<u64, (Instant, Arc<Cred>)>>,
    changes: AtomicU64,
}

/// Taken before a listing is fetched: until when what it says holds, the changes count, and
/// whom it is fetched for.
pub(crate) struct Seen {
    until: Instant,
    changes: u64,
    who: Arc<Cred>,
}

impl NoXattrs {
    /// Entries remembered at most; the table is emptied when it grows past this.
    const KEEP: usize = 1 << 20;

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (Instant, Arc<Cred>)>> {
        self.until.locked()
    }

    /// Call before fetching a listing for `who` whose entries are then trusted for `ttl`.
    pub(crate) fn seen(&self, ttl: std::time::Duration, who: &Arc<Cred>) -> Seen {
        Seen {
            until: Instant::now() + ttl,
            changes: self.changes.load(Ordering::Acquire),
            who: who.clone(),
        }
    }

    /// A listing (`seen` before it was fetched) said each inode has (true) or has no extended
    /// attributes. "None" is not taken from a listing older than a change made here.
    pub(crate) fn listed(&self, entries: impl Iterator<Item = (u64, bool)>, seen: &Seen) {
        let mut m = self.map();
        let trusted =
            seen.changes == self.changes.load(Ordering::Acquire) && Instant::now() < seen.until;
        for (ino, has) in entries {
            if has {
                m.remove(&ino);
            } else if trusted {
                if m.len() >= Self::KEEP {
                    m.clear();
                }
                m.insert(ino, (seen.until, seen.who.clone()));
            }
        }
    }

    /// True when `ino` is known to have no extended attributes, and `who` may be told so.
    fn none(&self, ino: u64, who: &Cred) -> bool {
        let mut m = self.map();
        match m.get(&ino) {
            Some((until, by)) if Instant::now() < *until => same_caller(by, who),
            Some(_) => {
                m.remove(&ino);
                false
            }
            None => false,
        }
    }

    /// This mount changes `ino`'s extended attributes: call before and after.
    fn forget(&self, ino: u64) {
        let mut m = self.map();
        self.changes.fetch_add(1, Ordering::AcqRel);
        m.remove(&ino);
    }

    /// Nothing is known of `ino` any more (a lookup gave it a name: perhaps a new file).
    pub(crate) fn drop_entry(&self, ino: u64) {
        self.map().remove(&ino);
    }
}

/// The ACL attributes' prefix.
const ACL_PREFIX: &str = "system.posix_acl_";

/// Answers an xattr read of `size` bytes (0: the size) with `data`.
fn sized(reply: ReplyXattr, data: &[u8], size: u32) {
    if size == 0 {
        reply.size(data.len() as u32)
    } else if data.len() > size as usize {
        reply.error(Errno::from_i32(libc::ERANGE))
    } else {
        reply.data(data)
    }
}

impl KilnFs {
    /// Whether the mount supports attribute `name` (see the module's notes).
    fn supported(&self, name: &str) -> bool {
        !(name.starts_with("security.") || (!self.acl && name.starts_with(ACL_PREFIX)))
    }

    pub(crate) fn xattr_set(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        reply: ReplyEmpty,
    ) {
        let (path, name) = match self.xattr_changing(ino, name) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let r = block_on(self.caller(req).setxattr(&path, name, value, flags as u32));
        self.xattr_changed(ino, r, reply)
    }

    /// Before a set or remove of `ino`'s attribute `name`: its path and the name, once it is
    /// known to be supported and the "none" answer is forgotten.
    fn xattr_changing<'n>(
        &self,
        ino: INodeNo,
        name: &'n OsStr,
    ) -> Result<(String, &'n str), Errno> {
        let (path, name) = self.path_and_name(ino, name)?;
        if !self.supported(name) {
            return Err(Errno::from_i32(libc::EOPNOTSUPP));
        }
        self.no_xattrs.forget(ino.0);
        Ok((path, name))
    }

    /// After a set or remove: forgets "none" again (a listing may have raced it) and replies.
    fn xattr_changed(&self, ino: INodeNo, r: std::io::Result<()>, reply: ReplyEmpty) {
        self.no_xattrs.forget(ino.0);
        self.touched(ino.0);
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    pub(crate) fn xattr_get(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: ReplyXattr,
    ) {
        let (path, name) = match self.path_and_name(ino, name) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        if !self.supported(name) {
            return reply.error(Errno::from_i32(libc::EOPNOTSUPP));
        }
        let (caller, who) = self.asking(req);
        if self.no_xattrs.none(ino.0, &who) {
            return reply.error(Errno::from_i32(libc::ENODATA));
        }
        match block_on(caller.getxattr(&path, name)) {
            Ok(v) => sized(reply, &v, size),
            Err(e) => reply.error(errno(e)),
        }
    }

    pub(crate) fn xattr_list(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let path = match self.path(ino) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        let (caller, who) = self.asking(req);
        if self.no_xattrs.none(ino.0, &who) {
            return sized(reply, &[], size);
        }
        match block_on(caller.listxattr(&path)) {
            Ok(names) => {
                let mut buf = Vec::new();
                for n in names.iter().filter(|n| self.supported(n)) {
                    buf.extend_from_slice(n.as_bytes());
                    buf.push(0);
                }
                sized(reply, &buf, size)
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    pub(crate) fn xattr_remove(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        reply: ReplyEmpty,
    ) {
        let (path, name) = match self.xattr_changing(ino, name) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let r = block_on(self.caller(req).removexattr(&path, name));
        self.xattr_changed(ino, r, reply)
    }
}
