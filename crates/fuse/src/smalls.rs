//! Small files fetched ahead of a reader (general mode): when a small file is opened
//! read-only, the small files a walk reaches next are fetched whole in the background, and
//! their opens find them waiting — a tree read (`find | xargs cat`, a build reading headers, a
//! backup) waits on one round trip per directory instead of one per file. What is fetched
//! ahead is kept as [`crate::ahead`] says (used once, within the attribute timeout, spoiled by
//! any change), and within 32 MiB.
//!
//! "Next" is the order of a depth-first walk in listing order (what `find`, `tar` and `cp -r`
//! do): the directory's later entries, at a subdirectory the subdirectory's own entries first
//! (when its listing has been fetched) before the rest of the directory, and at the end of the
//! directory its parent's later entries — through the listings this mount keeps
//! ([`crate::listed`]).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kiln_client::{DirEntry, Opened, Volume};

use crate::ahead::{Content, Job, Who};
use crate::convert::kind;
use crate::files::store_ahead;
use crate::inodes::{fuse_ino, join, split};
use crate::listed::{Listing, Step};
use crate::KilnFs;
use kiln_proto::Cred;

/// Files fetched ahead per open, at most.
const AHEAD: usize = 16;
/// Entries a walk looks at, at most, to find the next [`AHEAD`] small files (an open's cost
/// stays bounded in directories of big files or empty subdirectories).
const WALK_STEPS: usize = 1024;

/// A small file a walk reaches next: its path, FUSE inode and listed size.
struct Next {
    path: String,
    ino: u64,
    size: u64,
}

impl AsRef<str> for Next {
    fn as_ref(&self) -> &str {
        &self.path
    }
}

impl KilnFs {
    /// What a walk goes through in a listing: its small regular files (none when nothing is
    /// fetched ahead) and subdirectories, in listing order.
    pub(crate) fn listing_of(&self, entries: &[DirEntry]) -> Listing {
        let small = self.small_max as u64;
        Listing::new(
            entries
                .iter()
                .filter_map(|e| match kind(e.attr.mode) {
                    fuser::FileType::RegularFile if small > 0 && e.attr.size <= small => Some((
                        e.name.clone(),
                        Step::Small(self.fuse_ino(e.attr.ino), e.attr.size),
                    )),
                    fuser::FileType::Directory => Some((e.name.clone(), Step::Dir)),
                    _ => None,
                })
                .collect(),
        )
    }

    /// The small files a depth-first walk reaches after `name` in `dir`, at most `max`: the
    /// directory's later entries, descending into each subdirectory whose listing is known,
    /// then back up into the parents' later entries (where their listings are known).
    fn walk_after(&self, dir: &str, name: &str, max: usize) -> Vec<Next> {
        let recent = self.listed.all();
        let Some(here) = recent.get(dir) else {
            return Vec::new();
        };
        let Some(&i) = here.at.get(name) else {
            return Vec::new();
        };
        // Directories being walked and the next entry of each; the innermost last.
        let mut stack = vec![(dir.to_owned(), here.clone(), i + 1)];
        // The outermost of them: once it is done, the walk goes on in its parent.
        let mut outer = dir.to_owned();
        let mut out = Vec::new();
        for _ in 0..WALK_STEPS {
            let Some((path, entries, k)) = stack.last_mut() else {
                // A tree of many small directories (`/usr/share/doc`): without this, the
                // first file of each was never fetched ahead.
                if outer.is_empty() {
                    break;
                }
                let (parent, me) = split(&outer);
                let Some((up, k)) = recent
                    .get(parent)
                    .and_then(|up| Some((up.clone(), *up.at.get(me)?)))
                else {
                    break;
                };
                let parent = parent.to_owned();
                stack.push((parent.clone(), up, k + 1));
                outer = parent;
                continue;
            };
            let Some((name, step)) = entries.list.get(*k) else {
                stack.pop(); // this directory is done: back to its parent's next entry
                continue;
            };
            *k += 1;
            match step {
                Step::Small(ino, size) => {
                    out.push(Next {
                        path: join(path, name),
                        ino: *ino,
                        size: *size,
                    });
                    if out.len() == max {
                        break;
                    }
                }
                Step::Dir => {
                    let sub = join(path, name);
                    // A walk reads a subdirectory before the rest of its parent; one not
                    // listed yet ends the prediction (it would be a guess).
                    match recent.get(&sub) {
                        Some(e) => stack.push((sub, e.clone(), 0)),
                        None => break,
                    }
                }
            }
        }
        out
    }

    /// A read-only open of small file `path` (inode `ino`) by `who`: its content if it was
    /// fetched ahead for `who` (waiting for a fetch of it on its way), and whether that content
    /// was put into the page cache as it came. Content fetched for another caller is not
    /// theirs to have: their open goes to the brick, which checks it as them.
    pub(crate) fn small_taken(&self, path: &str, ino: u64, who: &Cred) -> Option<Content> {
        let c = self
            .contents
            .take_waiting(path, who, |w| crate::gate::waiting(w))
            .filter(|c| c.ino == ino)?;
        self.counters.fetched_ahead.fetch_add(1, Relaxed);
        Some(c)
    }

    /// A lookup of `path`: its attributes, if they came with its content fetched ahead and
    /// that is fresh (the kernel forgets a name it was told of after the attribute timeout,
    /// so a reader that follows a listing by more than that looks every name up again), and
    /// for how much longer they may be used. Not for a file with other names: a change
    /// through one of those would not spoil what was fetched by this one. Only for the caller
    /// `who` it was fetched for (another may not be allowed to look it up).
    /// With `ino`, only if the file fetched is still that inode (a getattr's).
    pub(crate) fn small_attr(
        &self,
        path: &str,
        who: &Cred,
        ino: Option<u64>,
    ) -> Option<(kiln_client::Attr, Duration)> {
        let (a, left) = self.contents.peek(path, who, |c| c.attr.clone())?;
        let a = a.filter(|a| a.nlink <= 1)?;
        if ino.is_some_and(|i| self.fuse_ino(a.ino) != i) {
            return None;
        }
        self.counters.looked_up_ahead.fetch_add(1, Relaxed);
        Some((a, left))
    }

    /// Small file `path` was opened read-only by `caller`: the small files a walk reaches
    /// next are fetched ahead for them now (those not held or on their way already), and each is put
    /// into the page cache as it comes, off its opener's path ([`store_ahead`]).
    ///
    /// Fetches go out in bursts: only once the file half a window ahead is not held or on its
    /// way, so that about half a window's requests leave in one `sendmsg` and reach the brick
    /// in one read, rather than one request (and a wake-up on each side) per open.
    pub(crate) fn small_next(&self, (caller, who): (&Volume, &Who), path: &str) {
        let (dir, name) = split(path);
        // Most opens find the file half a window ahead known: only that far is walked first.
        let Some(half) = self.walk_after(dir, name, AHEAD / 2).pop() else {
            return;
        };
        if self.contents.knows(&half.path) {
            return;
        }
        let next = self.walk_after(dir, name, AHEAD);
        caller.batch(|| self.fetch_ahead((caller, who), &next));
    }

    /// Fetches the small files `next` ahead for `caller` ([`KilnFs::small_next`]): theirs
    /// only, as `who`.
    fn fetch_ahead(&self, (caller, who): (&Volume, &Who), next: &[Next]) {
        let max = self.small_max as u64;
        self.contents.want(next, who, |n| {
            let (ino, size) = (n.ino, n.size);
            // Room for the size listed, in whole pages: a file that grew a little still
            // fits, and one that grew past it comes back as a handle (below).
            let room = size.max(1).next_multiple_of(4096).min(max) as u32;
            let (vol, at) = (caller.clone(), n.path.clone());
            let (files, fresh) = (self.files.clone(), self.fresh.clone());
            let counters = self.counters.clone();
            // With the kernel's writeback cache an open never keeps pages stored ahead.
            let store = !self.writeback;
            let root = self.root_brick_ino;
            let job: Job<Content> = Box::new(move || {
                let began = files.before_fetch(ino);
                Box::pin(async move {
                    match vol.open_small(&at, libc::O_RDONLY, room).await.ok()? {
                        Opened::Whole(data, attr) => {
                            // What it holds: its buffer's room (a page at least).
                            let cost = data.capacity().max(1);
                            // Not into the pages of the inode listed if the name is another's now.
                            let same = attr.as_ref().is_none_or(|a| fuse_ino(root, a.ino) == ino);
                            let stored = match store && same {
                                true => store_ahead((&files, &fresh, &counters), ino, &data, began),
                                false => None,
                            };
                            let c = Content {
                                ino,
                                data,
                                stored,
                                attr,
                            };
                            Some((c, cost))
                        }
                        // Grown past the room: not fetched ahead after all.
                        Opened::Fd(fd) => {
                            let _ = vol.close(fd).await;
                            None
                        }
                    }
                })
            });
            job
        });
    }
}
