//! The fops of the shard layer: those by path that make, replace, cut or remove a sharded
//! file's pieces, those on handles routed to the base or split over pieces ([`super::io`]),
//! and the guard that keeps the shard directory and mark out of callers' sight.

use super::file::ShardFd;
use super::{hidden, inner, is_reg, Mark, Shard, EEXIST, ENODATA, ENOENT, EPERM, O_EXCL, O_TRUNC};
use super::{SHARD_DIR, SHARD_XATTR};
use crate::marks as m;
use crate::{
    errno, fail, Attr, Ctx, Extent, ExtentList, Fd, FopResult, Fut, IoBufs, Layer, LayerRef,
    LeaseState, ReadDst, ReadOut, ReaddirReply, SetAttrs, StatfsReply, Written,
};
use crate::{fan_out_fops, for_each_fop};

impl Shard {
    async fn do_open(&self, cx: &Ctx, path: &str, flags: u32) -> FopResult<Fd> {
        if hidden(path) {
            return Err(ENOENT);
        }
        let before = match flags & O_TRUNC {
            0 => None,
            _ => self.with_pieces(cx, path, false).await?,
        };
        let fd = self.kid().open(cx, path, flags).await?;
        let mark = match self.mark_of(cx, path).await {
            Ok(m) => m,
            Err(e) => {
                let _ = self.kid().release(cx, fd).await;
                return Err(e);
            }
        };
        self.drop_past(cx, before, 0).await;
        Ok(ShardFd::wrap(fd, mark, flags))
    }

    async fn do_create(
        &self,
        cx: &Ctx,
        path: &str,
        flags: u32,
        mode: u32,
    ) -> FopResult<(Fd, Attr)> {
        if hidden(path) {
            return Err(EPERM);
        }
        let before = match flags & (O_TRUNC | O_EXCL) {
            O_TRUNC => self.with_pieces(cx, path, false).await?,
            _ => None,
        };
        // Made by this create (O_EXCL first), it is marked; one that was there keeps the
        // mark it has, or none: a handle open on it elsewhere writes it whole.
        let made = match flags & O_EXCL {
            0 => self.kid().create(cx, path, flags | O_EXCL, mode).await,
            _ => self.kid().create(cx, path, flags, mode).await,
        };
        let (fd, attr, made) = match made {
            Ok((fd, attr)) => (fd, attr, true),
            Err(EEXIST) if flags & O_EXCL == 0 => {
                let (fd, attr) = self.kid().create(cx, path, flags, mode).await?;
                (fd, attr, false)
            }
            Err(e) => return Err(e),
        };
        let mark = match made {
            true => self.mark_new(cx, path, &attr).await,
            false => self.mark_of(cx, path).await,
        };
        let mark = match mark {
            Ok(m) => m,
            Err(e) => {
                let _ = self.kid().release(cx, fd).await;
                return Err(e);
            }
        };
        self.drop_past(cx, before, 0).await;
        Ok((ShardFd::wrap(fd, mark, flags), attr))
    }

    /// Marks a file just created (or opened by create), unless it is one that was made whole
    /// and has grown past a piece; the mark it has if it had one.
    async fn mark_new(&self, cx: &Ctx, path: &str, attr: &Attr) -> FopResult<Option<Mark>> {
        if !is_reg(attr) || attr.size > self.block {
            return self.mark_of(cx, path).await;
        }
        let m = Mark::new(self.block)?;
        let (icx, v) = (inner(cx), m.encode());
        let set = self
            .kid()
            .setxattr(&icx, path, SHARD_XATTR, &v, libc::XATTR_CREATE as u32);
        match set.await {
            Ok(()) => Ok(Some(m)),
            Err(EEXIST) => self.mark_of(cx, path).await,
            Err(e) => Err(e),
        }
    }

    async fn do_unlink(&self, cx: &Ctx, path: &str) -> FopResult<()> {
        if hidden(path) {
            return Err(ENOENT);
        }
        let pieces = self.with_pieces(cx, path, true).await?;
        self.kid().unlink(cx, path).await?;
        self.drop_past(cx, pieces, 0).await;
        Ok(())
    }

    async fn do_rename(&self, cx: &Ctx, from: &str, to: &str, flags: u32) -> FopResult<()> {
        if hidden(from) || hidden(to) {
            return Err(EPERM);
        }
        let replaces = flags & (libc::RENAME_EXCHANGE | libc::RENAME_NOREPLACE) == 0;
        let mut pieces = None;
        if replaces {
            pieces = self.with_pieces(cx, to, true).await?;
            // The same file under both names: rename changes nothing.
            if pieces.is_some()
                && self.kid().lookup(cx, from).await?.ino == self.kid().lookup(cx, to).await?.ino
            {
                pieces = None;
            }
        }
        self.kid().rename(cx, from, to, flags).await?;
        self.drop_past(cx, pieces, 0).await;
        Ok(())
    }

    async fn do_setattr(&self, cx: &Ctx, path: &str, attrs: &SetAttrs) -> FopResult<Attr> {
        if hidden(path) {
            return Err(ENOENT);
        }
        if attrs.valid & kiln_proto::ops::SETATTR_SIZE == 0 {
            return self.kid().setattr(cx, path, attrs).await;
        }
        let pieces = self.with_pieces(cx, path, false).await?;
        let a = self.kid().setattr(cx, path, attrs).await?;
        self.drop_past(cx, pieces, attrs.size).await;
        Ok(a)
    }

    async fn do_readdir(
        &self,
        cx: &Ctx,
        path: &str,
        offset: u64,
        max: u32,
    ) -> FopResult<ReaddirReply> {
        if hidden(path) {
            return Err(ENOENT);
        }
        let mut r = self.kid().readdir(cx, path, offset, max).await?;
        if path.is_empty() {
            r.entries.0.retain(|e| e.name != SHARD_DIR);
        }
        Ok(r)
    }
}

/// Fails fops on hidden paths with `$e`, else forwards them.
macro_rules! guarded {
    ($self:ident, $path:expr, $e:expr, $call:expr) => {
        if hidden($path) {
            fail($e)
        } else {
            $call
        }
    };
}

/// Layer methods for fops a plain (unsplit) file passes on and a split one refuses.
macro_rules! on_plain_file {
    ($( $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty; )*) => {$(
        fn $name<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, $($arg: $ty),*) -> Fut<'a, $ret> {
            match fd.get::<ShardFd>() {
                Err(e) => fail(e),
                Ok(ShardFd::Plain(f)) => self.kid().$name(cx, f, $($arg),*),
                Ok(ShardFd::Split(_)) => fail(errno::EOPNOTSUPP),
            }
        }
    )*};
}

impl Layer for Shard {
    fn name(&self) -> &str {
        &self.name
    }

    fn children(&self) -> &[LayerRef] {
        &self.kids
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn pin_local<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, std::os::fd::OwnedFd> {
        match fd.get::<ShardFd>() {
            Ok(ShardFd::Plain(f)) => self.kid().pin_local(cx, f),
            // Pieces on several bricks: no one file to read.
            Ok(ShardFd::Split(_)) => fail(crate::errno::EOPNOTSUPP),
            Err(e) => fail(e),
        }
    }

    for_each_fop!(fan_out_fops);
}

// Every fop, each said where it goes (see `FanOut`): a new fop does not compile until it is.
impl crate::FanOut for Shard {
    fn lookup<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Attr> {
        guarded!(self, path, ENOENT, self.kid().lookup(cx, path))
    }

    fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(self.do_open(cx, path, flags))
    }

    fn heal_open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(async move {
            let fd = self.kid().heal_open(cx, path, flags).await?;
            Ok(ShardFd::wrap(fd, None, flags))
        })
    }

    fn create<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        flags: u32,
        mode: u32,
    ) -> Fut<'a, (Fd, Attr)> {
        Box::pin(self.do_create(cx, path, flags, mode))
    }

    fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        Box::pin(async move {
            match fd.get::<ShardFd>()? {
                ShardFd::Plain(f) => self.kid().release(cx, f.clone()).await,
                ShardFd::Split(p) => self.release_pieces(cx, p).await,
            }
        })
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().read(cx, f, offset, dst),
            Ok(ShardFd::Split(p)) => Box::pin(self.read_split(cx, p, offset, dst)),
        }
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().write(cx, f, offset, data),
            Ok(ShardFd::Split(p)) => Box::pin(self.write_split(cx, p, offset, data)),
        }
    }

    fn write_marked<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        offset: u64,
        data: IoBufs,
        missed: u32,
    ) -> Fut<'a, Written> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().write_marked(cx, f, offset, data, missed),
            // Only a brick's heal writes with marks, through no shard layer.
            Ok(ShardFd::Split(_)) => fail(errno::EINVAL),
        }
    }

    fn fstat<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, Attr> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(f) => self.kid().fstat(cx, f.base()),
        }
    }

    fn fsetattr<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Split(p)) if attrs.valid & kiln_proto::ops::SETATTR_SIZE != 0 => {
                Box::pin(self.truncate(cx, p, attrs))
            }
            Ok(f) => self.kid().fsetattr(cx, f.base(), attrs),
        }
    }

    fn fsync<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, datasync: bool) -> Fut<'a, ()> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().fsync(cx, f, datasync),
            Ok(ShardFd::Split(p)) => Box::pin(self.sync_pieces(cx, p, datasync)),
        }
    }

    fn fallocate<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Fut<'a, ()> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().fallocate(cx, f, mode, offset, len),
            Ok(ShardFd::Split(p)) => Box::pin(self.allocate_split(cx, p, mode, offset, len)),
        }
    }

    fn discard<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, len: u64) -> Fut<'a, ()> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().discard(cx, f, offset, len),
            Ok(ShardFd::Split(p)) => Box::pin(self.discard_split(cx, p, offset, len)),
        }
    }

    fn extents<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, at: u64, len: u64) -> Fut<'a, ExtentList> {
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().extents(cx, f, at, len),
            // Not asked of every shard: all data, which reads right.
            Ok(ShardFd::Split(_)) => {
                let run = Extent { len, hole: false };
                Box::pin(std::future::ready(Ok(ExtentList {
                    size: u64::MAX,
                    runs: kiln_proto::codec::Seq(vec![run]),
                })))
            }
        }
    }

    // An image's lease and dirty records: a split file's shards would each need them, which
    // is not offered yet.
    on_plain_file! {
        lease(cmd: u32, ttl_ms: u32, holder: &'a str) -> LeaseState;
        dirty(cmd: u32, name: &'a str, at: u64, len: u64) -> ExtentList;
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
        if hidden(to) {
            // A clone among the shards would be taken for a piece of another file.
            return fail(EPERM);
        }
        match fd.get::<ShardFd>() {
            Err(e) => fail(e),
            Ok(ShardFd::Plain(f)) => self.kid().snap(cx, f, cmd, name, to, ttl_ms),
            Ok(ShardFd::Split(_)) => fail(errno::EOPNOTSUPP),
        }
    }

    fn setattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        Box::pin(self.do_setattr(cx, path, attrs))
    }

    fn unlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        Box::pin(self.do_unlink(cx, path))
    }

    fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
        Box::pin(self.do_rename(cx, from, to, flags))
    }

    fn readdir<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        offset: u64,
        max: u32,
    ) -> Fut<'a, ReaddirReply> {
        Box::pin(self.do_readdir(cx, path, offset, max))
    }

    fn mkdir<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32) -> Fut<'a, Attr> {
        guarded!(self, path, EPERM, self.kid().mkdir(cx, path, mode))
    }

    fn rmdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        guarded!(self, path, EPERM, self.kid().rmdir(cx, path))
    }

    fn symlink<'a>(&'a self, cx: &'a Ctx, target: &'a str, path: &'a str) -> Fut<'a, Attr> {
        guarded!(self, path, EPERM, self.kid().symlink(cx, target, path))
    }

    fn mknod<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32, rdev: u64) -> Fut<'a, Attr> {
        guarded!(self, path, EPERM, self.kid().mknod(cx, path, mode, rdev))
    }

    fn link<'a>(&'a self, cx: &'a Ctx, existing: &'a str, path: &'a str) -> Fut<'a, Attr> {
        if hidden(existing) {
            return fail(EPERM);
        }
        guarded!(self, path, EPERM, self.kid().link(cx, existing, path))
    }

    fn readlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, String> {
        guarded!(self, path, ENOENT, self.kid().readlink(cx, path))
    }

    fn getxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, Vec<u8>> {
        if name == SHARD_XATTR {
            return fail(ENODATA);
        }
        guarded!(self, path, ENOENT, self.kid().getxattr(cx, path, name))
    }

    fn setxattr<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        name: &'a str,
        value: &'a [u8],
        flags: u32,
    ) -> Fut<'a, ()> {
        if name == SHARD_XATTR {
            return fail(EPERM);
        }
        guarded!(
            self,
            path,
            ENOENT,
            self.kid().setxattr(cx, path, name, value, flags)
        )
    }

    fn listxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Vec<String>> {
        if hidden(path) {
            return fail(ENOENT);
        }
        Box::pin(async move {
            let mut names = self.kid().listxattr(cx, path).await?;
            names.retain(|n| n != SHARD_XATTR);
            Ok(names)
        })
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, ()> {
        if name == SHARD_XATTR {
            return fail(EPERM);
        }
        guarded!(self, path, ENOENT, self.kid().removexattr(cx, path, name))
    }

    // The volume's, or the base file's by its name: the one child's (the pieces' directory is
    // not the caller's to name).
    fn syncdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        guarded!(self, path, ENOENT, self.kid().syncdir(cx, path))
    }

    fn statfs<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, StatfsReply> {
        guarded!(self, path, ENOENT, self.kid().statfs(cx, path))
    }

    fn layout_get<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a ()) -> Fut<'a, Vec<u8>> {
        self.kid().layout_get(cx, path, arg)
    }

    fn layout_set<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a Vec<u8>) -> Fut<'a, ()> {
        self.kid().layout_set(cx, path, arg)
    }

    fn heal_session<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a m::HealReq) -> Fut<'a, ()> {
        self.kid().heal_session(cx, path, arg)
    }

    fn heal_info<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a ()) -> Fut<'a, m::HealInfo> {
        self.kid().heal_info(cx, path, arg)
    }

    fn mark_add<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a m::Mark) -> Fut<'a, ()> {
        self.kid().mark_add(cx, path, arg)
    }

    fn mark_clear<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a m::Mark) -> Fut<'a, ()> {
        self.kid().mark_clear(cx, path, arg)
    }

    fn mark_clear_if<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        arg: &'a m::CondMark,
    ) -> Fut<'a, ()> {
        self.kid().mark_clear_if(cx, path, arg)
    }

    fn flag_add<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a m::FlagMark) -> Fut<'a, ()> {
        self.kid().flag_add(cx, path, arg)
    }

    fn flag_clear_if<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        arg: &'a m::CondFlag,
    ) -> Fut<'a, ()> {
        self.kid().flag_clear_if(cx, path, arg)
    }

    fn heal_lock<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a m::LockReq) -> Fut<'a, ()> {
        self.kid().heal_lock(cx, path, arg)
    }

    fn pending<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a ()) -> Fut<'a, m::PendingPage> {
        self.kid().pending(cx, path, arg)
    }

    fn pending_index<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        arg: &'a (),
    ) -> Fut<'a, m::IndexPage> {
        self.kid().pending_index(cx, path, arg)
    }

    fn member<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        arg: &'a m::MemberReq,
    ) -> Fut<'a, m::MemberState> {
        self.kid().member(cx, path, arg)
    }
}
