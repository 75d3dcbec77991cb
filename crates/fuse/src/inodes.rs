//! Inode numbers and the paths they are reached by.
//!
//! The wire protocol names files by path; FUSE names them by inode. A node's number is the
//! brick's inode number (so hard links share one, as `stat` users expect), except the volume
//! root, which is FUSE's 1. A node remembers every path it was reached by, so that unlinking
//! one name of a hard-linked file leaves the others usable, and renames rewrite the paths of
//! everything below a moved directory.

use rustc_hash::FxHashMap as HashMap;

/// FUSE's root inode.
pub const ROOT: u64 = 1;

#[derive(Debug, Default)]
struct Node {
    /// Paths (relative to the volume root) this inode is known by; the first is used.
    paths: Vec<String>,
    /// Lookups the kernel holds on this inode (FUSE `nlookup`).
    lookups: u64,
}

/// The inode table.
#[derive(Debug)]
pub struct Inodes {
    nodes: HashMap<u64, Node>,
    /// Each known path's inode (the inverse of the nodes' paths).
    by_path: HashMap<String, u64>,
    root_brick_ino: u64,
}

/// Splits a path into its parent's path and its last name (the inverse of [`join`]).
pub fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

/// Joins a parent path and a name.
pub fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}/{name}")
    }
}

/// The FUSE inode for brick inode `brick_ino` of a volume whose root is `root_brick_ino`.
pub fn fuse_ino(root_brick_ino: u64, brick_ino: u64) -> u64 {
    if brick_ino == root_brick_ino {
        ROOT
    } else if brick_ino == ROOT {
        // A brick file with inode 1 would collide with the root; move it out of the way.
        u64::MAX - 1
    } else {
        brick_ino
    }
}

impl Inodes {
    /// A table whose root is the brick inode `root_brick_ino`.
    pub fn new(root_brick_ino: u64) -> Inodes {
        let mut nodes = HashMap::default();
        nodes.insert(
            ROOT,
            Node {
                paths: vec![String::new()],
                lookups: 1,
            },
        );
        Inodes {
            nodes,
            by_path: HashMap::from_iter([(String::new(), ROOT)]),
            root_brick_ino,
        }
    }

    /// The FUSE inode for a brick inode.
    pub fn fuse_ino(&self, brick_ino: u64) -> u64 {
        fuse_ino(self.root_brick_ino, brick_ino)
    }

    /// A path of `ino`, if the kernel still holds it.
    pub fn path(&self, ino: u64) -> Option<String> {
        self.nodes.get(&ino).and_then(|n| n.paths.first().cloned())
    }

    /// The inode known by `path`, if any.
    pub fn ino_of(&self, path: &str) -> Option<u64> {
        self.by_path.get(path).copied()
    }

    /// Every inode and its path (for forgetting everything).
    pub fn all(&self) -> Vec<(u64, String)> {
        self.by_path.iter().map(|(p, i)| (*i, p.clone())).collect()
    }

    /// Records that the kernel learnt `ino` as `path` (one more lookup).
    pub fn learn(&mut self, ino: u64, path: &str) {
        let old = self.by_path.get(path).copied();
        if old != Some(ino) {
            self.by_path.insert(path.to_owned(), ino);
        }
        if let Some(old) = old.filter(|&o| o != ino) {
            // The name leads to a new file now: the old one is not reached by it.
            if let Some(o) = self.nodes.get_mut(&old) {
                o.paths.retain(|p| p != path);
            }
        }
        let n = self.nodes.entry(ino).or_default();
        if !n.paths.iter().any(|p| p == path) {
            n.paths.insert(0, path.to_owned());
        }
        n.lookups += 1;
    }

    /// The kernel dropped `count` lookups of `ino`.
    pub fn forget(&mut self, ino: u64, count: u64) {
        if ino == ROOT {
            return;
        }
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.lookups = n.lookups.saturating_sub(count);
            if n.lookups == 0 {
                for p in &n.paths {
                    if self.by_path.get(p) == Some(&ino) {
                        self.by_path.remove(p);
                    }
                }
                self.nodes.remove(&ino);
            }
        }
    }

    /// `path` no longer exists (unlink, rmdir, or the target of a rename).
    pub fn unlinked(&mut self, path: &str) {
        if let Some(ino) = self.by_path.remove(path) {
            if let Some(n) = self.nodes.get_mut(&ino) {
                n.paths.retain(|p| p != path);
            }
        }
    }

    /// `from` is now `to`: rewrite it and every path below it.
    pub fn renamed(&mut self, from: &str, to: &str) {
        self.unlinked(to);
        let prefix = format!("{from}/");
        for (ino, n) in self.nodes.iter_mut() {
            for p in n.paths.iter_mut() {
                let new = if p == from {
                    to.to_owned()
                } else if let Some(rest) = p.strip_prefix(&prefix) {
                    format!("{to}/{rest}")
                } else {
                    continue;
                };
                if self.by_path.get(p.as_str()) == Some(ino) {
                    self.by_path.remove(p.as_str());
                }
                self.by_path.insert(new.clone(), *ino);
                *p = new;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_moves_descendants_and_hard_links_survive_unlink() {
        let mut t = Inodes::new(100);
        assert_eq!(t.fuse_ino(100), ROOT);
        t.learn(5, "a");
        t.learn(6, "a/b");
        t.learn(7, "a/b/c");
        t.learn(8, "ab");
        t.renamed("a", "z");
        assert_eq!(t.path(6).as_deref(), Some("z/b"));
        assert_eq!(t.path(7).as_deref(), Some("z/b/c"));
        assert_eq!(
            t.path(8).as_deref(),
            Some("ab"),
            "a prefix that is not a parent stays"
        );
        t.learn(9, "x");
        t.learn(9, "y");
        t.unlinked("y");
        assert_eq!(t.path(9).as_deref(), Some("x"));
        assert_eq!(t.ino_of("z/b/c"), Some(7));
        assert_eq!(t.ino_of("a/b/c"), None);
        assert_eq!(t.ino_of("y"), None);
        assert_eq!(t.ino_of("x"), Some(9));
        t.forget(9, 2);
        assert_eq!(t.path(9), None);
        assert_eq!(t.ino_of("x"), None);
        t.learn(10, "ab");
        assert_eq!(t.ino_of("ab"), Some(10), "a name that leads to a new file");
        assert_eq!(t.path(8), None);
        assert_eq!(join("", "n"), "n");
        assert_eq!(join("d", "n"), "d/n");
    }
}
