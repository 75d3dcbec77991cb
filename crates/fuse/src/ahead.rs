//! Directory listings fetched ahead of a walk.
//!
//! The kernel asks for one directory at a time, and an `ls -lR`, `find` or `du` waits for each
//! listing in turn (a brick lists and stats some 2,000 entries a millisecond). So when a
//! listing shows subdirectories, the mount fetches their listings in the background, a few at
//! a time, and the walk finds the next one waiting when it gets there.
//!
//! A listing fetched ahead is used once, by the next `opendir` of its directory, and only
//! while younger than the attribute timeout. Any change to the directory's names, or to the
//! attributes of an entry, spoils it: made through this mount (spoiled when the change is
//! done) or by another client (when the brick's push arrives, see [`crate::changes`]). A fetch
//! still running when its directory is spoiled is thrown away when it ends; one that ended
//! before is dropped. So a listing never shows the directory as it was before a change that
//! completed before the listing is used.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kiln_client::Volume;
use kiln_proto::ops::DirEntry;

use crate::xattr::Seen;

/// Fetches running at once.
const RUNNING_MAX: usize = 4;
/// Entries held in listings not yet used; no fetch starts past this.
const ENTRIES_MAX: usize = 256 * 1024;
/// Directories waiting to be fetched, at most (the rest are not fetched ahead).
const QUEUE_MAX: usize = 4096;

/// Listings fetched ahead, and those being fetched.
pub(crate) struct Ahead {
    state: Mutex<State>,
    /// Listings held plus fetches running: spoiling costs nothing when both are none.
    busy: AtomicUsize,
    ttl: Duration,
}

#[derive(Default)]
struct State {
    ready: HashMap<String, Fetched>,
    /// Directories fetching now; those spoiled meanwhile are thrown away when they end.
    running: HashMap<String, bool>,
    queue: VecDeque<(Volume, String, Seen)>,
    queued: HashSet<String>,
    entries: usize,
}

/// A listing, when it was fetched, and what it may tell of extended attributes.
pub(crate) struct Fetched {
    pub entries: Vec<DirEntry>,
    pub seen: Seen,
    at: Instant,
}

impl Ahead {
    /// Listings used within `ttl` of their fetch.
    pub fn new(ttl: Duration) -> Ahead {
        Ahead {
            state: Mutex::default(),
            busy: AtomicUsize::new(0),
            ttl,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, s: &State) {
        self.busy.store(
            s.ready.len() + s.running.len() + s.queue.len(),
            Ordering::Release,
        );
    }

    /// True while listings are held or being fetched (else spoiling has nothing to do).
    pub fn holds(&self) -> bool {
        self.busy.load(Ordering::Acquire) > 0
    }

    /// The listing of `dir` fetched ahead, if one is ready and fresh.
    pub fn take(&self, dir: &str) -> Option<Fetched> {
        if self.busy.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut s = self.state();
        let f = s.ready.remove(dir)?;
        s.entries -= f.entries.len();
        self.count(&s);
        (f.at.elapsed() < self.ttl).then_some(f)
    }

    /// Directory `dir`'s names or an entry's attributes changed: what was fetched of it is
    /// dropped, and a fetch of it now running is thrown away when it ends.
    pub fn spoil(&self, dir: &str) {
        if self.busy.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut s = self.state();
        if let Some(f) = s.ready.remove(dir) {
            s.entries -= f.entries.len();
        }
        if let Some(spoiled) = s.running.get_mut(dir) {
            *spoiled = true;
        }
        self.count(&s);
    }

    /// Anything may have changed: everything is dropped.
    pub fn spoil_all(&self) {
        let mut s = self.state();
        s.ready.clear();
        s.entries = 0;
        s.running.values_mut().for_each(|v| *v = true);
        self.count(&s);
    }

    /// Fetches the listings of `dirs` ahead, as `vol`'s caller; `seen` for each is taken now
    /// (before its fetch: the conservative side).
    pub fn want(self: &Arc<Self>, vol: &Volume, dirs: Vec<String>, seen: impl Fn() -> Seen) {
        if dirs.is_empty() {
            return;
        }
        let mut s = self.state();
        for d in dirs {
            if s.queue.len() >= QUEUE_MAX {
                break;
            }
            if s.ready.contains_key(&d) || s.running.contains_key(&d) || s.queued.contains(&d) {
                continue;
            }
            s.queued.insert(d.clone());
            s.queue.push_back((vol.clone(), d, seen()));
        }
        let starts = self.next(&mut s);
        self.count(&s);
        drop(s);
        for (vol, dir, seen) in starts {
            self.fetch(vol, dir, seen);
        }
    }

    /// Takes what may start now off the queue.
    fn next(&self, s: &mut State) -> Vec<(Volume, String, Seen)> {
        let mut out = Vec::new();
        while s.running.len() < RUNNING_MAX && s.entries < ENTRIES_MAX {
            let Some((vol, dir, seen)) = s.queue.pop_front() else {
                break;
            };
            s.queued.remove(&dir);
            s.running.insert(dir.clone(), false);
            out.push((vol, dir, seen));
        }
        out
    }

    fn fetch(self: &Arc<Self>, vol: Volume, dir: String, seen: Seen) {
        let me = self.clone();
        let at = Instant::now();
        kiln_client::spawn(async move {
            let r = vol.readdir(&dir).await;
            let starts = {
                let mut s = me.state();
                let spoiled = s.running.remove(&dir).unwrap_or(true);
                match r {
                    Ok(entries) if !spoiled => {
                        s.entries += entries.len();
                        s.ready.insert(dir, Fetched { entries, seen, at });
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!(dir, "listing ahead failed: {e}"),
                }
                let starts = me.next(&mut s);
                me.count(&s);
                starts
            };
            for (vol, dir, seen) in starts {
                me.fetch(vol, dir, seen);
            }
        });
    }
}

/// The parent directory's path of `path` (the root's is the root).
pub(crate) fn parent(path: &str) -> &str {
    path.rfind('/').map_or("", |i| &path[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents() {
        assert_eq!(parent("a/b/c"), "a/b");
        assert_eq!(parent("a"), "");
        assert_eq!(parent(""), "");
    }
}
