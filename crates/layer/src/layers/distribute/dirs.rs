//! Directories on every subvolume: made, removed, renamed and repaired everywhere alike.

use super::*;

impl Distribute {
    /// Applies a change to every copy of a directory (the one on `first` first); `ENOENT` from
    /// the others (a copy missing after a partial mkdir) is ignored.
    pub(super) async fn dir_everywhere<'b, T: Send + 'b>(
        &'b self,
        first: usize,
        f: impl Fn(&'b LayerRef) -> Fut<'b, T>,
    ) -> FopResult<T> {
        let v = self.with(first, &f).await?;
        let rs: Vec<FopResult<T>> = self
            .on_others(Some(first), f)
            .await
            .into_iter()
            .map(|(_, r)| r)
            .collect();
        match first_real_error(&rs) {
            Some(e) => Err(e),
            None => Ok(v),
        }
    }

    /// Makes `path` again on subvolumes `on` after a failed rmdir, with the mode of the copy on
    /// `from`. Best effort.
    pub(super) async fn restore_dir(&self, cx: &Ctx, path: &str, from: usize, on: &[usize]) {
        let mode = match self.with(from, |k| k.lookup(cx, path)).await {
            Ok(a) => a.mode & 0o7777,
            Err(_) => 0o755,
        };
        for &i in on {
            if let Err(e) = self.with(i, |k| k.mkdir(cx, path, mode)).await {
                tracing::warn!(
                    path,
                    subvol = i,
                    errno = e,
                    "could not restore a directory copy"
                );
            }
        }
    }

    /// Makes directory `dir` and its missing ancestors on subvolume `i`, each with the mode and
    /// owner of its copy on another subvolume (a subvolume added to the volume gets directories
    /// as names are created in them). As the process's own user (root on the bricks).
    pub(super) async fn heal_dir(&self, i: usize, dir: &str) -> FopResult<()> {
        let cx = &Ctx::NONE;
        let ends = dir
            .match_indices('/')
            .map(|(j, _)| j)
            .chain(std::iter::once(dir.len()));
        for end in ends {
            let p = &dir[..end];
            match self.with(i, |k| k.lookup(cx, p)).await {
                Ok(a) if is_dir(&a) => continue,
                Ok(_) => return Err(libc::ENOTDIR as Errno),
                Err(ENOENT) => {}
                Err(e) => return Err(e),
            }
            let (_, a) = self.find_elsewhere(cx, p, i).await?;
            if !is_dir(&a) {
                return Err(libc::ENOTDIR as Errno);
            }
            match self.with(i, |k| k.mkdir(cx, p, a.mode & 0o7777)).await {
                Ok(_) | Err(EEXIST) => {}
                Err(e) => return Err(e),
            }
            let own = SetAttrs {
                valid: kiln_proto::ops::SETATTR_UID | kiln_proto::ops::SETATTR_GID,
                uid: a.uid,
                gid: a.gid,
                ..SetAttrs::default()
            };
            self.with(i, |k| k.setattr(cx, p, &own)).await?;
            tracing::debug!(
                dir = p,
                subvol = i,
                "directory made on a subvolume that lacked it"
            );
        }
        Ok(())
    }

    /// Runs `f` (a fop that makes the name `path`) on subvolume `i`; when it says `ENOENT`
    /// because the parent directory is missing there, makes the directory and runs it again.
    pub(super) async fn making<'b, T: Send + 'b>(
        &'b self,
        i: usize,
        path: &'b str,
        f: impl Fn(&'b LayerRef) -> Fut<'b, T>,
    ) -> FopResult<T> {
        let parent = split(path).0;
        match self.with(i, &f).await {
            Err(ENOENT) if !parent.is_empty() && self.kids.len() > 1 => {
                match self.heal_dir(i, parent).await {
                    Ok(()) => self.with(i, &f).await,
                    // The parent is nowhere: the caller's ENOENT stands.
                    Err(_) => Err(ENOENT),
                }
            }
            r => r,
        }
    }

    pub(super) async fn do_mkdir(&self, cx: &Ctx, path: &str, mode: u32) -> FopResult<Attr> {
        if path.is_empty() {
            return Err(EEXIST);
        }
        let h = self.hashed(path)?;
        let attr = self.making(h, path, |k| k.mkdir(cx, path, mode)).await?;
        let mut made = vec![h];
        let mut failure = None;
        for (i, r) in self.on_others(Some(h), |k| k.mkdir(cx, path, mode)).await {
            let r = match r {
                // The parent is missing there (a subvolume added since): made, then again.
                Err(ENOENT) => self.making(i, path, |k| k.mkdir(cx, path, mode)).await,
                r => r,
            };
            match r {
                Ok(_) => made.push(i),
                // A directory left by an earlier partial mkdir is fine; anything else is not.
                Err(EEXIST) => match self.with(i, |k| k.lookup(cx, path)).await {
                    Ok(a) if is_dir(&a) => {}
                    Ok(_) => failure = failure.or(Some(EEXIST)),
                    Err(e) => failure = failure.or(Some(e)),
                },
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        if let Some(e) = failure {
            for &i in &made {
                if let Err(e2) = self.with(i, |k| k.rmdir(cx, path)).await {
                    tracing::warn!(
                        path,
                        subvol = i,
                        errno = e2,
                        "could not undo a partial mkdir"
                    );
                }
            }
            return Err(e);
        }
        self.forget(path);
        Ok(attr)
    }

    pub(super) async fn do_rmdir(&self, cx: &Ctx, path: &str) -> FopResult<()> {
        if path.is_empty() {
            return Err(EBUSY);
        }
        let h = self.hashed(path)?;
        let mut removed = Vec::new();
        let mut failure = None;
        for (i, r) in self.on_others(Some(h), |k| k.rmdir(cx, path)).await {
            match r {
                Ok(()) => removed.push(i),
                Err(ENOENT) => {}
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        let result = match failure {
            Some(e) => Err(e),
            None => match self.with(h, |k| k.rmdir(cx, path)).await {
                Err(ENOENT) if !removed.is_empty() => Ok(()),
                r => r,
            },
        };
        if let Err(e) = result {
            if !removed.is_empty() {
                self.restore_dir(cx, path, h, &removed).await;
            }
            return Err(e);
        }
        self.forget(path);
        Ok(())
    }

    pub(super) async fn do_rename(
        &self,
        cx: &Ctx,
        from: &str,
        to: &str,
        flags: u32,
    ) -> FopResult<()> {
        if from.is_empty() || to.is_empty() {
            return Err(EBUSY);
        }
        let (h, attr) = self.locate(cx, from).await?;
        if is_dir(&attr) {
            return self.rename_dir(cx, from, to, flags, h).await;
        }
        let exchange = flags & RENAME_EXCHANGE != 0;
        let dest = match self.locate(cx, to).await {
            Ok(d) => Some(d),
            Err(ENOENT) => None,
            Err(e) => return Err(e),
        };
        let stale = match dest {
            Some(_) if flags & RENAME_NOREPLACE != 0 => return Err(EEXIST),
            Some((_, a)) if is_dir(&a) && !exchange => return Err(EISDIR),
            Some((j, _)) if j != h && exchange => return Err(EXDEV),
            Some((j, _)) if j != h => Some(j),
            None if exchange => return Err(ENOENT),
            _ => None,
        };
        self.making(h, to, |k| k.rename(cx, from, to, flags))
            .await?;
        if let Some(j) = stale {
            // The replaced file sat on another subvolume: remove it, as rename would have.
            match self.with(j, |k| k.unlink(cx, to)).await {
                Ok(()) | Err(ENOENT) => {}
                Err(e) => tracing::warn!(
                    to,
                    subvol = j,
                    errno = e,
                    "could not remove a replaced file"
                ),
            }
        }
        Ok(())
    }

    pub(super) async fn rename_dir(
        &self,
        cx: &Ctx,
        from: &str,
        to: &str,
        flags: u32,
        first: usize,
    ) -> FopResult<()> {
        self.with(first, |k| k.rename(cx, from, to, flags)).await?;
        let mut done = vec![first];
        let mut failure = None;
        for (i, r) in self
            .on_others(Some(first), |k| k.rename(cx, from, to, flags))
            .await
        {
            match r {
                Ok(()) => done.push(i),
                Err(ENOENT) => {}
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        self.forget(from);
        self.forget(to);
        if let Some(e) = failure {
            let back = flags & RENAME_EXCHANGE;
            for &i in &done {
                if let Err(e2) = self.with(i, |k| k.rename(cx, to, from, back)).await {
                    tracing::warn!(
                        from,
                        to,
                        subvol = i,
                        errno = e2,
                        "could not undo a directory rename"
                    );
                }
            }
            return Err(e);
        }
        Ok(())
    }
}
