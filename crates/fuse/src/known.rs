//! Directories whose every name this mount knows: a lookup of any other name there is
//! answered "no such file" without asking a brick — for the caller who made the directory
//! only (another may not be allowed to search it: the brick answers them).
//!
//! Creating a file asks the kernel to look its name up first, and in a directory this mount
//! just made (an untar, a build, a checkout) the brick always says there is none: a round
//! trip per file for nothing. A directory made through this mount starts known and empty;
//! names created or removed in it through this mount keep it known; anything else forgets it:
//! a failed change in it, a rename of it, another client's change in it (pushed by the brick,
//! see [`crate::changes`]), a lost brick connection. It is only kept while the bricks push
//! changes, and for the attribute timeout at most (the bound the README gives for what a push
//! cannot cover).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kiln_proto::sync::MutexExt as _;
use kiln_proto::Cred;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use crate::callers::same_caller;

/// The longest name a brick takes (Linux's `NAME_MAX`).
const NAME_MAX: usize = 255;
/// Directories known at most (all are forgotten past this).
const DIRS_MAX: usize = 4096;
/// Names one known directory may hold (it is forgotten past this).
const NAMES_MAX: usize = 65536;

/// Known directories by path.
pub(crate) struct Known {
    dirs: Mutex<HashMap<String, Dir>>,
    /// The bricks push changes: without that, nothing is known.
    pushed: AtomicBool,
    /// Bumped by every push that forgets: a directory made while one arrived is not known
    /// (the push may have been about it, before it was).
    epoch: AtomicU64,
    ttl: Duration,
}

struct Dir {
    names: HashSet<String>,
    since: Instant,
    /// Who made it: the only caller answered from what is known of it.
    who: Arc<Cred>,
}

/// What a change through this mount did to a name.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Name {
    /// The name now exists.
    Exists,
    /// The name is gone.
    Gone,
    /// Not known (the change failed, or moved something): its directory is forgotten.
    Unknown,
}

impl Known {
    /// Nothing known; directories are kept for `ttl` at most.
    pub fn new(ttl: Duration) -> Known {
        Known {
            dirs: Mutex::default(),
            pushed: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            ttl,
        }
    }

    fn dirs(&self) -> MutexGuard<'_, HashMap<String, Dir>> {
        self.dirs.locked()
    }

    /// The bricks push changes from now on (`on`), or may not (everything is forgotten).
    pub fn pushes(&self, on: bool) {
        self.pushed.store(on, Ordering::Release);
        if !on {
            self.forget_all();
        }
    }

    /// True when `name` is surely not in directory `dir`, and `who` may be told so (they made
    /// it). A name the brick would refuse, too long for it, is left for the brick to refuse.
    pub fn absent(&self, dir: &str, name: &str, who: &Cred) -> bool {
        if !self.pushed.load(Ordering::Acquire) || name.len() > NAME_MAX {
            return false;
        }
        let mut d = self.dirs();
        match d.get(dir) {
            Some(k) if k.since.elapsed() < self.ttl => {
                same_caller(&k.who, who) && !k.names.contains(name)
            }
            Some(_) => {
                d.remove(dir);
                false
            }
            None => false,
        }
    }

    /// Read before making a directory, for [`Known::made_dir`].
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Directory `dir` was just made through this mount by `who` (`epoch` read before):
    /// empty, unless a push forgot something meanwhile.
    pub fn made_dir(&self, dir: &str, epoch: u64, who: &Arc<Cred>) {
        if !self.pushed.load(Ordering::Acquire) {
            return;
        }
        let mut d = self.dirs();
        if self.epoch.load(Ordering::Acquire) != epoch {
            return;
        }
        if d.len() >= DIRS_MAX {
            d.clear();
        }
        let k = Dir {
            names: HashSet::default(),
            since: Instant::now(),
            who: who.clone(),
        };
        d.insert(dir.to_owned(), k);
    }

    /// `name` in `dir` was changed through this mount, with outcome `made`.
    pub fn named(&self, dir: &str, name: &str, made: Name) {
        let mut d = self.dirs();
        if d.is_empty() {
            return;
        }
        let Some(k) = d.get_mut(dir) else {
            return;
        };
        match made {
            Name::Exists if k.names.len() < NAMES_MAX => {
                k.names.insert(name.to_owned());
            }
            Name::Gone => {
                k.names.remove(name);
            }
            _ => {
                d.remove(dir);
            }
        }
    }

    /// Another client changed something in (or of) `dir`, or it was renamed: forgotten.
    pub fn forget(&self, dir: &str) {
        let mut d = self.dirs();
        self.epoch.fetch_add(1, Ordering::AcqRel);
        if !d.is_empty() {
            d.remove(dir);
        }
    }

    /// `dir` was renamed, replaced or removed: it and every directory below it is forgotten.
    pub fn forget_tree(&self, dir: &str) {
        let mut d = self.dirs();
        self.epoch.fetch_add(1, Ordering::AcqRel);
        if d.is_empty() {
            return;
        }
        let below = format!("{dir}/");
        d.retain(|p, _| p != dir && !p.starts_with(&below));
    }

    /// Anything may have changed: everything is forgotten.
    pub fn forget_all(&self) {
        let mut d = self.dirs();
        self.epoch.fetch_add(1, Ordering::AcqRel);
        d.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The caller making the directories.
    fn me() -> Arc<Cred> {
        Arc::new(Cred {
            uid: 1001,
            gid: 1001,
            groups: vec![],
        })
    }

    #[test]
    fn only_the_maker_is_told_a_name_is_absent() {
        let k = Known::new(Duration::from_secs(60));
        k.pushes(true);
        k.made_dir("d", k.epoch(), &me());
        assert!(k.absent("d", "x", &me()));
        assert!(!k.absent("d", "x", &Cred::default()), "root asks the brick");
        let other = Cred {
            uid: 1002,
            ..(*me()).clone()
        };
        assert!(!k.absent("d", "x", &other), "so does another user");
    }

    #[test]
    fn a_made_directory_is_known_until_something_else_happens() {
        let k = Known::new(Duration::from_secs(60));
        k.made_dir("d", k.epoch(), &me());
        assert!(
            !k.absent("d", "x", &me()),
            "nothing is known without pushes"
        );
        k.pushes(true);
        k.made_dir("d", k.epoch(), &me());
        assert!(k.absent("d", "x", &me()));
        assert!(
            !k.absent("d", &"n".repeat(256), &me()),
            "ENAMETOOLONG is the brick's to say"
        );
        k.named("d", "x", Name::Exists);
        assert!(!k.absent("d", "x", &me()));
        k.named("d", "x", Name::Gone);
        assert!(k.absent("d", "x", &me()));
        k.named("d", "y", Name::Unknown);
        assert!(
            !k.absent("d", "z", &me()),
            "forgotten after a failed change"
        );
        k.made_dir("e", k.epoch(), &me());
        k.forget("e");
        let before = k.epoch();
        k.forget("elsewhere");
        k.made_dir("h", before, &me());
        assert!(!k.absent("h", "z", &me()), "a push came while it was made");
        assert!(!k.absent("e", "z", &me()));
        k.made_dir("f", k.epoch(), &me());
        k.pushes(false);
        k.pushes(true);
        assert!(!k.absent("f", "z", &me()), "forgotten when pushes stop");
        let short = Known::new(Duration::ZERO);
        short.pushes(true);
        short.made_dir("g", short.epoch(), &me());
        assert!(
            !short.absent("g", "z", &me()),
            "kept no longer than the timeout"
        );
    }
}
