//! Sending a request again after its connection was lost.
//!
//! A request whose frame never fully left (`Lost::Unsent`) was never run by the brick: it is
//! simply sent on the new connection. A request that left before the connection died
//! (`Lost::InDoubt`) may or may not have been run, and the brick that restarted has no memory
//! of it. Each fop is made safe to repeat by what its second answer means:
//!
//! | fops | repeated as | an answer that means "the first one did it" |
//! |---|---|---|
//! | read, write (at an offset, marked or not), fsync, fstat, fsetattr, setattr, truncate, fallocate, discard, lookup, open, readdir, readlink, getxattr, listxattr, statfs, marks added, pending | the same request (idempotent) | — |
//! | unlink, rmdir, rename | the same request | `ENOENT` (the name is already gone) |
//! | removexattr | the same request | `ENODATA` |
//! | setxattr | the same request | `EEXIST` (with `XATTR_CREATE`) |
//! | mkdir, symlink, mknod, link | the same request | `EEXIST`; the reply is then the name's attributes (a lookup) |
//! | create | without `O_EXCL` (and `O_TRUNC`): it opens the file the first one made | — |
//! | heal's lock, session, info, handle; conditional mark clears | never: they belong to the connection | — (`ENOTCONN`) |
//!
//! The one case this cannot tell apart — another client made the same name between the lost
//! reply and the repeat — ends as if this client's call had won the race, which POSIX allows
//! for concurrent callers.

use kiln_proto::codec::Wire;
use kiln_proto::ops::*;
use kiln_proto::Op;

pub use kiln_proto::ops::Replay;

/// The replay rule of `op`: the fop table's ([`Op::replay`]).
pub fn of(op: Op) -> Replay {
    op.replay()
}

/// The name a [`Replay::Made`] fop makes, from its encoded arguments: the last path it names
/// (a link's new name, not the file it links to).
pub fn made_path(op: Op, args: &[u8]) -> Option<String> {
    kiln_layer::requests::named_paths(op, args)?.pop()
}

/// A create's arguments for its repeat: it must open what the first one may have made.
pub fn create_again(args: &[u8]) -> Option<Vec<u8>> {
    let mut r = CreateReq::from_wire(args).ok()?;
    r.flags &= !((libc::O_EXCL | libc::O_TRUNC) as u32);
    Some(r.to_wire())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every handle fop's request starts with the handle number, little-endian: the
    /// protocol-client patches it there when it reopens a handle on a new connection.
    #[test]
    fn handle_requests_begin_with_the_handle() {
        let fh = 0x1122_3344_5566_7788u64;
        let attrs = SetAttrs::default();
        let wires: Vec<(Op, Vec<u8>)> = vec![
            (
                Op::Read,
                ReadReq {
                    fh,
                    offset: 9,
                    len: 4,
                }
                .to_wire(),
            ),
            (Op::Write, WriteReq { fh, offset: 9 }.to_wire()),
            (Op::Fsync, FsyncReq { fh, datasync: true }.to_wire()),
            (Op::Release, HandleReq { fh }.to_wire()),
            (Op::Fstat, HandleReq { fh }.to_wire()),
            (Op::Fsetattr, FsetattrReq { fh, attrs }.to_wire()),
            (
                Op::Fallocate,
                FallocateReq {
                    fh,
                    mode: 0,
                    offset: 1,
                    len: 2,
                }
                .to_wire(),
            ),
            (
                Op::Discard,
                DiscardReq {
                    fh,
                    offset: 1,
                    len: 2,
                }
                .to_wire(),
            ),
        ];
        for (op, w) in wires {
            assert_eq!(op.by(), By::Handle, "{op:?}");
            assert_eq!(w[..8], fh.to_le_bytes(), "{op:?}");
        }
    }

    #[test]
    fn a_repeated_create_cannot_fail_on_its_own_file_or_empty_it() {
        let req = CreateReq {
            path: "a/b".into(),
            flags: (libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC | libc::O_RDWR) as u32,
            mode: 0o640,
        };
        let again = CreateReq::from_wire(&create_again(&req.to_wire()).unwrap()).unwrap();
        assert_eq!(again.flags, (libc::O_CREAT | libc::O_RDWR) as u32);
        assert_eq!((again.path.as_str(), again.mode), ("a/b", 0o640));
    }

    #[test]
    fn made_names_are_found_in_their_requests() {
        let l = LinkReq {
            existing: "x".into(),
            path: "y".into(),
        };
        assert_eq!(made_path(Op::Link, &l.to_wire()).as_deref(), Some("y"));
        let s = SymlinkReq {
            target: "t".into(),
            path: "s".into(),
        };
        assert_eq!(made_path(Op::Symlink, &s.to_wire()).as_deref(), Some("s"));
        assert_eq!(of(Op::Mkdir), Replay::Made);
        assert_eq!(of(Op::HealLock), Replay::Never);
        assert_eq!(of(Op::Write), Replay::Same);
    }
}
