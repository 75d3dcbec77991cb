//! Snapshots of a directory tree: every file of the tree copied at one instant.
//!
//! A tree snapshot is built from the image snapshot's steps ([`Volume::snapshot`]), run on
//! all the tree's files at once: each file is first copied with its writers running
//! (`SNAP_PREPARE`), then a write barrier is raised on every file (`SNAP_FREEZE`), and only
//! once all of them stand is any copy brought up to its file (`SNAP_TAKE`); then all are
//! lifted. The moment the last barrier went up is the snapshot's instant: every write that
//! finished before it is in the copies, none that started after it is. So the files agree
//! with one another as after a crash of the whole tree at that instant — a database's data and
//! log, a VM's disks.
//!
//! Names are not held: the snapshot has the names the walk found just before the copies. A
//! file made after the walk is not in it; one removed or renamed before its copy is left out
//! and reported.
//!
//! The snapshot is a directory tree beside the original, `PARENT/.BASE@NAME`
//! ([`snapshot_path`]): its directories, regular files and symbolic links with their modes and
//! owners (other kinds of node are left out and reported). The directories are made first;
//! each brick puts a file's copy in its place as it takes it, with the file's mode and owner
//! at the instant. The tree is built under a name no snapshot can have (`.BASE@NAME~`, made
//! exclusively: a second snapshot of the same name at the same time is refused) and renamed
//! into place last, so a torn one is never listed. A clone of it is made the same way from the
//! snapshot's files (barriers and all), so its replicas agree even if someone writes into the
//! snapshot meanwhile: a new tree whose files share the snapshot's blocks. Symbolic links are
//! made by the caller and keep no owner.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::time::{Duration, Instant};

use kiln_layer::exec::join_all;
use kiln_layer::{Attr, Fd};
use kiln_proto::ops::{
    snapshot_name_ok, snapshot_path, SetAttrs, SNAP_FREEZE, SNAP_PREPARE, SNAP_TAKE, SNAP_THAW,
};

use super::Volume;

/// Files worked on side by side.
const WIDTH: usize = 64;

/// What a tree snapshot or clone did.
#[derive(Debug, Default, Clone)]
pub struct TreeReport {
    /// Regular files copied.
    pub files: usize,
    /// Directories made.
    pub dirs: usize,
    /// Symbolic links made.
    pub symlinks: usize,
    /// Entries left out, and why.
    pub skipped: Vec<String>,
    /// Bytes heal makes alike on the replicas (written while the barriers went up).
    pub healing_bytes: u64,
    /// How long writers were held at the barriers.
    pub held: Duration,
    /// Where the time went: each step and how long it took.
    pub steps: Vec<(&'static str, Duration)>,
}

/// True for the name of a snapshot, or of one being made or removed (`.BASE@NAME`,
/// `.BASE@NAME~…`).
pub fn is_snapshot_name(name: &str) -> bool {
    name.starts_with('.')
        && name
            .rsplit_once('@')
            .is_some_and(|(_, n)| snapshot_name_ok(n.split('~').next().unwrap_or(n)))
}

fn join(dir: &str, rel: &str) -> String {
    format!("{}/{rel}", dir.trim_end_matches('/'))
}

fn kind(a: &Attr) -> u32 {
    a.mode & libc::S_IFMT
}

fn einval(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_owned())
}

/// The name a file's copy has on the brick while the tree snapshot `name` is made (as an
/// image snapshot's name: an operator's snapshot `NAME.tree` of a file in the tree would
/// meet it, and the tree snapshot is then refused as existing already).
fn part_name(name: &str) -> String {
    format!("{name}.tree")
}

/// The name a file's copy has on the brick while a clone is made from it.
const CLONE_PART: &str = "kiln-clone";

/// A future of [`each`].
type Boxed<'a, R> = Pin<Box<dyn Future<Output = R> + 'a>>;

/// Runs `f` on every item, [`WIDTH`] at a time; the results in order.
async fn each<'a, T: 'a, R: 'a>(items: &'a [T], f: impl Fn(&'a T) -> Boxed<'a, R>) -> Vec<R> {
    let mut out = Vec::with_capacity(items.len());
    for chunk in items.chunks(WIDTH) {
        let done = join_all(chunk.iter().map(|t| Some(f(t))).collect()).await;
        out.extend(done.into_iter().flatten());
    }
    out
}

/// A tree to copy: its directory, that directory's attributes, and everything under it.
struct Tree<'a> {
    dir: &'a str,
    root: &'a Attr,
    entries: &'a [(String, Attr)],
}

/// A file being snapshotted.
pub(super) struct Taken {
    /// Its path under the tree's root (a tree's file).
    pub(super) rel: String,
    /// The file, open for writing.
    pub(super) fd: Fd,
}

impl Volume {
    /// Every entry under the directory `root` (image snapshots left out), parents before
    /// their children: (path under `root`, attributes).
    pub async fn walk(&self, root: &str) -> io::Result<Vec<(String, Attr)>> {
        self.entries(root, false).await
    }

    /// [`Volume::walk`], image snapshots included with `snapshots`.
    async fn entries(&self, root: &str, snapshots: bool) -> io::Result<Vec<(String, Attr)>> {
        let mut out: Vec<(String, Attr)> = Vec::new();
        // Depth first from a stack: a directory is listed before anything in it.
        let mut dirs = vec![String::new()];
        while let Some(rel) = dirs.pop() {
            let at = if rel.is_empty() {
                root.to_owned()
            } else {
                join(root, &rel)
            };
            let listed = self.readdir(&at).await?;
            let names: std::collections::HashSet<&str> =
                listed.iter().map(|e| e.name.as_str()).collect();
            // A snapshot beside what it is of; a name that only looks like one is walked.
            let snapshot = |n: &str| {
                is_snapshot_name(n)
                    && n[1..]
                        .rsplit_once('@')
                        .is_some_and(|(base, _)| names.contains(base))
            };
            let keep: Vec<bool> = listed
                .iter()
                .map(|e| e.name != "." && e.name != ".." && (snapshots || !snapshot(&e.name)))
                .collect();
            for (e, keep) in listed.into_iter().zip(keep) {
                if !keep {
                    continue;
                }
                let r = if rel.is_empty() {
                    e.name
                } else {
                    join(&rel, &e.name)
                };
                if kind(&e.attr) == libc::S_IFDIR {
                    dirs.push(r.clone());
                }
                out.push((r, e.attr));
            }
        }
        Ok(out)
    }

    /// Snapshot `name` of the directory tree at `dir`: its files copied at one instant (see
    /// the module documentation), as the tree `PARENT/.BASE@NAME`. Writers of any of the
    /// files wait at most `ttl_ms` at the barriers (the snapshot fails rather than hold them
    /// longer).
    pub async fn snapshot_tree(
        &self,
        dir: &str,
        name: &str,
        ttl_ms: u32,
    ) -> io::Result<TreeReport> {
        if !snapshot_name_ok(name) || part_name(name).len() > 64 {
            return Err(einval(
                "a tree snapshot's name: 1 to 59 of A-Z a-z 0-9 . _ -",
            ));
        }
        let target = snapshot_path(dir, name);
        if self.lookup(&target).await.is_ok() {
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        let root = self.lookup(dir).await?;
        if kind(&root) != libc::S_IFDIR {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        let mut report = TreeReport::default();
        let t = Instant::now();
        let entries = self.walk(dir).await?;
        report.steps.push(("walk", t.elapsed()));
        let part = format!("{target}~");
        let pn = part_name(name);
        if self.lookup(&part).await.is_ok() {
            return Err(io::Error::other(format!(
                "{part} exists: another snapshot {name} of this directory is being taken, or one \
                 was interrupted (kiln image rm DIR@{name} removes what it left)"
            )));
        }
        let from = Tree {
            dir,
            root: &root,
            entries: &entries,
        };
        self.copy_tree(&from, &pn, &part, ttl_ms, &mut report)
            .await?;
        if let Err(e) = self.rename(&part, &target, libc::RENAME_NOREPLACE).await {
            let _ = self.remove_tree(&part).await;
            return Err(e);
        }
        Ok(report)
    }

    /// Copies the tree `from` to `to` (which must not exist): its directories first, then its
    /// regular files under barriers standing on all of them at once (internal copy name `pn`;
    /// see the module documentation), then its symlinks. Nothing is left behind on failure.
    async fn copy_tree(
        &self,
        from: &Tree<'_>,
        pn: &str,
        to: &str,
        ttl_ms: u32,
        report: &mut TreeReport,
    ) -> io::Result<()> {
        let t = Instant::now();
        // Made exclusively: a `to` that exists is someone else's, and stays.
        self.dirs(to, from, report).await?;
        report.steps.push(("directories", t.elapsed()));
        let mut files = Vec::new();
        let r = async {
            // A barrier holds writers back: the bricks let only a writer raise one.
            let regular: Vec<&(String, Attr)> = from
                .entries
                .iter()
                .filter(|(_, a)| kind(a) == libc::S_IFREG)
                .collect();
            let opened = each(&regular, |(rel, _)| {
                Box::pin(async move { self.open(&join(from.dir, rel), libc::O_RDWR).await })
            })
            .await;
            let mut failed = None;
            for ((rel, _), r) in regular.into_iter().zip(opened) {
                match r {
                    Ok(fd) => files.push(Taken {
                        rel: rel.clone(),
                        fd,
                    }),
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => report
                        .skipped
                        .push(format!("{rel}: removed during the snapshot")),
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            self.take_all(pn, to, &files, ttl_ms, report).await?;
            self.links(from.dir, to, from.entries, report).await
        }
        .await;
        if r.is_err() {
            let _ = self.remove_tree(to).await;
            for f in &files {
                let copy = snapshot_path(&join(from.dir, &f.rel), pn);
                let _ = self.unlink(&format!("{copy}~")).await;
            }
        }
        let fds: Vec<Fd> = files.into_iter().map(|f| f.fd).collect();
        each(&fds, |fd| {
            Box::pin(async move { self.close(fd.clone()).await })
        })
        .await;
        r
    }

    /// Makes `part` and the directories of `from` in it, with their modes, owners and ACLs.
    async fn dirs(&self, part: &str, from: &Tree<'_>, report: &mut TreeReport) -> io::Result<()> {
        let (root, entries) = (from.root, from.entries);
        self.mkdir(part, root.mode & 0o7777).await?;
        let r = async {
            self.owned(from.dir, part, root).await?;
            // In order: a parent before its children.
            for (rel, attr) in entries.iter().filter(|(_, a)| kind(a) == libc::S_IFDIR) {
                let to = join(part, rel);
                self.mkdir(&to, attr.mode & 0o7777).await?;
                self.owned(&join(from.dir, rel), &to, attr).await?;
                report.dirs += 1;
            }
            Ok(())
        }
        .await;
        if r.is_err() {
            let _ = self.remove_tree(part).await;
        }
        r
    }

    /// The barrier steps on every file: prepare all, freeze all, take all (each copy put in
    /// its place under `part`), thaw all.
    async fn take_all(
        &self,
        pn: &str,
        part: &str,
        files: &[Taken],
        ttl_ms: u32,
        report: &mut TreeReport,
    ) -> io::Result<()> {
        let (r, held, steps) = self.barrier_copy(pn, Some(part), files, ttl_ms).await;
        report.held = held;
        report.steps.extend(steps);
        report.healing_bytes = r?;
        report.files = files.len();
        tracing::info!(part, files = files.len(), "tree copies taken");
        Ok(())
    }

    /// Snapshot `name` of every file at one instant: prepare all, freeze all, take all (a
    /// copy beside its file, or with `part`, at its path under `part`), then thaw all,
    /// whatever happened (the caller removes copies not taken). Answers the bytes heal makes
    /// alike, how long writers were held, and each step's time.
    pub(super) async fn barrier_copy(
        &self,
        name: &str,
        part: Option<&str>,
        files: &[Taken],
        ttl_ms: u32,
    ) -> (io::Result<u64>, Duration, Vec<(&'static str, Duration)>) {
        let steps = std::cell::RefCell::new(Vec::new());
        let step = |cmd: u32| {
            let steps = &steps;
            let t = Instant::now();
            async move {
                let r = each(files, move |f| {
                    Box::pin(async move {
                        let to = match part {
                            Some(p) if cmd == SNAP_TAKE => join(p, &f.rel),
                            _ => String::new(),
                        };
                        self.snap(&f.fd, cmd, name, &to, ttl_ms).await
                    })
                })
                .await;
                let what = match cmd {
                    SNAP_PREPARE => "prepare",
                    SNAP_FREEZE => "freeze",
                    SNAP_TAKE => "take",
                    _ => "thaw",
                };
                steps.borrow_mut().push((what, t.elapsed()));
                r
            }
        };
        let first_err = |rs: Vec<io::Result<Vec<kiln_proto::ops::Extent>>>| {
            let mut bytes = 0;
            for r in rs {
                bytes += r?.iter().filter(|e| !e.hole).map(|e| e.len).sum::<u64>();
            }
            Ok::<u64, io::Error>(bytes)
        };
        let mut held = Duration::ZERO;
        let r = match first_err(step(SNAP_PREPARE).await) {
            Ok(_) => {
                let t = Instant::now();
                let r = match first_err(step(SNAP_FREEZE).await) {
                    Ok(_) => first_err(step(SNAP_TAKE).await),
                    Err(e) => Err(e),
                };
                held = t.elapsed();
                r
            }
            Err(e) => Err(e),
        };
        // Lifts every barrier, and forgets a prepared snapshot not taken, whatever happened
        // (the bricks drop what this connection left when it goes, too).
        let _ = step(SNAP_THAW).await;
        (r, held, steps.into_inner())
    }

    /// Makes the symlinks of `entries` under `part`, and counts what is left out.
    async fn links(
        &self,
        dir: &str,
        part: &str,
        entries: &[(String, Attr)],
        report: &mut TreeReport,
    ) -> io::Result<()> {
        let links: Vec<&String> = entries
            .iter()
            .filter(|(_, a)| kind(a) == libc::S_IFLNK)
            .map(|(rel, _)| rel)
            .collect();
        let done = each(&links, |rel| {
            Box::pin(async move {
                match self.readlink(&join(dir, rel)).await {
                    Ok(t) => self.symlink(&t, &join(part, rel)).await.map(|_| true),
                    Err(_) => Ok(false),
                }
            })
        })
        .await;
        for (r, rel) in done.into_iter().zip(links) {
            if r? {
                report.symlinks += 1;
            } else {
                report
                    .skipped
                    .push(format!("{rel}: removed during the snapshot"));
            }
        }
        for (rel, a) in entries {
            if ![libc::S_IFDIR, libc::S_IFREG, libc::S_IFLNK].contains(&kind(a)) {
                report
                    .skipped
                    .push(format!("{rel}: not a file, directory or symlink"));
            }
        }
        Ok(())
    }

    /// Gives directory `path` the mode and owner in `attr` and the POSIX ACLs (access and
    /// default) of directory `src`, so a copy is never more open than what it copies.
    async fn owned(&self, src: &str, path: &str, attr: &Attr) -> io::Result<()> {
        self.setattr(path, SetAttrs::mode_and_owner(attr)).await?;
        for name in ["system.posix_acl_access", "system.posix_acl_default"] {
            match self.getxattr(src, name).await {
                Ok(acl) => self.setxattr(path, name, &acl, 0).await?,
                // None (or a file system without ACLs): the mode says it all.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENODATA | libc::EOPNOTSUPP)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Makes `to` (which must not exist) a writable clone of the tree snapshot `name` of
    /// `dir`: the same directories, symlinks, modes and owners, files sharing the snapshot's
    /// blocks until written, taken as a snapshot is (see the module documentation). `EAGAIN`
    /// while heal still makes a file's copies alike; nothing is left behind on failure.
    pub async fn clone_tree(&self, dir: &str, name: &str, to: &str) -> io::Result<TreeReport> {
        let snap = snapshot_path(dir, name);
        let root = self.lookup(&snap).await?;
        if kind(&root) != libc::S_IFDIR {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        let entries = self.walk(&snap).await?;
        let mut report = TreeReport::default();
        let from = Tree {
            dir: &snap,
            root: &root,
            entries: &entries,
        };
        self.copy_tree(
            &from,
            CLONE_PART,
            to,
            kiln_proto::ops::SNAP_TTL_MAX,
            &mut report,
        )
        .await?;
        tracing::info!(dir, snapshot = name, clone = to, "tree clone made");
        Ok(report)
    }

    /// Removes the tree snapshot at `snap` (`PARENT/.BASE@NAME`), and what an interrupted
    /// snapshot of that name left (`…~`): first renamed out of sight (`…~rm`), so an
    /// interrupted removal leaves nothing listed or cloned.
    pub async fn remove_tree_snapshot(&self, snap: &str) -> io::Result<()> {
        let gone = format!("{snap}~rm");
        if self.lookup(&gone).await.is_ok() {
            self.remove_tree(&gone).await?;
        }
        let r = match self.rename(snap, &gone, libc::RENAME_NOREPLACE).await {
            Ok(()) => self.remove_tree(&gone).await,
            Err(e) => Err(e),
        };
        let part = format!("{snap}~");
        match (self.lookup(&part).await, r) {
            (Ok(_), Err(e)) if e.raw_os_error() == Some(libc::ENOENT) => {
                self.remove_tree(&part).await
            }
            (Ok(_), Ok(())) => self.remove_tree(&part).await,
            (_, r) => r,
        }
    }

    /// Removes the directory tree at `path`, and everything in it.
    pub async fn remove_tree(&self, path: &str) -> io::Result<()> {
        let entries = self.entries(path, true).await?;
        for (rel, attr) in entries.iter().rev() {
            let p = join(path, rel);
            if kind(attr) == libc::S_IFDIR {
                self.rmdir(&p).await?;
            } else {
                self.unlink(&p).await?;
            }
        }
        self.rmdir(path).await
    }
}
