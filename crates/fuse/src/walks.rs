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
//! going here and there) gets nothing fetched ahead. Where a walk is in a directory is kept
//! with the directory's listing ([`crate::listed`]): once the directory changed, nothing is
//! fetched ahead in it until it is listed again.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::inodes::join;
use crate::listed::Listing;

/// Subdirectories fetched ahead of a walk, in each directory.
const AHEAD: usize = 6;

/// The order walks go by (where they are in each directory is kept with its listing, see
/// [`crate::listed`]).
#[derive(Default)]
pub(crate) struct Walks {
    /// The order the last walk seen went by: by name (else listing order). A directory no
    /// walk has gone through yet is fetched ahead in it.
    by_name: AtomicBool,
}

impl Walks {
    /// Directory `dir` was listed (`l`): the paths of the subdirectories to fetch ahead now,
    /// its first few in the order walks go by.
    pub(crate) fn listed(&self, dir: &str, l: &Listing) -> Vec<String> {
        after(l, dir, None, self.by_name.load(Ordering::Relaxed))
    }

    /// A walk opened subdirectory `name` of `dir` (whose listing is `l`, when it is kept): the
    /// paths of the subdirectories to fetch ahead, the next few after it in the order the walk
    /// is taking.
    pub(crate) fn opened(&self, l: Option<&Listing>, dir: &str, name: &str) -> Vec<String> {
        let Some((l, r)) = l.and_then(|l| Some((l, l.rank(name)?))) else {
            return Vec::new();
        };
        let i = l.by_name(r).expect("a rank names a subdirectory");
        let by_name = match l.last_then(i) {
            None => self.by_name.load(Ordering::Relaxed),
            Some(p) if p + 1 == i => false,
            Some(p) if l.rank(l.subdir(p)).is_some_and(|pr| pr + 1 == r) => true,
            Some(_) => return Vec::new(),
        };
        self.by_name.store(by_name, Ordering::Relaxed);
        after(l, dir, Some((i, r)), by_name)
    }
}

/// Up to [`AHEAD`] subdirectories of `dir` after the one at listing index `i` and rank `r` by
/// name (from the first, with none), `by_name` or in listing order.
fn after(l: &Listing, dir: &str, at: Option<(usize, usize)>, by_name: bool) -> Vec<String> {
    let next: Box<dyn Iterator<Item = usize>> = match by_name {
        true => {
            let r = at.map_or(0, |(_, r)| r + 1);
            Box::new((r..l.subdirs()).filter_map(|r| l.by_name(r)))
        }
        false => Box::new(at.map_or(0, |(i, _)| i + 1)..l.subdirs()),
    };
    next.take(AHEAD).map(|k| join(dir, l.subdir(k))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::listed::{Listed, Step};

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    /// A listing of subdirectories `n`, with a small file among them (walks skip it).
    fn listing(n: &[String]) -> Listing {
        let mut list: Vec<(String, Step)> = n.iter().map(|s| (s.clone(), Step::Dir)).collect();
        list.insert(list.len() / 2, ("file".into(), Step::Small(7, 1)));
        Listing::new(list)
    }

    /// A walker over the listings kept: `listed`, then `opened` as dirs.rs calls them.
    struct Walker(Walks, Listed);
    impl Walker {
        fn listed(&self, dir: &str, n: Vec<String>) -> Vec<String> {
            let l = self.1.put(dir, listing(&n));
            self.0.listed(dir, &l)
        }
        fn opened(&self, dir: &str, name: &str) -> Vec<String> {
            self.0.opened(self.1.get(dir).as_deref(), dir, name)
        }
    }

    fn walker() -> Walker {
        Walker(Walks::default(), Listed::default())
    }

    #[test]
    fn a_walk_in_listing_order_gets_the_next_in_listing_order() {
        let w = walker();
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
        let w = walker();
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
    fn listed_again_keeps_where_the_walk_is_and_a_forgotten_one_fetches_nothing() {
        let w = walker();
        w.listed("t", names(&["a", "b", "c", "d"]));
        w.opened("t", "a");
        w.listed("t", names(&["a", "b", "c", "d"]));
        assert_eq!(w.opened("t", "b"), names(&["t/c", "t/d"]));
        assert!(w.opened("nowhere", "x").is_empty());
        assert!(w.opened("t", "missing").is_empty());
        assert!(
            w.opened("t", "file").is_empty(),
            "a file is not walked into"
        );
        w.1.forget("t");
        assert!(w.opened("t", "c").is_empty(), "changed since it was listed");
    }
}
