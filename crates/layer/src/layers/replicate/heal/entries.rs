//! Healing names and attributes: entries created, removed or re-created and mode, owner,
//! times and user xattrs copied, from a replica that is not behind.

use std::collections::{HashSet, VecDeque};

use crate::exec::join_all;
use crate::marks::{self as m, CondFlag, FlagMark, HealReq, LockReq};
use crate::{errno, Ctx, FopResult, LayerRef};

use super::view::View;
use super::*;

/// The child path `name` of directory `dir` (`""`: the root).
pub(super) fn child(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// Every name in directory `path` of one replica.
pub(super) async fn list(kid: &LayerRef, path: &str) -> FopResult<Vec<(String, crate::Attr)>> {
    let mut out = Vec::new();
    let mut offset = 0;
    loop {
        let page = kid.readdir(&Ctx::NONE, path, offset, 512).await?;
        offset += page.entries.0.len() as u64;
        out.extend(page.entries.0.into_iter().map(|e| (e.name, e.attr)));
        if page.eof {
            return Ok(out);
        }
    }
}

pub(super) fn kind(a: &crate::Attr) -> u32 {
    a.mode & libc::S_IFMT
}

/// Removes `path` from one replica, and, for a directory, all it holds.
pub(super) async fn remove_tree(kid: &LayerRef, path: &str) -> FopResult<()> {
    let cx = &Ctx::NONE;
    let attr = match kid.lookup(cx, path).await {
        Ok(a) => a,
        Err(errno::ENOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    if kind(&attr) != libc::S_IFDIR {
        return match kid.unlink(cx, path).await {
            Ok(()) | Err(errno::ENOENT) => Ok(()),
            Err(e) => Err(e),
        };
    }
    // Depth first, without recursion in async code: directories are removed once emptied.
    let mut stack = vec![(path.to_owned(), false)];
    while let Some((dir, listed)) = stack.pop() {
        if listed {
            match kid.rmdir(cx, &dir).await {
                Ok(()) | Err(errno::ENOENT) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        stack.push((dir.clone(), true));
        for (name, a) in list(kid, &dir).await? {
            let p = child(&dir, &name);
            if kind(&a) == libc::S_IFDIR {
                stack.push((p, false));
            } else {
                match kid.unlink(cx, &p).await {
                    Ok(()) | Err(errno::ENOENT) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(())
}

/// Heals `flags` ([`m::ENTRY`], [`m::META`]) of `path` on `target`, pass after pass until no
/// flag of those is left for it (a flag marked again meanwhile is healed again).
pub(super) async fn heal_flags(
    kids: &[LayerRef],
    up: &[usize],
    path: &str,
    target: usize,
    flags: u32,
) -> FopResult<()> {
    for _ in 0..PASSES {
        let view = View::read(kids, up, path, target).await?;
        let want = view.flagged[target] & flags;
        if want == 0 {
            return Ok(());
        }
        // The source: up, not the target, flagged for nothing that is healed here (an entry
        // heal also copies the attributes); holders first.
        let behind = m::ENTRY | want;
        let others: Vec<usize> = up.iter().copied().filter(|i| *i != target).collect();
        let rest = others.iter().filter(|i| !view.flag_holders.contains(i));
        let Some(src) = view
            .flag_holders
            .iter()
            .chain(rest)
            .copied()
            .find(|i| view.flagged[*i] & behind == 0 && !kids[*i].joining())
        else {
            tracing::warn!(
                path,
                target,
                "no replica that is up is current for this name: left marked"
            );
            return Err(ENODATA);
        };
        let lock = |on: u32| LockReq {
            offset: 0,
            len: m::WHOLE,
            lock: on,
        };
        let (take, drop) = (lock(1), lock(0));
        let t0 = std::time::Instant::now();
        // A session on the target before the lock: a client change of the name that reaches
        // the target before the lock (and the source only after heal read it) is recorded,
        // and heal's own change of that part is skipped there ([`m::SKIPPED`]).
        let session = |begin| HealReq { begin };
        let t = &kids[target];
        super::begin_session(t, path).await?;
        let locked = on_all(kids, up, |k| k.heal_lock(&Ctx::NONE, path, &take)).await;
        let step = match locked {
            Ok(()) => heal_flags_locked(kids, &view, &others, path, target, src, want).await,
            Err(e) => Err(e),
        };
        let _ = on_all(kids, up, |k| k.heal_lock(&Ctx::NONE, path, &drop)).await;
        let _ = t.heal_session(&Ctx::NONE, path, &session(0)).await;
        super::rest(t0.elapsed()).await;
        step?;
    }
    Err(EAGAIN)
}

/// One pass of [`heal_flags`], under the heal lock on `path` on every up replica: makes the
/// target's entry (with [`m::ENTRY`]) and attributes match the source's, then clears what it
/// healed on every other up replica unless a mark was added since `view` was read.
pub(super) async fn heal_flags_locked(
    kids: &[LayerRef],
    view: &View,
    others: &[usize],
    path: &str,
    target: usize,
    src: usize,
    want: u32,
) -> FopResult<()> {
    let cx = &Ctx::NONE;
    let (s, t) = (&kids[src], &kids[target]);
    let sa = match s.lookup(cx, path).await {
        Ok(a) => Some(a),
        Err(errno::ENOENT) => None,
        Err(e) => return Err(e),
    };
    let mut ta = match t.lookup(cx, path).await {
        Ok(a) => Some(a),
        Err(errno::ENOENT) => None,
        Err(e) => return Err(e),
    };
    let mut whole = false;
    let mut clear = want;
    if want & m::ENTRY != 0 {
        // The target's entry is newer (a client changed the name there since the session
        // began, and its change reaches the source after heal read it): it stays, as healed.
        let newer = clear_flags(kids, view, others, path, target, m::ENTRY | m::META, false);
        let Some(sa) = &sa else {
            // Gone on the source: gone on the target (a directory with all it holds).
            if ta.is_some() {
                match remove_tree(t, path).await {
                    Err(m::SKIPPED) => return newer.await,
                    r => r?,
                }
            }
            return clear_flags(kids, view, others, path, target, m::ENTRY | m::META, false).await;
        };
        let same = match &ta {
            Some(a) if kind(a) != kind(sa) => false,
            Some(a) if matches!(kind(sa), libc::S_IFCHR | libc::S_IFBLK) && a.rdev != sa.rdev => {
                false
            }
            Some(_) if kind(sa) == libc::S_IFLNK => {
                s.readlink(cx, path).await? == t.readlink(cx, path).await?
            }
            Some(_) => true,
            None => false,
        };
        if !same && ta.is_some() {
            match remove_tree(t, path).await {
                Err(m::SKIPPED) => return newer.await,
                r => r?,
            }
            ta = None;
        }
        let (names, copy_all) = match make_entry(s, t, path, sa, ta.is_some(), target).await {
            Err(m::SKIPPED) => return newer.await,
            r => r?,
        };
        whole |= copy_all;
        let v = FlagMark {
            target: target as u32,
            flags: m::ENTRY,
        };
        for n in names {
            s.flag_add(cx, &child(path, &n), &v).await?;
        }
        clear |= m::META;
    }
    if let Some(sa) = &sa {
        if kind(sa) != libc::S_IFLNK {
            copy_meta(s, t, path, sa).await?;
        }
    }
    clear_flags(kids, view, others, path, target, clear, whole).await
}

/// Makes the target's entry for `path` like the source's attributes `sa` (the target has one
/// of the same kind when `exists`): a directory, symlink, regular file or special file. Returns
/// the names a directory's heal goes on to (each flagged for the target) and whether a file's
/// bytes must all be copied. A name of a file with other names becomes a hard link to one the
/// target holds ([`other_name`]).
async fn make_entry(
    s: &LayerRef,
    t: &LayerRef,
    path: &str,
    sa: &crate::Attr,
    exists: bool,
    target: usize,
) -> FopResult<(Vec<String>, bool)> {
    let cx = &Ctx::NONE;
    let mut names: Vec<String> = Vec::new();
    let mut whole = false;
    match kind(sa) {
        libc::S_IFDIR => {
            if !exists {
                mkdir_parents(t, path).await?;
                match t.mkdir(cx, path, sa.mode & 0o7777).await {
                    Ok(_) | Err(EEXIST) => {}
                    Err(e) => return Err(e),
                }
            } else {
                // Both have it: what the target holds and the source does not goes too.
                names.extend(list(t, path).await?.into_iter().map(|(n, _)| n));
            }
            // What it holds is healed name by name: flagged on the source for the target.
            names.extend(list(s, path).await?.into_iter().map(|(n, _)| n));
            names.sort_unstable();
            names.dedup();
        }
        libc::S_IFLNK => {
            if !exists {
                mkdir_parents(t, path).await?;
                let to = s.readlink(cx, path).await?;
                t.symlink(cx, &to, path).await?;
            }
        }
        libc::S_IFREG => {
            if !exists {
                mkdir_parents(t, path).await?;
                if sa.nlink > 1 {
                    if let Some(other) = other_name(s, t, path, sa.ino, target).await {
                        match t.link(cx, &other, path).await {
                            // The bytes are the other name's: its own marks heal them.
                            Ok(_) => return Ok((names, false)),
                            Err(e) => tracing::info!(path, other, "heal as a link: errno {e}"),
                        }
                    }
                }
                let flags = (libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY) as u32;
                let (fd, _) = t.create(cx, path, flags, sa.mode & 0o7777).await?;
                let _ = t.release(cx, fd).await;
            }
            // Its bytes may be another file's (created or renamed over while the target
            // was away): all of them are copied.
            whole = true;
        }
        _ => {
            // FIFOs, sockets and device nodes: the same type, permissions and device.
            if !exists {
                mkdir_parents(t, path).await?;
                match t.mknod(cx, path, sa.mode, sa.rdev).await {
                    Ok(_) | Err(EEXIST) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok((names, whole))
}

/// Clears `flags` for `target` on `others`, each unless it added a mark since `view`; with
/// `whole`, marks all the file's bytes for `target` in the same step.
pub(super) async fn clear_flags(
    kids: &[LayerRef],
    view: &View,
    others: &[usize],
    path: &str,
    target: usize,
    flags: u32,
    whole: bool,
) -> FopResult<()> {
    let values: Vec<(usize, CondFlag)> = others
        .iter()
        .filter_map(|i| {
            view.gens[*i].map(|gen| {
                let v = CondFlag {
                    target: target as u32,
                    flags,
                    gen,
                    data: u32::from(whole),
                };
                (*i, v)
            })
        })
        .collect();
    let mut futs = Vec::new();
    for (i, v) in &values {
        futs.push(Some(kids[*i].flag_clear_if(&Ctx::NONE, path, v)));
    }
    for r in join_all(futs).await.into_iter().flatten() {
        match r {
            // Marked again meanwhile: the next pass heals it again.
            Ok(()) | Err(EAGAIN) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Makes the parent directories of `path` on one replica (their own flags set their modes).
pub(super) async fn mkdir_parents(kid: &LayerRef, path: &str) -> FopResult<()> {
    for p in parents(path) {
        match kid.mkdir(&Ctx::NONE, p, 0o755).await {
            Ok(_) | Err(EEXIST) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Copies mode, owner, times and `user.` xattrs of `path` from the source to the target.
pub(super) async fn copy_meta(
    s: &LayerRef,
    t: &LayerRef,
    path: &str,
    sa: &crate::Attr,
) -> FopResult<()> {
    use kiln_proto::ops::{SETATTR_ATIME, SETATTR_GID, SETATTR_MODE, SETATTR_MTIME, SETATTR_UID};
    let cx = &Ctx::NONE;
    let ta = t.lookup(cx, path).await?;
    let mut set = crate::SetAttrs {
        valid: SETATTR_MODE | SETATTR_ATIME | SETATTR_MTIME,
        mode: sa.mode & 0o7777,
        atime: sa.atime.clone(),
        mtime: sa.mtime.clone(),
        ..Default::default()
    };
    if (ta.uid, ta.gid) != (sa.uid, sa.gid) {
        set.valid |= SETATTR_UID | SETATTR_GID;
        set.uid = sa.uid;
        set.gid = sa.gid;
    }
    t.setattr(cx, path, &set).await?;
    let user = |n: &String| n.starts_with("user.");
    let have: Vec<String> = s
        .listxattr(cx, path)
        .await?
        .into_iter()
        .filter(user)
        .collect();
    for n in t.listxattr(cx, path).await?.into_iter().filter(user) {
        if !have.contains(&n) {
            match t.removexattr(cx, path, &n).await {
                // Skipped: a client changed the target's xattrs since heal began (newer).
                Ok(()) | Err(ENODATA) | Err(m::SKIPPED) => {}
                Err(e) => return Err(e),
            }
        }
    }
    for n in &have {
        let v = match s.getxattr(cx, path, n).await {
            Ok(v) => v,
            Err(ENODATA) => continue,
            Err(e) => return Err(e),
        };
        if t.getxattr(cx, path, n).await.ok().as_ref() != Some(&v) {
            match t.setxattr(cx, path, n, &v, 0).await {
                Ok(()) | Err(m::SKIPPED) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

// Hard links healed as links: a name the target missed that is one of several names of a
// file on the source becomes, on the target, a link to another name of that file the target
// already holds — not a copy that would part from the original at the next write.

/// Most names looked at in the search for another link (past the parent directory).
const SEARCH: usize = 100_000;

/// The parent directory of `path` (`""`: the root).
fn parent(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(d, _)| d)
}

/// Another name of the source's file `ino` that the target holds as a regular file and that
/// is not itself waiting for an entry heal there: the parent of `path` is searched first,
/// then the whole tree (at most [`SEARCH`] names).
async fn other_name(
    s: &LayerRef,
    t: &LayerRef,
    path: &str,
    ino: u64,
    target: usize,
) -> Option<String> {
    let cx = &Ctx::NONE;
    let mut todo: VecDeque<String> = VecDeque::from([parent(path).to_owned(), String::new()]);
    let mut seen: HashSet<String> = HashSet::new();
    let mut looked = 0usize;
    while let Some(dir) = todo.pop_front() {
        if !seen.insert(dir.clone()) || looked > SEARCH {
            continue;
        }
        let Ok(entries) = list(s, &dir).await else {
            continue;
        };
        for (name, a) in entries {
            looked += 1;
            let p = child(&dir, &name);
            if kind(&a) == libc::S_IFDIR {
                todo.push_back(p);
                continue;
            }
            if a.ino != ino || p == path || kind(&a) != libc::S_IFREG {
                continue;
            }
            let on_target = t.lookup(cx, &p).await;
            if !on_target.is_ok_and(|ta| kind(&ta) == libc::S_IFREG) {
                continue;
            }
            // A name the target missed a change of may hold another file there.
            let Ok(page) = s.pending(cx, &p, &()).await else {
                continue;
            };
            let flagged = page
                .targets
                .0
                .iter()
                .any(|x| x.target as usize == target && x.flags & m::ENTRY != 0);
            if !flagged {
                return Some(p);
            }
        }
    }
    None
}
