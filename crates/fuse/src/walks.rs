//! The order a walk opens subdirectories in, so that the listings fetched ahead (see
//! [`crate::dirs`]) are the next few it opens rather than all of a directory's at once.
//!
//! `find`, `du`, `tar` and `cp -r` open subdirectories in listing order; `ls -R` and `rsync`
//! by name. Fetching every subdirectory when a directory was opened fetched many in the wrong
//! order, or too early: `ls -lR` of 100 directories of 1,000 entries listed each twice on the
//! brick (opened while its fetch was still queued, or after the attribute timeout had made it
//! unusable). Now a directory's first few subdirectories are fetched when it is opened, in the
//! order walks were last seen to take, and each time a walk opens a subdirectory, the next few
//! after it in the order it is taking: listing order when it opened the next one in the
//! listing, name order when it opened the next one by name. A walk doing neither (a reader
//! going here and there) gets nothing fetched ahead.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use kiln_proto::sync::MutexExt as _;
use rustc_hash::FxHashMap;

use crate::inodes::join;

/// Subdirectories fetched ahead of a walk, in each directory.
const AHEAD: usize = 6;
/// Directories whose subdirectories are remembered (all are forgotten past this).
const DIRS_MAX: usize = 4096;

/// The subdirectories of recently opened directories, and where walks are in them.
#[derive(Default)]
pub(crate) struct Walks {
    dirs: Mutex<FxHashMap<String, Subdirs>>,
    /// The order the last walk seen went by: by name (else listing order). A directory no
    /// walk has gone through yet is fetched ahead in it.
    by_name: AtomicBool,
}

struct Subdirs {
    /// In listing order.
    names: Vec<String>,
    /// Indices into `names`, by name.
    sorted: Vec<u32>,
    /// The subdirectory opened last, as an index into `names`.
    last: Option<u32>,
}

impl Subdirs {
    fn new(names: Vec<String>) -> Subdirs {
        let mut sorted: Vec<u32> = (0..names.len() as u32).collect();
        sorted.sort_unstable_by(|a, b| names[*a as usize].cmp(&names[*b as usize]));
        Subdirs {
            names,
            sorted,
            last: None,
        }
    }

    /// Where `name` is in [`Subdirs::sorted`].
    fn rank(&self, name: &str) -> Option<usize> {
        self.sorted
            .binary_search_by(|i| self.names[*i as usize].as_str().cmp(name))
            .ok()
    }

    /// Up to [`AHEAD`] subdirectories after the one at listing index `i` and rank `r` by
    /// name (from the first, with none), `by_name` or in listing order.
    fn after(&self, dir: &str, at: Option<(usize, usize)>, by_name: bool) -> Vec<String> {
        let next: Box<dyn Iterator<Item = usize>> = match by_name {
            true => {
                let r = at.map_or(0, |(_, r)| r + 1);
                Box::new(self.sorted.iter().skip(r).map(|k| *k as usize))
            }
            false => Box::new(at.map_or(0, |(i, _)| i + 1)..self.names.len()),
        };
        next.take(AHEAD)
            .map(|k| join(dir, &self.names[k]))
            .collect()
    }
}

impl Walks {
    /// Directory `dir` was listed with subdirectories `names` (in listing order): the paths
    /// of those to fetch ahead now, its first few in the order walks go by.
    pub(crate) fn listed(&self, dir: &str, names: Vec<String>) -> Vec<String> {
        let mut new = Subdirs::new(names);
        let out = new.after(dir, None, self.by_name.load(Ordering::Relaxed));
        let mut dirs = self.dirs.locked();
        if let Some(old) = dirs.get(dir) {
            // Listed again while a walk goes through it: where it is stays known.
            let last = old.last.map(|i| old.names[i as usize].as_str());
            new.last = last.and_then(|n| new.rank(n)).map(|r| new.sorted[r]);
        }
        if dirs.len() >= DIRS_MAX && !dirs.contains_key(dir) {
            dirs.clear();
        }
        dirs.insert(dir.to_owned(), new);
        out
    }

    /// A walk opened subdirectory `name` of `dir`: the paths of the subdirectories to fetch
    /// ahead, the next few after it in the order the walk is taking.
    pub(crate) fn opened(&self, dir: &str, name: &str) -> Vec<String> {
        let mut dirs = self.dirs.locked();
        let Some(d) = dirs.get_mut(dir) else {
            return Vec::new();
        };
        let Some(r) = d.rank(name) else {
            return Vec::new();
        };
        let i = d.sorted[r] as usize;
        let by_name = match d.last.replace(i as u32).map(|p| p as usize) {
            None => self.by_name.load(Ordering::Relaxed),
            Some(p) if p + 1 == i => false,
            Some(p) if d.rank(&d.names[p]).is_some_and(|pr| pr + 1 == r) => true,
            Some(_) => return Vec::new(),
        };
        self.by_name.store(by_name, Ordering::Relaxed);
        d.after(dir, Some((i, r)), by_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_walk_in_listing_order_gets_the_next_in_listing_order() {
        let w = Walks::default();
        let listed: Vec<String> = (0..10).rev().map(|i| format!("d{i}")).collect();
        assert_eq!(
            w.listed("top", listed),
            names(&["top/d9", "top/d8", "top/d7", "top/d6", "top/d5", "top/d4"])
        );
        assert_eq!(
            w.opened("top", "d9").len(),
            AHEAD,
            "a first opened: the default order"
        );
        assert_eq!(
            w.opened("top", "d8"),
            names(&["top/d7", "top/d6", "top/d5", "top/d4", "top/d3", "top/d2"])
        );
        assert_eq!(
            w.opened("top", "d1"),
            Vec::<String>::new(),
            "a jump: nothing"
        );
    }

    #[test]
    fn a_walk_by_name_gets_the_next_by_name_and_new_directories_follow() {
        let w = Walks::default();
        let listed: Vec<String> = (0..10).rev().map(|i| format!("d{i}")).collect();
        w.listed("top", listed);
        assert!(w.opened("top", "d0").is_empty(), "last in listing order");
        assert_eq!(
            w.opened("top", "d1"),
            names(&["top/d2", "top/d3", "top/d4", "top/d5", "top/d6", "top/d7"])
        );
        // The next directory listed is fetched ahead by name from its first.
        assert_eq!(
            w.listed("top/d1", names(&["z", "b", "a"])),
            names(&["top/d1/a", "top/d1/b", "top/d1/z"])
        );
        assert_eq!(w.opened("top", "d9"), Vec::<String>::new(), "the end");
    }

    #[test]
    fn listed_again_keeps_where_the_walk_is() {
        let w = Walks::default();
        w.listed("t", names(&["a", "b", "c", "d"]));
        w.opened("t", "a");
        w.listed("t", names(&["a", "b", "c", "d"]));
        assert_eq!(w.opened("t", "b"), names(&["t/c", "t/d"]));
        assert!(w.opened("nowhere", "x").is_empty());
        assert!(w.opened("t", "missing").is_empty());
    }
}
