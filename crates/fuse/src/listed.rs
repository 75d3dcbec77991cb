//! The directories this mount listed lately, by path: the entries a walk goes through (small
//! regular files and subdirectories, in listing order) and where a walk is among the
//! subdirectories. One store, two readers: [`crate::walks`] picks the subdirectory listings
//! to fetch ahead from it, [`crate::smalls`] the small files.
//!
//! A listing is forgotten when its directory's entries change (another client's change
//! pushed by a brick, or one through this mount), with those below it when it is renamed or
//! removed, and every listing when a brick's pushes stop; past [`DIRS_MAX`] directories all
//! are. Nothing here answers a caller: it only says what to fetch ahead, and the fetches
//! ask the bricks as the caller.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_proto::sync::MutexExt as _;
use rustc_hash::FxHashMap;

/// Directories remembered (all are forgotten past this).
const DIRS_MAX: usize = 4096;
/// [`Listing::last`] before a walk opened any subdirectory.
const NONE: u32 = u32::MAX;

/// An entry a walk may go through.
pub(crate) enum Step {
    /// A small regular file: its FUSE inode and listed size.
    Small(u64, u64),
    /// A subdirectory.
    Dir,
}

/// One directory's listing.
pub(crate) struct Listing {
    /// Small regular files and subdirectories, in listing order (other entries left out).
    pub(crate) list: Vec<(String, Step)>,
    /// Where each entry is in `list`.
    pub(crate) at: FxHashMap<String, usize>,
    /// The subdirectories in listing order, as indices into `list`.
    subdirs: Vec<u32>,
    /// Indices into `subdirs`, by name.
    sorted: Vec<u32>,
    /// The subdirectory a walk opened last, as an index into `subdirs` ([`NONE`]: none).
    last: AtomicU32,
}

impl Listing {
    /// A listing of `entries` (name and what it is, in listing order).
    pub(crate) fn new(list: Vec<(String, Step)>) -> Listing {
        let at = list
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.clone(), i))
            .collect();
        let subdirs: Vec<u32> = (0..list.len() as u32)
            .filter(|i| matches!(list[*i as usize].1, Step::Dir))
            .collect();
        let mut sorted: Vec<u32> = (0..subdirs.len() as u32).collect();
        let name = |k: &u32| list[subdirs[*k as usize] as usize].0.as_str();
        sorted.sort_unstable_by(|a, b| name(a).cmp(name(b)));
        Listing {
            list,
            at,
            subdirs,
            sorted,
            last: AtomicU32::new(NONE),
        }
    }

    /// Subdirectory `k` (an index into the subdirectories in listing order)'s name.
    pub(crate) fn subdir(&self, k: usize) -> &str {
        &self.list[self.subdirs[k] as usize].0
    }

    /// How many subdirectories it has.
    pub(crate) fn subdirs(&self) -> usize {
        self.subdirs.len()
    }

    /// The subdirectory `r`-th by name, as an index into the subdirectories in listing order.
    pub(crate) fn by_name(&self, r: usize) -> Option<usize> {
        self.sorted.get(r).map(|k| *k as usize)
    }

    /// Where subdirectory `name` is by name.
    pub(crate) fn rank(&self, name: &str) -> Option<usize> {
        self.sorted
            .binary_search_by(|k| self.subdir(*k as usize).cmp(name))
            .ok()
    }

    /// The subdirectory a walk opened last (in listing order), and makes it `now`.
    pub(crate) fn last_then(&self, now: usize) -> Option<usize> {
        let was = self.last.swap(now as u32, Relaxed);
        (was != NONE).then_some(was as usize)
    }
}

/// The listings, by directory path.
#[derive(Default)]
pub(crate) struct Listed {
    dirs: Mutex<FxHashMap<String, Arc<Listing>>>,
}

impl Listed {
    /// `dir` was listed: its listing is kept (and where a walk was among its subdirectories,
    /// if it was listed before).
    pub(crate) fn put(&self, dir: &str, new: Listing) -> Arc<Listing> {
        let mut dirs = self.dirs.locked();
        if let Some(old) = dirs.get(dir) {
            let last = old.last.load(Relaxed);
            let kept = (last != NONE)
                .then(|| new.rank(old.subdir(last as usize)))
                .flatten()
                .and_then(|r| new.by_name(r));
            if let Some(k) = kept {
                new.last.store(k as u32, Relaxed);
            }
        }
        if dirs.len() >= DIRS_MAX && !dirs.contains_key(dir) {
            dirs.clear();
        }
        let new = Arc::new(new);
        dirs.insert(dir.to_owned(), new.clone());
        new
    }

    /// `dir`'s listing, if it is kept.
    pub(crate) fn get(&self, dir: &str) -> Option<Arc<Listing>> {
        self.dirs.locked().get(dir).cloned()
    }

    /// Every listing kept, for a walk through several.
    pub(crate) fn all(&self) -> MutexGuard<'_, FxHashMap<String, Arc<Listing>>> {
        self.dirs.locked()
    }

    /// Directory `dir`'s entries changed: its listing is forgotten, so no walk fetches ahead
    /// an entry as what it was — a regular file now replaced by a FIFO or a directory, say.
    pub(crate) fn forget(&self, dir: &str) {
        let mut d = self.dirs.locked();
        if !d.is_empty() {
            d.remove(dir);
        }
    }

    /// `path` was renamed, replaced or removed: its listing and those below it are forgotten.
    pub(crate) fn forget_tree(&self, path: &str) {
        let below = format!("{path}/");
        let mut d = self.dirs.locked();
        d.retain(|p, _| p != path && !p.starts_with(&below));
    }

    /// Anything may have changed: every listing is forgotten.
    pub(crate) fn forget_all(&self) {
        self.dirs.locked().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listing of subdirectories `names` (in listing order) and a small file `f`.
    pub(crate) fn dirs(names: &[&str]) -> Listing {
        let mut list: Vec<(String, Step)> =
            names.iter().map(|n| (n.to_string(), Step::Dir)).collect();
        list.insert(1.min(list.len()), ("f".into(), Step::Small(9, 1)));
        Listing::new(list)
    }

    #[test]
    fn subdirectories_are_ranked_by_name_and_found_in_listing_order() {
        let l = dirs(&["c", "a", "b"]);
        assert_eq!(l.subdirs(), 3);
        assert_eq!(l.at["f"], 1);
        let by_name: Vec<&str> = (0..3).map(|r| l.subdir(l.by_name(r).unwrap())).collect();
        assert_eq!(by_name, ["a", "b", "c"]);
        assert_eq!(l.rank("b"), Some(1));
        assert_eq!(l.rank("f"), None, "a file is no subdirectory");
    }

    #[test]
    fn listed_again_keeps_where_the_walk_is_and_changes_forget() {
        let listed = Listed::default();
        let l = listed.put("t", dirs(&["a", "b", "c"]));
        assert_eq!(l.last_then(0), None);
        // Listed again with a new entry first: the walk is still at "a".
        let l = listed.put("t", dirs(&["z", "a", "b", "c"]));
        assert_eq!(l.last_then(2).map(|k| l.subdir(k)), Some("a"));
        listed.put("t/a", dirs(&[]));
        listed.put("u", dirs(&[]));
        listed.forget_tree("t");
        assert!(listed.get("t").is_none() && listed.get("t/a").is_none());
        assert!(listed.get("u").is_some());
        listed.forget("u");
        assert!(listed.all().is_empty());
    }
}
