//! The marks layer's fops: every change is gated by the locks, recorded in sessions, and
//! its misses marked; the replication control fops go to the control API.

use std::sync::Arc;

use crate::marks::{
    CondFlag, CondMark, FlagMark, HealInfo, HealReq, IndexPage, LockReq, Mark, MemberReq,
    MemberState, PendingPage,
};
use crate::{
    fail, Attr, Ctx, ExtentList, Fd, FopResult, Fut, IoBufs, Layer, LayerRef, LeaseState, ReadDst,
    ReadOut, SetAttrs, Written,
};
use kiln_proto::ops::{DirtyReq, SnapReq, DIRTY_GET, LEASE_ACQUIRE};
use kiln_proto::ops::{
    SETATTR_ATIME, SETATTR_ATIME_NOW, SETATTR_GID, SETATTR_MODE, SETATTR_MTIME, SETATTR_MTIME_NOW,
    SETATTR_SIZE, SETATTR_UID,
};
use kiln_proto::sync::MutexExt as _;

use super::aspect;
use super::locks::{span, Entered};
use super::*;

impl Layer for Marks {
    fn name(&self) -> &str {
        &self.name
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn children(&self) -> &[LayerRef] {
        &self.kids
    }

    fn lookup<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Attr> {
        if self.moved.has(path) {
            return fail(crate::errno::EMOVED);
        }
        self.child().lookup(cx, path)
    }

    fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(async move {
            if self.moved.has(path) {
                return Err(crate::errno::EMOVED);
            }
            let key = self.key(path);
            Marks::stopped(&key, cx.owner)?;
            let inner = if flags & libc::O_TRUNC as u32 != 0 {
                // Truncation changes every byte: sessions on the file record all of it.
                self.note_names(cx.owner, path, None);
                let id = Marks::enter(&key, cx.owner, 0, u64::MAX).await?;
                let _in = Entered { key: &key, id };
                self.child().open(cx, path, flags).await?
            } else {
                self.child().open(cx, path, flags).await?
            };
            Ok(Fd::new(MarkFd::new(
                key, inner, false, path, cx.owner, flags,
            )))
        })
    }

    fn heal_open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(async move {
            let inner = self.child().open(cx, path, flags).await?;
            Ok(Fd::new(MarkFd::new(
                self.key(path),
                inner,
                true,
                path,
                cx.owner,
                flags,
            )))
        })
    }

    fn mark_add<'a>(&'a self, _: &'a Ctx, path: &'a str, arg: &'a Mark) -> Fut<'a, ()> {
        ready(self.apply_mark(b'A', path, arg))
    }

    fn mark_clear<'a>(&'a self, _: &'a Ctx, path: &'a str, arg: &'a Mark) -> Fut<'a, ()> {
        ready(self.apply_mark(b'C', path, arg))
    }

    fn mark_clear_if<'a>(&'a self, _: &'a Ctx, path: &'a str, arg: &'a CondMark) -> Fut<'a, ()> {
        ready(self.apply_mark_clear(path, arg))
    }

    fn flag_add<'a>(&'a self, _: &'a Ctx, path: &'a str, arg: &'a FlagMark) -> Fut<'a, ()> {
        ready(self.apply_flag(path, arg))
    }

    fn flag_clear_if<'a>(&'a self, _: &'a Ctx, path: &'a str, arg: &'a CondFlag) -> Fut<'a, ()> {
        ready(self.apply_flag_clear(path, arg))
    }

    fn heal_lock<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a LockReq) -> Fut<'a, ()> {
        self.lock_req(cx.owner, path, arg)
    }

    fn heal_session<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a HealReq) -> Fut<'a, ()> {
        self.apply_session(cx.owner, path, arg)
    }

    fn pending<'a>(&'a self, _: &'a Ctx, path: &'a str, _: &'a ()) -> Fut<'a, PendingPage> {
        ready(Ok(self.pending_page(path)))
    }

    fn pending_index<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a ()) -> Fut<'a, IndexPage> {
        ready(Ok(self.index_page()))
    }

    fn heal_info<'a>(&'a self, cx: &'a Ctx, path: &'a str, _: &'a ()) -> Fut<'a, HealInfo> {
        ready(Ok(Marks::heal_info(self, cx.owner, path)))
    }

    fn member<'a>(&'a self, _: &'a Ctx, _: &'a str, arg: &'a MemberReq) -> Fut<'a, MemberState> {
        ready(self.membership(arg.op))
    }

    fn joining(&self) -> bool {
        self.joining.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn hangup(&self, owner: u64) {
        self.suspect_leftovers(owner);
        self.drop_leases(owner);
    }

    fn goodbye(&self, owner: u64) {
        self.forget_recent(owner);
    }

    fn create<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        flags: u32,
        mode: u32,
    ) -> Fut<'a, (Fd, Attr)> {
        self.moved.forget(path);
        Box::pin(async move {
            let key = self.key(path);
            // Truncating an existing file changes every byte: the lease, a barrier and the
            // dirty records see it as they see a write.
            let _in = match flags & libc::O_TRUNC as u32 {
                0 => None,
                _ => Some(Entered {
                    key: &key,
                    id: Marks::enter(&key, cx.owner, 0, u64::MAX).await?,
                }),
            };
            let (inner, attr) = self
                .named(cx, path, None, aspect::ENTRY, || {
                    self.child().create(cx, path, flags, mode)
                })
                .await?;
            let f = MarkFd::new(key.clone(), inner, false, path, cx.owner, flags);
            Ok((Fd::new(f), attr))
        })
    }

    fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        Box::pin(async move {
            let (inner, key) = {
                let mfd = unwrap(&fd)?;
                (mfd.inner.clone(), mfd.key.clone())
            };
            drop(fd);
            let r = self.child().release(cx, inner).await;
            // The path the key was made for is not kept; look it up by identity.
            let path = {
                let files = self.files.locked();
                files
                    .iter()
                    .find(|(_, k)| Arc::ptr_eq(k, &key))
                    .map(|(p, _)| p.clone())
            };
            if let Some(p) = path {
                self.forget(&p, &key);
            }
            r
        })
    }

    fn fstat<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, Attr> {
        match usable(fd, cx.owner) {
            Ok(f) => self.child().fstat(cx, &f.inner),
            Err(e) => fail(e),
        }
    }

    fn extents<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, at: u64, len: u64) -> Fut<'a, ExtentList> {
        match usable(fd, cx.owner) {
            Ok(f) => self.child().extents(cx, &f.inner, at, len),
            Err(e) => fail(e),
        }
    }

    fn lease<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        cmd: u32,
        ttl_ms: u32,
        holder: &'a str,
    ) -> Fut<'a, LeaseState> {
        match usable(fd, cx.owner) {
            Ok(f) if !f.writable && cmd == LEASE_ACQUIRE => fail(crate::errno::EBADF),
            Ok(f) if !f.heal => Box::pin(Marks::lease_req(
                &f.key, cx.owner, cmd, ttl_ms, holder, &f.path,
            )),
            Ok(_) => fail(crate::errno::EINVAL),
            Err(e) => fail(e),
        }
    }

    fn snap<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        cmd: u32,
        name: &'a str,
        to: &'a str,
        ttl_ms: u32,
    ) -> Fut<'a, crate::SnapReply> {
        let f = match usable(fd, cx.owner) {
            // A barrier holds writers back, a clone writes: a reader may do neither.
            Ok(f) if !f.writable => return fail(crate::errno::EBADF),
            Ok(f) if !f.heal => f,
            Ok(_) => return fail(crate::errno::EINVAL),
            Err(e) => return fail(e),
        };
        Box::pin(async move {
            let req = SnapReq {
                fh: 0,
                cmd,
                name: name.to_owned(),
                to: to.to_owned(),
                ttl_ms,
            };
            self.snap_req(cx, f, &req).await
        })
    }

    fn dirty<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        cmd: u32,
        name: &'a str,
        offset: u64,
        len: u64,
    ) -> Fut<'a, ExtentList> {
        let req = DirtyReq {
            fh: 0,
            cmd,
            name: name.to_owned(),
            offset,
            len,
        };
        ready(usable(fd, cx.owner).and_then(|f| {
            // Starting or stopping a record changes what others' backups copy.
            if !f.writable && cmd != DIRTY_GET {
                return Err(crate::errno::EBADF);
            }
            Marks::dirty_req(&f.key, &req)
        }))
    }

    fn backing<'f>(&self, cx: &Ctx, fd: &'f Fd) -> FopResult<&'f std::fs::File> {
        // A heal handle writes what clients skipped: never read around it.
        let f = usable(fd, cx.owner)?;
        if f.heal {
            return Err(crate::errno::EOPNOTSUPP);
        }
        // A file on its way to another subvolume: a reader past the brick could not follow
        // it (the move's freeze bumps every grant given before).
        if Marks::moving(&f.key, cx.owner) {
            return Err(libc::EBUSY as u32);
        }
        self.child().backing(cx, &f.inner)
    }

    fn backing_sums(&self, cx: &Ctx, fd: &Fd) -> FopResult<Option<std::fs::File>> {
        let f = usable(fd, cx.owner)?;
        self.child().backing_sums(cx, &f.inner)
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        match usable(fd, cx.owner) {
            Ok(f) => self.child().read(cx, &f.inner, offset, dst),
            Err(e) => fail(e),
        }
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        if let Some(f) = unwrap(fd).ok().filter(|f| f.heal) {
            return self.heal_write(cx, f, offset, data);
        }
        let (start, end) = span(offset, data.len() as u64);
        self.gated(cx, fd, start, end, move |inner| {
            self.child().write(cx, inner, offset, data)
        })
    }

    fn write_marked<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        offset: u64,
        data: IoBufs,
        missed: u32,
    ) -> Fut<'a, Written> {
        let f = match unwrap(fd) {
            Ok(f) if !f.heal => f,
            Ok(_) => return fail(crate::errno::EINVAL),
            Err(e) => return fail(e),
        };
        let len = data.len() as u64;
        Box::pin(async move {
            let w = self.write(cx, fd, offset, data).await?;
            // The replicas that missed the write miss all of it, whatever this one took: as
            // a MARK_ADD after the write would record.
            let ops: Vec<(u8, &str, u32, u64, u64)> = (0..u32::BITS)
                .filter(|t| missed & (1 << t) != 0)
                .map(|t| (b'A', f.path.as_str(), t, offset, len))
                .collect();
            if len > 0 && !ops.is_empty() {
                self.apply(&ops)?;
            }
            Ok(w)
        })
    }

    fn fsync<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, datasync: bool) -> Fut<'a, ()> {
        let f = match usable(fd, cx.owner) {
            Ok(f) => f,
            Err(e) => return fail(e),
        };
        Box::pin(async move {
            self.child().fsync(cx, &f.inner, datasync).await?;
            let dirty = self.store().dirty;
            if dirty {
                // A rare, small sync: the log is only written when a replica missed a change.
                self.sync_log()?;
            }
            Ok(())
        })
    }

    fn fsetattr<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        if attrs.valid & SETATTR_SIZE != 0 {
            let start = attrs.size;
            if let Some(f) = unwrap(fd).ok().filter(|f| f.heal) {
                // Heal sets the size only where no client changed anything since it began.
                return Box::pin(async move {
                    let (id, _) =
                        Marks::enter_heal(&f.key, cx.owner, start, u64::MAX, true).await?;
                    let _in = Entered { key: &f.key, id };
                    self.child().fsetattr(cx, &f.inner, attrs).await
                });
            }
            return self.gated(cx, fd, start, u64::MAX, move |inner| {
                self.child().fsetattr(cx, inner, attrs)
            });
        }
        match unwrap(fd) {
            Ok(f) if !f.heal => Box::pin(async move {
                self.note_names(cx.owner, &f.path, None);
                let id = Marks::enter_ns(&f.key, cx.owner, aspect::of_setattr(attrs.valid)).await?;
                let _in = Entered { key: &f.key, id };
                self.child().fsetattr(cx, &f.inner, attrs).await
            }),
            Ok(f) => self.child().fsetattr(cx, &f.inner, attrs),
            Err(e) => fail(e),
        }
    }

    fn setattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        if attrs.valid & SETATTR_SIZE == 0 {
            return self.named_setattr(cx, path, attrs);
        }
        Box::pin(async move {
            // A size change by name: heal compares the sizes if the connection dies.
            self.note_names(cx.owner, path, None);
            let key = self.key(path);
            let id = Marks::enter(&key, cx.owner, attrs.size, u64::MAX).await?;
            let r = self.child().setattr(cx, path, attrs).await;
            // Recorded while still in flight, as a change through a handle is.
            let ran = cx.change.as_ref().filter(|_| r.is_ok());
            Marks::leave_noting(&key, id, ran.map(|s| (s, attrs.size, u64::MAX)));
            drop(key);
            r
        })
    }

    fn fallocate<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Fut<'a, ()> {
        let (start, mut end) = span(offset, len);
        if mode & (libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE) as u32 != 0 {
            // Everything after the range moves.
            end = u64::MAX;
        }
        self.gated(cx, fd, start, end, move |inner| {
            self.child().fallocate(cx, inner, mode, offset, len)
        })
    }

    fn discard<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, len: u64) -> Fut<'a, ()> {
        let (start, end) = span(offset, len);
        self.gated(cx, fd, start, end, move |inner| {
            self.child().discard(cx, inner, offset, len)
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
        self.named(cx, path, None, aspect::XATTR, move || {
            self.child().setxattr(cx, path, name, value, flags)
        })
    }

    fn layout_set<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a Vec<u8>) -> Fut<'a, ()> {
        self.named(cx, path, None, aspect::XATTR, move || {
            self.child().layout_set(cx, path, arg)
        })
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, ()> {
        self.named(cx, path, None, aspect::XATTR, move || {
            self.child().removexattr(cx, path, name)
        })
    }

    fn unlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        self.named(cx, path, None, aspect::ENTRY, move || {
            Box::pin(async move {
                self.child().unlink(cx, path).await?;
                self.forget_dirty(path);
                self.drop_marks(path)
            })
        })
    }

    fn mkdir<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32) -> Fut<'a, Attr> {
        self.named(cx, path, None, aspect::ENTRY, move || {
            self.child().mkdir(cx, path, mode)
        })
    }

    fn rmdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        self.named(cx, path, None, aspect::ENTRY, move || {
            Box::pin(async move {
                self.child().rmdir(cx, path).await?;
                self.drop_marks(path)
            })
        })
    }

    fn symlink<'a>(&'a self, cx: &'a Ctx, target: &'a str, path: &'a str) -> Fut<'a, Attr> {
        self.moved.forget(path);
        self.named(cx, path, None, aspect::ENTRY, move || {
            self.child().symlink(cx, target, path)
        })
    }

    fn mknod<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32, rdev: u64) -> Fut<'a, Attr> {
        self.moved.forget(path);
        self.named(cx, path, None, aspect::ENTRY, move || {
            self.child().mknod(cx, path, mode, rdev)
        })
    }

    fn link<'a>(&'a self, cx: &'a Ctx, existing: &'a str, path: &'a str) -> Fut<'a, Attr> {
        self.moved.forget(path);
        self.named(cx, path, None, aspect::ENTRY, move || {
            self.child().link(cx, existing, path)
        })
    }

    fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
        self.moved.forget(to);
        self.named(cx, from, Some(to), aspect::ENTRY, move || {
            Box::pin(async move {
                self.child().rename(cx, from, to, flags).await?;
                self.forget_dirty(from);
                self.forget_dirty(to);
                self.rename_marks(from, to)
            })
        })
    }
}

impl Marks {
    /// A setattr without a size by name. Heal's, within its session, leaves out the
    /// attributes a client changed since the session began (the target's are newer).
    fn named_setattr<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        attrs: &'a SetAttrs,
    ) -> Fut<'a, Attr> {
        let touched = Marks::touched(&self.key(path), cx.owner);
        let aspects = aspect::of_setattr(attrs.valid);
        if touched & aspects == 0 {
            return self.named(cx, path, None, aspects, move || {
                self.child().setattr(cx, path, attrs)
            });
        }
        let mut keep = attrs.clone();
        for bit in [
            SETATTR_MODE,
            SETATTR_UID,
            SETATTR_GID,
            SETATTR_ATIME,
            SETATTR_MTIME,
            SETATTR_ATIME_NOW,
            SETATTR_MTIME_NOW,
        ] {
            if aspect::of_setattr(bit) & touched != 0 {
                keep.valid &= !bit;
            }
        }
        tracing::debug!(
            path,
            "heal leaves out attributes a client changed meanwhile"
        );
        Box::pin(async move {
            // Nothing it still sets was touched: `named` lets it through.
            let aspects = aspect::of_setattr(keep.valid);
            self.named(cx, path, None, aspects, || {
                self.child().setattr(cx, path, &keep)
            })
            .await
        })
    }
}

/// The handle behind `fd`, unless its file moved or is frozen for another connection's
/// migration ([`super::migrate`]).
fn usable(fd: &Fd, owner: u64) -> FopResult<&MarkFd> {
    let f = unwrap(fd)?;
    Marks::stopped(&f.key, owner)?;
    Ok(f)
}

/// A fop future for a result that is ready now.
fn ready<'a, T: Send + 'a>(r: FopResult<T>) -> Fut<'a, T> {
    Box::pin(std::future::ready(r))
}
