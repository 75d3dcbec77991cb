//! Inode numbers and the paths they are reached by.
//!
//! The wire protocol names files by path; FUSE names them by inode. A node's number is the
//! brick's inode number (so hard links share one, as `stat` users expect), except the volume
//! root, which is FUSE's 1. A node remembers every path it was reached by, so that unlinking
//! one name of a hard-linked file leaves the others usable, and renames rewrite the paths of
//! everything below a moved directory.

use std::collections::HashMap;

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
    root_brick_ino: u64,
}

/// Joins a parent path and a name.
pub fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}/{name}")
    }
}

impl Inodes {
    /// A table whose root is the brick inode `root_brick_ino`.
    pub fn new(root_brick_ino: u64) -> Inodes {
        let mut nodes = HashMap::new();
        nodes.insert(
            ROOT,
            Node {
                paths: vec![String::new()],
                lookups: 1,
            },
        );
        Inodes {
            nodes,
            root_brick_ino,
        }
    }

    /// The FUSE inode for a brick inode.
    pub fn fuse_ino(&self, brick_ino: u64) -> u64 {
        if brick_ino == self.root_brick_ino {
            ROOT
        } else if brick_ino == ROOT {
            // A brick file with inode 1 would collide with the root; move it out of the way.
            u64::MAX - 1
        } else {
            brick_ino
        }
    }

    /// A path of `ino`, if the kernel still holds it.
    pub fn path(&self, ino: u64) -> Option<String> {
        self.nodes.get(&ino).and_then(|n| n.paths.first().cloned())
    }

    /// Records that the kernel learnt `ino` as `path` (one more lookup).
    pub fn learn(&mut self, ino: u64, path: &str) {
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
                self.nodes.remove(&ino);
            }
        }
    }

    /// `path` no longer exists (unlink, rmdir, or the target of a rename).
    pub fn unlinked(&mut self, path: &str) {
        for n in self.nodes.values_mut() {
            n.paths.retain(|p| p != path);
        }
    }

    /// `from` is now `to`: rewrite it and every path below it.
    pub fn renamed(&mut self, from: &str, to: &str) {
        self.unlinked(to);
        let prefix = format!("{from}/");
        for n in self.nodes.values_mut() {
            for p in n.paths.iter_mut() {
                if p == from {
                    *p = to.to_owned();
                } else if let Some(rest) = p.strip_prefix(&prefix) {
                    *p = format!("{to}/{rest}");
                }
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
        t.forget(9, 2);
        assert_eq!(t.path(9), None);
        assert_eq!(join("", "n"), "n");
        assert_eq!(join("d", "n"), "d/n");
    }
}
