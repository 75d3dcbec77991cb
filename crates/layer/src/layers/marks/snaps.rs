//! Snapshots of an image on one brick ([`kiln_proto::ops::SnapReq`]): a write barrier, a
//! copy taken under it by the file system's reflink, and clones of such copies.
//!
//! The barrier stands on the file's state: from `SNAP_FREEZE` until `SNAP_THAW` (or until
//! it lapses, so a snapshotter that dies cannot lock writers out), every change of the file's
//! bytes from another connection — heal's writes too — records its range and waits at the gate
//! ([`Marks::enter_as`]); the freeze is answered once the changes already past the gate have
//! finished. `SNAP_TAKE` answers the ranges that waited (such a change may have run on a
//! replica frozen a moment later) and the stamped changes the copy holds ([`super::ran`]: one
//! still on its way here may have run on another replica before its barrier); the replicate
//! layer compares the replicas' answers and makes the copies agree where they differ (see its
//! `snaps`).
//!
//! A connection's barrier holds writers for [`HOLD_MAX`] at most (or its first time to live,
//! if longer), however often it is raised again meanwhile: a renewal cannot push it past
//! that, and one asked later is refused with `ETIMEDOUT`. For [`HOLD_MAX`] after that limit
//! (when the barrier lapsed instead of being lifted) the writers have the file: the same
//! connection's barrier is refused with `ETIMEDOUT`, another's with `EBUSY`. A barrier lifted
//! by `SNAP_THAW` ends its hold; the next one starts afresh.
//!
//! The copy is a hidden sibling of the file, `DIR/.BASE@NAME` ([`snapshot_path`]), made with
//! `FICLONE`: instant, sharing every block until one side is written. It is made private
//! (mode 0600) and, before it takes its name, given the file's owner, group, mode without
//! write permission and POSIX ACL (`system.posix_acl_access`, write permission taken out):
//! whoever could not read the image cannot read its snapshot. A file system without reflink
//! (ext4, tmpfs) refuses with `EOPNOTSUPP`; no slow copy is made behind the caller's back. A
//! clone is a new file made the same way from a snapshot, with the image's owner, group, mode
//! and ACL; a tree snapshot's copy likewise.

use std::time::{Duration, Instant};

use kiln_proto::ops::{
    snapshot_name_ok, snapshot_path, SetAttrs, SnapReq, SNAP_CLONE, SNAP_FREEZE, SNAP_PREPARE,
    SNAP_TAKE, SNAP_THAW, SNAP_TTL_MAX,
};
use kiln_proto::stamp::SnapReply;

use crate::marks::{self as m, RangeSet};
use crate::{errno, Ctx, Fd, FopResult};

use super::images::EBUSY;
use super::locks::{len_of, Locker};
use super::{FileKey, FileState, MarkFd, Marks, ETIMEDOUT};

/// The longest a connection's barrier holds writers when renewed (see the module's text).
pub const HOLD_MAX: Duration = Duration::from_secs(2);

/// What a connection's barriers on a file may still hold.
pub(super) struct Hold {
    owner: u64,
    /// No barrier of this hold stands past this.
    limit: Instant,
}

/// The extended attribute that holds a file's POSIX ACL.
const ACL_XATTR: &str = "system.posix_acl_access";

/// A POSIX ACL (as `system.posix_acl_access` holds it: a 4-byte version, then 8-byte entries
/// of tag, permissions and id) with the write permission taken out of every entry.
fn acl_read_only(mut acl: Vec<u8>) -> FopResult<Vec<u8>> {
    if acl.len() < 4 || !(acl.len() - 4).is_multiple_of(8) {
        return Err(errno::EIO);
    }
    for e in acl[4..].chunks_exact_mut(8) {
        let perm = u16::from_le_bytes([e[2], e[3]]) & !0o2;
        e[2..4].copy_from_slice(&perm.to_le_bytes());
    }
    Ok(acl)
}

/// A write barrier on a file.
pub(super) struct Freeze {
    owner: u64,
    expires: Instant,
    /// The ranges changes waited on.
    blocked: RangeSet,
}

impl FileState {
    /// A change of `[start, end)` let through: a snapshot being taken must copy it again.
    pub(super) fn note_delta(&mut self, start: u64, end: u64) {
        if let Some((_, _, r)) = &mut self.delta {
            r.add(start, len_of(start, end));
        }
    }

    /// Lifts `owner`'s barrier, if it stands, and forgets the snapshot it was taking; true if
    /// a barrier went (wake the waiters).
    pub(super) fn lift_barrier(&mut self, owner: u64) -> bool {
        if self.delta.as_ref().is_some_and(|d| d.1 == owner) {
            self.delta = None;
        }
        let ours = self.freeze.as_ref().is_some_and(|z| z.owner == owner);
        if ours {
            self.freeze = None;
        }
        ours
    }

    /// How long a change of `[start, end)` through connection `owner` must wait for another
    /// connection's barrier (its range recorded), if one stands.
    pub(super) fn barrier(&mut self, owner: u64, start: u64, end: u64) -> Option<Duration> {
        let f = self.freeze.as_mut()?;
        let now = Instant::now();
        if f.expires <= now {
            self.freeze = None;
            return None;
        }
        if f.owner == owner {
            return None;
        }
        f.blocked.add(start, len_of(start, end));
        Some(f.expires - now)
    }
}

/// Where snapshot `name` of `path` is made before it is whole: a name no snapshot can have
/// (`~` is not allowed in one), so a torn copy is never listed nor cloned.
fn part_path(path: &str, name: &str) -> String {
    format!("{}~", snapshot_path(path, name))
}

/// `FICLONERANGE` (linux/fs.h): `_IOW(0x94, 13, struct file_clone_range)`.
const FICLONERANGE: libc::c_ulong = 0x4020_940d;

/// Makes `len` bytes at `at` of `into` share the blocks of the same range of `from`.
fn clone_range(from: &std::fs::File, into: &std::fs::File, at: u64, len: u64) -> FopResult<()> {
    use std::os::fd::AsRawFd;
    let arg = libc::file_clone_range {
        src_fd: i64::from(from.as_raw_fd()),
        src_offset: at,
        src_length: len,
        dest_offset: at,
    };
    // SAFETY: FICLONERANGE reads one `struct file_clone_range`, which `arg` is and which lives
    // across the call; both descriptors are open files this call borrows.
    let r = unsafe { libc::ioctl(into.as_raw_fd(), FICLONERANGE, &arg) };
    if r == 0 {
        Ok(())
    } else {
        let e = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        Err(reflink_errno(rustix::io::Errno::from_raw_os_error(e)))
    }
}

/// `EOPNOTSUPP`, or the error, of a reflink that failed.
fn reflink_errno(e: rustix::io::Errno) -> u32 {
    use rustix::io::Errno as E;
    match e {
        // EINVAL: "the file system does not support reflinking" (ioctl_ficlone(2)).
        E::OPNOTSUPP | E::XDEV | E::INVAL | E::NOSYS => errno::EOPNOTSUPP,
        e => e.raw_os_error() as u32,
    }
}

impl Marks {
    /// SNAP on the file open as `f`.
    pub(super) async fn snap_req(
        &self,
        cx: &Ctx,
        f: &MarkFd,
        req: &SnapReq,
    ) -> FopResult<SnapReply> {
        let owner = cx.owner;
        match req.cmd {
            SNAP_FREEZE => {
                if req.ttl_ms == 0 || req.ttl_ms > SNAP_TTL_MAX {
                    return Err(errno::EINVAL);
                }
                let ttl = Duration::from_millis(req.ttl_ms.into());
                Marks::raise_barrier(&f.key, owner, ttl).await?;
                Ok(SnapReply::default())
            }
            SNAP_THAW => {
                let lifted = {
                    let mut st = f.key.state();
                    // Lifted by its owner: its next barrier is a new one.
                    if st.hold.as_ref().is_some_and(|h| h.owner == owner) {
                        st.hold = None;
                    }
                    st.lift_barrier(owner)
                };
                if lifted {
                    f.key.changed.notify_waiters();
                }
                Ok(SnapReply::default())
            }
            SNAP_PREPARE => {
                self.prepare(cx, f, &req.name).await?;
                Ok(SnapReply::default())
            }
            SNAP_TAKE => self.take(cx, f, &req.name, &req.to).await,
            SNAP_CLONE => {
                if req.to.is_empty() {
                    return Err(errno::EINVAL);
                }
                self.clone_snapshot(cx, f, &req.name, &req.to).await?;
                Ok(SnapReply::default())
            }
            _ => Err(errno::EINVAL),
        }
    }

    /// Raises `owner`'s barrier and waits for the other connections' changes in flight.
    async fn raise_barrier(key: &FileKey, owner: u64, ttl: Duration) -> FopResult<()> {
        {
            let mut st = key.state();
            let now = Instant::now();
            if st
                .freeze
                .as_ref()
                .is_some_and(|z| z.owner != owner && z.expires > now)
            {
                return Err(EBUSY);
            }
            // A renewal, or a barrier raised again soon after one that lapsed, belongs to the
            // same hold: it cannot stand past the hold's limit. After that limit the writers
            // have the file for a while, whichever connection asks (a client with several
            // connections cannot take turns holding them).
            let limit = match &st.hold {
                Some(h) if now < h.limit + HOLD_MAX => {
                    if h.owner != owner && now >= h.limit {
                        return Err(EBUSY);
                    }
                    h.limit
                }
                _ => {
                    let limit = now + ttl.max(HOLD_MAX);
                    st.hold = Some(Hold { owner, limit });
                    limit
                }
            };
            if now >= limit {
                if st.lift_barrier(owner) {
                    key.changed.notify_waiters();
                }
                tracing::warn!(
                    "snapshot barrier refused: connection {owner} held writers for its longest \
                     ({} ms) already",
                    HOLD_MAX.as_millis()
                );
                return Err(ETIMEDOUT);
            }
            // A renewal keeps the ranges that waited so far: the snapshot must hear of them.
            let blocked = match st.freeze.take() {
                Some(z) if z.owner == owner && z.expires > now => z.blocked,
                _ => RangeSet::default(),
            };
            st.freeze = Some(Freeze {
                owner,
                expires: (now + ttl).min(limit),
                blocked,
            });
        }
        loop {
            let notified = key.changed.notified();
            let busy = {
                let mut st = key.state();
                let now = Instant::now();
                if st
                    .freeze
                    .as_ref()
                    .is_none_or(|z| z.owner != owner || z.expires <= now)
                {
                    // Lapsed (or lifted) while changes ran past it.
                    st.lift_barrier(owner);
                    return Err(ETIMEDOUT);
                }
                let busy = st.inflight.iter().any(|w| !w.ns && w.owner != owner);
                if !busy {
                    return Ok(());
                }
                st.lockers += 1;
                busy
            };
            let _counted = busy.then_some(Locker(key));
            let _ = tokio::time::timeout(m::LOCK_LEASE, notified).await;
        }
    }

    /// Copies the file to snapshot `name`'s part file with no barrier yet, recording the
    /// ranges that change from the moment before the copy on (those of the changes in flight
    /// too).
    async fn prepare(&self, cx: &Ctx, f: &MarkFd, name: &str) -> FopResult<()> {
        if !snapshot_name_ok(name) {
            return Err(errno::EINVAL);
        }
        if self
            .child()
            .lookup(cx, &snapshot_path(&f.path, name))
            .await
            .is_ok()
        {
            return Err(libc::EEXIST as u32);
        }
        {
            let mut st = f.key.state();
            if st.delta.as_ref().is_some_and(|d| d.1 != cx.owner) {
                return Err(EBUSY);
            }
            let mut r = RangeSet::default();
            for w in st.inflight.iter().filter(|w| !w.ns) {
                r.add(w.start, len_of(w.start, w.end));
            }
            st.delta = Some((name.to_owned(), cx.owner, r));
        }
        let part = part_path(&f.path, name);
        // A part left by a snapshot whose taker died is nobody's now.
        let _ = self.child().unlink(cx, &part).await;
        let made = self.reflink(cx, &f.inner, &part).await;
        if made.is_err() {
            f.key.state().delta = None;
        }
        made
    }

    /// Under the asker's barrier, brings snapshot `name`'s part file up to the file (after a
    /// prepare, the ranges changed since its copy; else a whole copy) and, the barrier still
    /// standing, renames it into place (never over an existing snapshot). Answers the ranges
    /// changes waited on and the stamped changes the copy holds ([`super::ran`]). With `to`,
    /// the copy goes there instead, with the file's mode and owner.
    async fn take(&self, cx: &Ctx, f: &MarkFd, name: &str, to: &str) -> FopResult<SnapReply> {
        if !snapshot_name_ok(name) {
            return Err(errno::EINVAL);
        }
        // What changes waited, and which stamped ones ran: read under the barrier, the copy
        // holds just those.
        let standing = || {
            let st = f.key.state();
            let now = Instant::now();
            match &st.freeze {
                Some(z) if z.owner == cx.owner && z.expires > now => {
                    Some((z.blocked.clone(), st.ran.report(now)))
                }
                _ => None,
            }
        };
        standing().ok_or(ETIMEDOUT)?;
        let delta = {
            let mut st = f.key.state();
            match st.delta.take() {
                Some((n, o, r)) if n == name && o == cx.owner => Some(r),
                other => {
                    st.delta = other;
                    None
                }
            }
        };
        let part = part_path(&f.path, name);
        let r = match delta {
            None => {
                let _ = self.child().unlink(cx, &part).await;
                self.reflink(cx, &f.inner, &part).await
            }
            // Nothing changed since the first copy (a change of size is recorded as a range
            // too): it is whole already.
            Some(changed) if changed.is_empty() => Ok(()),
            Some(changed) => self.catch_up(cx, f, &part, &changed).await,
        };
        // The copy is whole only if no change slipped past a barrier that lapsed meanwhile.
        let r = r.and_then(|()| standing().ok_or(ETIMEDOUT));
        let r = match r {
            Ok(blocked) if to.is_empty() => {
                let to = snapshot_path(&f.path, name);
                self.take_into(cx, f, &part, &to, true)
                    .await
                    .map(|()| (blocked, to))
            }
            Ok(blocked) => self
                .take_into(cx, f, &part, to, false)
                .await
                .map(|()| (blocked, to.to_owned())),
            Err(e) => Err(e),
        };
        let ((blocked, (writers, lost)), to) = match r {
            Ok(v) => v,
            Err(e) => {
                let _ = self.child().unlink(cx, &part).await;
                return Err(e);
            }
        };
        tracing::info!(path = f.path, snapshot = to, "snapshot taken");
        // An extent list holds at most EXTENTS_MAX runs, a data run and the hole before it
        // for each range: ranges past that would not reach the comparison, so the copy
        // cannot be vouched for, as when stamps were forgotten.
        let overflow = !blocked.fits_extents();
        if overflow {
            tracing::warn!(
                path = f.path,
                "too many ranges waited at the barrier to report"
            );
        }
        Ok(SnapReply {
            blocked: blocked.extents(),
            writers,
            lost: lost || overflow,
            marked: self.has_marks(&f.path),
        })
    }

    /// Gives the copy `part` the file's access (taken under the barrier: as it was at the
    /// snapshot's instant; with `read_only`, without write permission) and renames it to `to`.
    async fn take_into(
        &self,
        cx: &Ctx,
        f: &MarkFd,
        part: &str,
        to: &str,
        read_only: bool,
    ) -> FopResult<()> {
        let a = self.child().fstat(cx, &f.inner).await?;
        self.carry_access(cx, &f.path, &a, part, read_only).await?;
        self.child()
            .rename(cx, part, to, libc::RENAME_NOREPLACE)
            .await
    }

    /// Gives `to` the owner, group and mode `a` of the file at `from`, and its POSIX ACL;
    /// with `read_only`, the mode and the ACL lose their write permission (never gain any
    /// read permission).
    async fn carry_access(
        &self,
        cx: &Ctx,
        from: &str,
        a: &crate::Attr,
        to: &str,
        read_only: bool,
    ) -> FopResult<()> {
        let mut attrs = SetAttrs::mode_and_owner(a);
        if read_only {
            attrs.mode &= !0o222;
        }
        self.child().setattr(cx, to, &attrs).await?;
        match self.child().getxattr(cx, from, ACL_XATTR).await {
            Ok(acl) => {
                let acl = if read_only { acl_read_only(acl)? } else { acl };
                self.child().setxattr(cx, to, ACL_XATTR, &acl, 0).await
            }
            // No ACL (or a file system without them): the mode says it all.
            Err(e) if e == errno::ENODATA || e == errno::EOPNOTSUPP => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Re-copies `changed` (in whole blocks) of the file into the snapshot at `to`, and gives
    /// it the file's size.
    async fn catch_up(&self, cx: &Ctx, f: &MarkFd, to: &str, changed: &RangeSet) -> FopResult<()> {
        let attr = self.child().fstat(cx, &f.inner).await?;
        // Ranges are cloned in the file system's blocks.
        let (size, block) = (attr.size, u64::from(attr.blksize.max(512)));
        let snap = self.child().open(cx, to, libc::O_WRONLY as u32).await?;
        let r = (|| {
            let from = self.child().backing(cx, &f.inner)?;
            let into = self.child().backing(cx, &snap)?;
            rustix::fs::ftruncate(into, size).map_err(|e| e.raw_os_error() as u32)?;
            let mut whole = RangeSet::default();
            for (o, l) in changed.iter() {
                let end = if l == m::WHOLE {
                    size
                } else {
                    o.saturating_add(l).min(size)
                };
                let start = o / block * block;
                if start < end {
                    // Whole blocks, the last one cut at the end of the file.
                    whole.add(
                        start,
                        end.div_ceil(block).saturating_mul(block).min(size) - start,
                    );
                }
            }
            for (o, l) in whole.iter() {
                clone_range(from, into, o, l)?;
            }
            Ok(())
        })();
        let _ = self.child().release(cx, snap).await;
        r
    }

    /// Makes `to` a clone of snapshot `name` of the file, with the file's mode and owner.
    async fn clone_snapshot(&self, cx: &Ctx, f: &MarkFd, name: &str, to: &str) -> FopResult<()> {
        if !snapshot_name_ok(name) {
            return Err(errno::EINVAL);
        }
        let attr = self.child().fstat(cx, &f.inner).await?;
        let snap = self
            .child()
            .open(cx, &snapshot_path(&f.path, name), libc::O_RDONLY as u32)
            .await?;
        let mut r = self.reflink(cx, &snap, to).await;
        let _ = self.child().release(cx, snap).await;
        if r.is_ok() {
            r = self.carry_access(cx, &f.path, &attr, to, false).await;
            if r.is_err() {
                let _ = self.child().unlink(cx, to).await;
            }
        }
        if r.is_ok() {
            tracing::info!(path = f.path, snapshot = name, clone = to, "clone made");
        }
        r
    }

    /// Creates `to` (it must not exist, and is made private: mode 0600) sharing every block
    /// of `src`. Nothing is left behind on failure.
    async fn reflink(&self, cx: &Ctx, src: &Fd, to: &str) -> FopResult<()> {
        let flags = (libc::O_WRONLY | libc::O_EXCL | libc::O_CREAT) as u32;
        let (dst, _) = self.child().create(cx, to, flags, 0o600).await?;
        let r = (|| {
            let from = self.child().backing(cx, src)?;
            let into = self.child().backing(cx, &dst)?;
            rustix::fs::ioctl_ficlone(into, from).map_err(reflink_errno)
        })();
        let _ = self.child().release(cx, dst).await;
        if r.is_err() {
            let _ = self.child().unlink(cx, to).await;
        }
        r
    }
}
