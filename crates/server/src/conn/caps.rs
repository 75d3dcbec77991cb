//! An identity's capabilities applied to each request before it runs (see
//! [`crate::identity`]): whose credentials it runs with, whether it may change anything, and
//! whether its paths lie in the identity's subtree. A connection whose identity may do
//! everything (root, as-caller, read-write, whole volume, devices) skips all of it.

use kiln_proto::codec::Dec;
use kiln_proto::ops::*;
use kiln_proto::{errno, Op};

use crate::identity::{Caps, Place};

use super::*;

/// True when `caps` restrict nothing: requests run as today, unchecked.
pub(super) fn unrestricted(caps: &Caps) -> bool {
    caps.root
        && caps.devices
        && !caps.read_only
        && caps.subtree.is_empty()
        && caps.users == crate::identity::Users::AsCaller
}

impl Conn {
    /// Applies the connection's capabilities to `op` (arguments `args`, credentials taken
    /// off): maps the caller's credentials into `cx`, and refuses what the identity may not
    /// do, with the errno the caller gets.
    pub(super) fn apply_caps(&self, op: Op, args: &[u8], cx: &mut Ctx) -> Result<(), Errno> {
        let caps = &*self.caps;
        cx.devices = caps.devices;
        if self.unrestricted {
            return Ok(());
        }
        if op == Op::Mknod && !caps.devices && makes_device(args) {
            // Also when it runs as the brick's own (an identity with root, no credentials).
            return Err(self.refused(op, "device nodes need the devices capability", errno::EPERM));
        }
        if op.acts_for_caller() {
            cx.cred = caps.map_cred(cx.cred.as_deref()).map(Arc::new);
        }
        if op == Op::HealOpen && !caps.root {
            return Err(self.refused(op, "heal opens are kilnd's own (root)", errno::EPERM));
        }
        if caps.read_only && changes(op, args) {
            return Err(self.refused(op, "a read-only identity", errno::EROFS));
        }
        if caps.subtree.is_empty() {
            return Ok(());
        }
        cx.subtree = self.subtree.clone();
        let mut outside = false;
        let each = |p: &str| match caps.place(p) {
            Place::Inside => {}
            Place::OnTheWay if matches!(op, Op::Lookup | Op::Statfs) => {}
            _ => outside = true,
        };
        if paths(op, args, each).is_err() {
            // The fop itself refuses arguments that do not decode.
            return Ok(());
        }
        if outside {
            return Err(self.refused(op, "a path outside the identity's subtree", errno::EACCES));
        }
        Ok(())
    }

    fn refused(&self, op: Op, why: &str, e: Errno) -> Errno {
        tracing::info!(peer = %self.peer, identity = self.identity_name(), op = op.name(), "refused: {why}");
        e
    }
}

/// True for a MKNOD of a character or block device.
fn makes_device(args: &[u8]) -> bool {
    MknodReq::from_wire(args).is_ok_and(|r| {
        let t = r.mode & libc::S_IFMT;
        t == libc::S_IFCHR || t == libc::S_IFBLK
    })
}

/// True for requests that change a file, a name, an attribute or the brick's records of
/// them.
fn changes(op: Op, args: &[u8]) -> bool {
    use Op::*;
    match op {
        Setattr | Create | Write | WriteMarked | Unlink | Mkdir | Rmdir | Rename | Symlink
        | Mknod | Link | Setxattr | Removexattr | Fallocate | Discard | Fsetattr | MarkAdd
        | MarkClear | MarkClearIf | FlagAdd | FlagClearIf | HealLock | HealSession | HealOpen
        | LayoutSet | Snap => true,
        Open => OpenReq::from_wire(args).map_or(true, |r| {
            let acc = r.flags & libc::O_ACCMODE as u32;
            acc != libc::O_RDONLY as u32 || r.flags & libc::O_TRUNC as u32 != 0
        }),
        Lease => LeaseReq::from_wire(args).map_or(true, |r| r.cmd != LEASE_QUERY),
        Dirty => DirtyReq::from_wire(args).map_or(true, |r| r.cmd != DIRTY_GET),
        Member => {
            let (_, m) =
                <(String, kiln_proto::marks::MemberReq)>::from_wire(args).unwrap_or_default();
            m.op != kiln_proto::marks::MEMBER_ASK
        }
        // Named one by one: a new fop does not compile until it is classed here.
        Hello | Lookup | Fstat | Read | Fsync | Release | Readdir | Readlink | Statfs
        | Getxattr | Listxattr | Auth | Profile | Mgmt | Pending | PendingIndex | HealInfo
        | LayoutGet | Grant | LocalRead | Watch | Extents | Bye | Ping | Syncdir => false,
    }
}

/// Calls `each` with every path `op`'s arguments name.
fn paths(op: Op, args: &[u8], mut each: impl FnMut(&str)) -> Result<(), kiln_proto::DecodeError> {
    use Op::*;
    match op {
        Rename => {
            let r = RenameReq::from_wire(args)?;
            each(&r.from);
            each(&r.to);
        }
        Link => {
            let r = LinkReq::from_wire(args)?;
            each(&r.existing);
            each(&r.path);
        }
        Symlink => each(&SymlinkReq::from_wire(args)?.path),
        Snap => {
            let r = SnapReq::from_wire(args)?;
            if !r.to.is_empty() {
                each(&r.to);
            }
        }
        // Every other fop that names a path names it first (control fops: `(path, arg)`).
        Lookup | Setattr | Open | Create | Unlink | Mkdir | Rmdir | Readdir | Mknod | Readlink
        | Statfs | Getxattr | Setxattr | Listxattr | Removexattr | HealOpen | MarkAdd
        | MarkClear | MarkClearIf | FlagAdd | FlagClearIf | HealLock | HealSession | Pending
        | PendingIndex | HealInfo | LayoutGet | LayoutSet | Member | Syncdir => {
            let mut d = Dec::new(args);
            each(&String::decode(&mut d)?);
        }
        // Fops on a handle (opened, and so checked, by name) or naming no path. Named one by
        // one: a new fop does not compile until it is classed here.
        Hello | Fstat | Read | Write | Fsync | Release | Fallocate | Discard | Fsetattr | Auth
        | Profile | Mgmt | WriteMarked | Grant | LocalRead | Watch | Extents | Lease | Dirty
        | Bye | Ping => {}
    }
    Ok(())
}
