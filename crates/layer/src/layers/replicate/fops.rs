//! Replicate's fops: where each goes — reads to one replica, changes to every replica that
//! is up (and what one missed recorded), and what addresses one brick refused.

use super::*;

// Every fop, each said where it goes (see `FanOut`): a new fop does not compile until it is.
impl crate::FanOut for Replicate {
    fn heal_session<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a m::HealReq) -> Fut<'a, ()> {
        Box::pin(self.session_all(cx, path, arg))
    }

    fn heal_info<'a>(&'a self, cx: &'a Ctx, path: &'a str, _: &'a ()) -> Fut<'a, m::HealInfo> {
        Box::pin(self.info_all(cx, path))
    }

    fn lookup<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Attr> {
        self.query_path(path, move |k| k.lookup(cx, path))
    }

    fn open<'a>(&'a self, cx: &'a Ctx, path: &'a str, flags: u32) -> Fut<'a, Fd> {
        Box::pin(self.patiently(move || Box::pin(self.open_once(cx, path, flags))))
    }

    fn create<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        flags: u32,
        mode: u32,
    ) -> Fut<'a, (Fd, Attr)> {
        Box::pin(async move {
            let run = |i: usize| self.kids[i].create(cx, path, flags, mode);
            let res = self.on_quorum(&run).await;
            let state = self.state(path);
            let settled = self
                .settle(cx, path, Some(&state), &outcomes(&res), create_miss())
                .await;
            let mut kids = Vec::with_capacity(self.kids.len());
            let mut attr = None;
            for r in res {
                kids.push(Mutex::new(match r {
                    Some(Ok((fd, a))) => {
                        attr.get_or_insert(a);
                        ChildFd::Open(fd)
                    }
                    Some(Err(_)) => ChildFd::Missing,
                    None => ChildFd::Absent,
                }));
            }
            let rfd = RepFd {
                prefer: self.pick_preferred(),
                path: path.to_owned(),
                flags,
                kids,
                state,
            };
            if let Err(e) = settled {
                for i in 0..self.kids.len() {
                    if let Some(fd) = self.child_fd(&rfd, i) {
                        let _ = self.kids[i].release(cx, fd).await;
                    }
                }
                return Err(e);
            }
            Ok((Fd::new(rfd), attr.expect("a quorum created it")))
        })
    }

    fn read<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, dst: ReadDst) -> Fut<'a, ReadOut> {
        let rfd = try_rep!(fd);
        Box::pin(self.read_one(cx, rfd, offset, dst))
    }

    fn write<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, data: IoBufs) -> Fut<'a, Written> {
        let rfd = try_rep!(fd);
        Box::pin(async move {
            let len = data.len();
            // Replicas behind for the file may become current for this range ([`current`]);
            // not one without the file (a new brick before heal made it): it takes no write.
            let mut behind = rfd.state.bad.load(Relaxed);
            let gone = if behind != 0 { missing(rfd) } else { 0 };
            behind &= !gone;
            let held = if behind != 0 {
                self.held_marks(cx, &rfd.path, behind).await
            } else {
                Vec::new()
            };
            let (cx, _open) = rfd.state.stamps.begin(cx);
            let cx = &cx;
            let shared = Shared::new(data);
            let sh = &shared;
            // Where the file is missing the write cannot go: the replicas that take it
            // record that miss with the write, not in a round trip after it.
            let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, Written> {
                let k = k.clone();
                let b = sh.share();
                if gone != 0 {
                    Box::pin(async move { k.write_marked(cx, &fd, offset, b, gone).await })
                } else {
                    Box::pin(async move { k.write(cx, &fd, offset, b).await })
                }
            };
            let res = self.fan_out(cx, rfd, &op).await;
            let n = res
                .iter()
                .flatten()
                .filter_map(|r| r.as_ref().ok().map(|w| w.n))
                .min()
                .unwrap_or(0);
            // A short write on a replica is a miss of the rest there.
            let res: Vec<Option<FopResult<()>>> = res
                .into_iter()
                .map(|o| {
                    o.map(|r| match r {
                        Ok(w) if w.n == n => Ok(()),
                        Ok(_) => Err(errno::EIO),
                        Err(e) => Err(e),
                    })
                })
                .collect();
            let miss = Miss {
                marked: gone,
                ..Miss::bytes(offset, len as u64)
            };
            self.settle(cx, &rfd.path, Some(&rfd.state), &res, miss)
                .await?;
            if !held.is_empty() && n == len {
                let took = res
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| matches!(r, Some(Ok(()))))
                    .fold(0, |b, (i, _)| b | bit(i));
                self.clear_taken(cx, &rfd.path, &held, took & behind, offset, len as u64)
                    .await;
            }
            Ok(Written {
                n,
                bufs: shared.into_bufs(),
            })
        })
    }

    fn fsync<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, datasync: bool) -> Fut<'a, ()> {
        let rfd = try_rep!(fd);
        Box::pin(async move {
            let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, ()> {
                let k = k.clone();
                Box::pin(async move { k.fsync(cx, &fd, datasync).await })
            };
            let res = self.fan_out(cx, rfd, &op).await;
            self.settle(cx, &rfd.path, None, &outcomes(&res), Miss::default())
                .await
        })
    }

    fn release<'a>(&'a self, cx: &'a Ctx, fd: Fd) -> Fut<'a, ()> {
        Box::pin(async move {
            let rfd = rep(&fd)?;
            let futs = (0..self.kids.len())
                .map(|i| self.child_fd(rfd, i).map(|f| self.kids[i].release(cx, f)))
                .collect();
            join_all(futs).await;
            Ok(())
        })
    }

    fn fstat<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd) -> Fut<'a, Attr> {
        let rfd = try_rep!(fd);
        self.on_readable(cx, rfd, move |k, fd| {
            Box::pin(async move { k.fstat(cx, &fd).await })
        })
    }

    fn extents<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, at: u64, len: u64) -> Fut<'a, ExtentList> {
        // Holes as a replica that may be read has them (heal may have filled some in: a
        // hole reported as data is still read right).
        let rfd = try_rep!(fd);
        self.on_readable(cx, rfd, move |k, fd| {
            Box::pin(async move { k.extents(cx, &fd, at, len).await })
        })
    }

    fn lease<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        cmd: u32,
        ttl: u32,
        who: &'a str,
    ) -> Fut<'a, LeaseState> {
        Box::pin(self.lease_all(cx, try_rep!(fd), cmd, ttl, who))
    }

    fn snap<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        cmd: u32,
        name: &'a str,
        to: &'a str,
        ttl: u32,
    ) -> Fut<'a, crate::SnapReply> {
        Box::pin(self.snap_all(cx, try_rep!(fd), cmd, name, to, ttl))
    }

    fn dirty<'a>(
        &'a self,
        cx: &'a Ctx,
        fd: &'a Fd,
        cmd: u32,
        name: &'a str,
        at: u64,
        len: u64,
    ) -> Fut<'a, ExtentList> {
        Box::pin(self.dirty_all(cx, try_rep!(fd), cmd, name, at, len))
    }

    fn fsetattr<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        let rfd = try_rep!(fd);
        Box::pin(async move {
            // Only a size change is a change of bytes.
            let stamped = (attrs.valid & SETATTR_SIZE != 0).then(|| rfd.state.stamps.begin(cx));
            let cx = stamped.as_ref().map_or(cx, |s| &s.0);
            let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, Attr> {
                let k = k.clone();
                Box::pin(async move { k.fsetattr(cx, &fd, attrs).await })
            };
            let mut res = self.fan_out(cx, rfd, &op).await;
            let miss = Miss::setattr(attrs);
            self.settle(cx, &rfd.path, Some(&rfd.state), &outcomes(&res), miss)
                .await?;
            first_ok(&mut res)
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
        let rfd = try_rep!(fd);
        Box::pin(async move {
            let (cx, _open) = rfd.state.stamps.begin(cx);
            let cx = &cx;
            let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, ()> {
                let k = k.clone();
                Box::pin(async move { k.fallocate(cx, &fd, mode, offset, len).await })
            };
            let res = self.fan_out(cx, rfd, &op).await;
            self.settle(
                cx,
                &rfd.path,
                Some(&rfd.state),
                &outcomes(&res),
                Miss::bytes(offset, m::WHOLE),
            )
            .await
        })
    }

    fn discard<'a>(&'a self, cx: &'a Ctx, fd: &'a Fd, offset: u64, len: u64) -> Fut<'a, ()> {
        let rfd = try_rep!(fd);
        Box::pin(async move {
            let (cx, _open) = rfd.state.stamps.begin(cx);
            let cx = &cx;
            let op = move |k: &LayerRef, fd: Fd| -> Fut<'_, ()> {
                let k = k.clone();
                Box::pin(async move { k.discard(cx, &fd, offset, len).await })
            };
            let res = self.fan_out(cx, rfd, &op).await;
            self.settle(
                cx,
                &rfd.path,
                Some(&rfd.state),
                &outcomes(&res),
                Miss::bytes(offset, len),
            )
            .await
        })
    }

    fn setattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, attrs: &'a SetAttrs) -> Fut<'a, Attr> {
        if attrs.valid & SETATTR_SIZE == 0 {
            return self.change_path(cx, path, Miss::setattr(attrs), move |k| {
                k.setattr(cx, path, attrs)
            });
        }
        // A size change by name is a change of bytes: stamped as one through a handle is.
        Box::pin(async move {
            let state = self.state(path);
            let (scx, _open) = state.stamps.begin(cx);
            let scx = &scx;
            let run = |i: usize| self.kids[i].setattr(scx, path, attrs);
            let mut res = self.on_quorum(&run).await;
            self.settle(cx, path, None, &outcomes(&res), Miss::setattr(attrs))
                .await?;
            first_ok(&mut res)
        })
    }

    fn unlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        let miss = Miss::flags(m::ENTRY);
        self.change_path(cx, path, miss, move |k| k.unlink(cx, path))
    }

    fn mkdir<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32) -> Fut<'a, Attr> {
        let miss = Miss::flags(m::ENTRY);
        self.change_path(cx, path, miss, move |k| k.mkdir(cx, path, mode))
    }

    fn rmdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        let miss = Miss::flags(m::ENTRY);
        self.change_path(cx, path, miss, move |k| k.rmdir(cx, path))
    }

    fn rename<'a>(&'a self, cx: &'a Ctx, from: &'a str, to: &'a str, flags: u32) -> Fut<'a, ()> {
        let miss = Miss {
            also: Some(to),
            ..Miss::flags(m::ENTRY)
        };
        self.change_path(cx, from, miss, move |k| k.rename(cx, from, to, flags))
    }

    fn symlink<'a>(&'a self, cx: &'a Ctx, target: &'a str, path: &'a str) -> Fut<'a, Attr> {
        let miss = Miss::flags(m::ENTRY);
        self.change_path(cx, path, miss, move |k| k.symlink(cx, target, path))
    }

    fn mknod<'a>(&'a self, cx: &'a Ctx, path: &'a str, mode: u32, rdev: u64) -> Fut<'a, Attr> {
        let miss = Miss::flags(m::ENTRY);
        self.change_path(cx, path, miss, move |k| k.mknod(cx, path, mode, rdev))
    }

    fn link<'a>(&'a self, cx: &'a Ctx, existing: &'a str, path: &'a str) -> Fut<'a, Attr> {
        let miss = Miss::flags(m::ENTRY);
        self.change_path(cx, path, miss, move |k| k.link(cx, existing, path))
    }

    fn setxattr<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        name: &'a str,
        value: &'a [u8],
        flags: u32,
    ) -> Fut<'a, ()> {
        if let Some(e) = crate::reserved_xattr(name) {
            return fail(e);
        }
        self.change_path(cx, path, Miss::flags(m::META), move |k| {
            k.setxattr(cx, path, name, value, flags)
        })
    }

    fn removexattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, ()> {
        if let Some(e) = crate::reserved_xattr(name) {
            return fail(e);
        }
        self.change_path(cx, path, Miss::flags(m::META), move |k| {
            k.removexattr(cx, path, name)
        })
    }

    fn readlink<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, String> {
        self.query_path(path, move |k| k.readlink(cx, path))
    }

    fn getxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str, name: &'a str) -> Fut<'a, Vec<u8>> {
        self.query_path(path, move |k| k.getxattr(cx, path, name))
    }

    fn layout_get<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a ()) -> Fut<'a, Vec<u8>> {
        self.query_path(path, move |k| k.layout_get(cx, path, arg))
    }

    fn layout_set<'a>(&'a self, cx: &'a Ctx, path: &'a str, arg: &'a Vec<u8>) -> Fut<'a, ()> {
        self.change_path(cx, path, Miss::flags(m::META), move |k| {
            k.layout_set(cx, path, arg)
        })
    }

    fn listxattr<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, Vec<String>> {
        self.query_path(path, move |k| k.listxattr(cx, path))
    }

    fn readdir<'a>(
        &'a self,
        cx: &'a Ctx,
        path: &'a str,
        offset: u64,
        max: u32,
    ) -> Fut<'a, ReaddirReply> {
        // One replica's listing, the same one for every page: the first that is up (and not
        // a new brick, whose listing may be short).
        Box::pin(self.patiently(move || {
            Box::pin(async move {
                let mut last = errno::ENOTCONN;
                for k in self.kids.iter().filter(|k| k.up() && !k.joining()) {
                    match k.readdir(cx, path, offset, max).await {
                        Ok(mut r) => {
                            // One replica's word on extended attributes is not the volume's:
                            // heal carries only `user.` ones, and getxattr asks every replica.
                            r.entries.0.iter_mut().for_each(|e| e.xattrs = true);
                            return Ok(r);
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            })
        }))
    }

    fn syncdir<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, ()> {
        // Every replica that is up makes its entries durable; nothing changes, so nothing
        // is settled.
        Box::pin(async move {
            let run = |i: usize| self.kids[i].syncdir(cx, path);
            first_ok(&mut self.on_quorum(&run).await)
        })
    }

    fn statfs<'a>(&'a self, cx: &'a Ctx, path: &'a str) -> Fut<'a, StatfsReply> {
        self.query_path(path, move |k| k.statfs(cx, path))
    }

    // Addressed to one brick: heal and this layer send these to the replica they mean
    // (its children), so through the replica set as a whole they are refused.
    fn write_marked<'a>(
        &'a self,
        _: &'a Ctx,
        _: &'a Fd,
        _: u64,
        _: IoBufs,
        _: u32,
    ) -> Fut<'a, Written> {
        crate::refused()
    }

    fn heal_open<'a>(&'a self, _: &'a Ctx, _: &'a str, _: u32) -> Fut<'a, Fd> {
        crate::refused()
    }

    fn mark_add<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::Mark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn mark_clear<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::Mark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn mark_clear_if<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::CondMark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn flag_add<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::FlagMark) -> Fut<'a, ()> {
        crate::refused()
    }

    fn flag_clear_if<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::CondFlag) -> Fut<'a, ()> {
        crate::refused()
    }

    fn heal_lock<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a m::LockReq) -> Fut<'a, ()> {
        crate::refused()
    }

    fn pending<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a ()) -> Fut<'a, m::PendingPage> {
        crate::refused()
    }

    fn pending_index<'a>(&'a self, _: &'a Ctx, _: &'a str, _: &'a ()) -> Fut<'a, m::IndexPage> {
        crate::refused()
    }

    fn member<'a>(
        &'a self,
        _: &'a Ctx,
        _: &'a str,
        _: &'a m::MemberReq,
    ) -> Fut<'a, m::MemberState> {
        crate::refused()
    }
}
