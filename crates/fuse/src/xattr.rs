//! Extended attributes through the mount, and what it answers without asking a brick.
//!
//! `ls -l` asks every entry for two attributes (`security.selinux` and
//! `system.posix_acl_access`); asked of the brick, that was 72 µs an entry, two thirds of a
//! cold `ls -lR`. So:
//! - `security.*`: Kiln refuses to set them (on a brick they are the brick host's security
//!   labels, which mean nothing to a client); the mount reads and lists none, without asking.
//! - An entry that `readdirplus` listed, and whose brick said it has no extended attributes a
//!   client may see: `getxattr` answers `ENODATA` and `listxattr` an empty list without asking,
//!   until the entry's attribute timeout — the bound the kernel keeps its attributes for. A set
//!   or remove through this mount forgets that at once; another client's is seen after the
//!   timeout at the latest.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Mutex;
use std::time::Instant;

use fuser::{Errno, INodeNo, ReplyEmpty, ReplyXattr, Request};
use kiln_client::block_on;

use crate::convert::errno;
use crate::KilnFs;

/// Inodes known to have no extended attributes a client may see, and until when.
#[derive(Default)]
pub(crate) struct NoXattrs(Mutex<HashMap<u64, Instant>>);

impl NoXattrs {
    /// Entries remembered at most; the table is emptied when it grows past this.
    const KEEP: usize = 1 << 20;

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Instant>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A listing said inode `ino` has (`has`) or has no extended attributes; trusted until
    /// `until`.
    pub(crate) fn listed(&self, ino: u64, has: bool, until: Instant) {
        let mut m = self.map();
        if has {
            m.remove(&ino);
            return;
        }
        if m.len() >= Self::KEEP {
            m.clear();
        }
        m.insert(ino, until);
    }

    fn none(&self, ino: u64) -> bool {
        let mut m = self.map();
        match m.get(&ino) {
            Some(until) if Instant::now() < *until => true,
            Some(_) => {
                m.remove(&ino);
                false
            }
            None => false,
        }
    }

    fn forget(&self, ino: u64) {
        self.map().remove(&ino);
    }
}

/// Names the mount never shows.
fn hidden(name: &str) -> bool {
    name.starts_with("security.")
}

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
    pub(crate) fn xattr_set(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        reply: ReplyEmpty,
    ) {
        let (path, name) = match self.path_and_name(ino, name) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        self.no_xattrs.forget(ino.0);
        match block_on(self.caller(req).setxattr(&path, name, value, flags as u32)) {
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
        if hidden(name) || self.no_xattrs.none(ino.0) {
            return reply.error(Errno::from_i32(libc::ENODATA));
        }
        match block_on(self.caller(req).getxattr(&path, name)) {
            Ok(v) => sized(reply, &v, size),
            Err(e) => reply.error(errno(e)),
        }
    }

    pub(crate) fn xattr_list(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let path = match self.path(ino) {
            Ok(p) => p,
            Err(e) => return reply.error(e),
        };
        if self.no_xattrs.none(ino.0) {
            return sized(reply, &[], size);
        }
        match block_on(self.caller(req).listxattr(&path)) {
            Ok(names) => {
                let mut buf = Vec::new();
                for n in names.iter().filter(|n| !hidden(n)) {
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
        let (path, name) = match self.path_and_name(ino, name) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        self.no_xattrs.forget(ino.0);
        match block_on(self.caller(req).removexattr(&path, name)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }
}
