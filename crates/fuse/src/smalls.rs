//! Small files fetched ahead of a reader (general mode): when a small file is opened
//! read-only, the next small files of its directory's listing are fetched whole in the
//! background, and their opens find them waiting — a tree read (`find | xargs cat`, a build
//! reading headers, a backup) waits on one round trip per directory instead of one per file.
//! What is fetched ahead is kept as [`crate::ahead`] says (used once, within the attribute
//! timeout, spoiled by any change), and within 32 MiB.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_client::{DirEntry, Opened, Volume};

use crate::ahead::{Content, Job};
use crate::convert::kind;
use crate::inodes::{join, split};
use crate::KilnFs;

/// Files fetched ahead per open, at most.
const AHEAD: usize = 16;
/// Directories whose files are remembered (all are forgotten past this).
const DIRS_MAX: usize = 1024;

/// The small regular files of recent listings, by directory path, in listing order.
#[derive(Default)]
pub(crate) struct Recent {
    dirs: Mutex<HashMap<String, Arc<Files>>>,
}

struct Files {
    /// Name and FUSE inode.
    list: Vec<(String, u64)>,
    at: HashMap<String, usize>,
}

impl KilnFs {
    /// A listing of `dir` was fetched: its small regular files are remembered.
    pub(crate) fn note_files(&self, dir: &str, entries: &[DirEntry]) {
        if self.small_max == 0 {
            return;
        }
        let list: Vec<(String, u64)> = entries
            .iter()
            .filter(|e| kind(e.attr.mode) == fuser::FileType::RegularFile)
            .filter(|e| e.attr.size <= self.small_max as u64)
            .map(|e| (e.name.clone(), self.fuse_ino(e.attr.ino)))
            .collect();
        if list.len() < 2 {
            return;
        }
        let at = list
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.clone(), i))
            .collect();
        let mut d = self.recent.dirs.lock().unwrap_or_else(|e| e.into_inner());
        if d.len() >= DIRS_MAX {
            d.clear();
        }
        d.insert(dir.to_owned(), Arc::new(Files { list, at }));
    }

    /// A read-only open of small file `path` (inode `ino`) by `caller`: its content if it
    /// was fetched ahead; and the next small files of its directory are fetched ahead now.
    pub(crate) fn small_ahead(&self, caller: &Volume, path: &str, ino: u64) -> Option<Vec<u8>> {
        let got = match self.contents.take(path) {
            Some((i, data)) if i == ino => Some(data),
            _ => None,
        };
        let (dir, name) = split(path);
        let files = self
            .recent
            .dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(dir)
            .cloned();
        let Some(files) = files else {
            return got;
        };
        let Some(&i) = files.at.get(name) else {
            return got;
        };
        let max = self.small_max;
        let next = &files.list[i + 1..files.list.len().min(i + 1 + AHEAD)];
        let inos: HashMap<&str, u64> = next.iter().map(|(n, ino)| (n.as_str(), *ino)).collect();
        let paths = next.iter().map(|(n, _)| join(dir, n));
        self.contents.want(paths, |p| {
            let name = split(p).1;
            let ino = inos.get(name).copied().unwrap_or(0);
            let (vol, at) = (caller.clone(), p.to_owned());
            let job: Job<Content> = Box::new(move || {
                Box::pin(async move {
                    match vol.open_small(&at, libc::O_RDONLY, max).await.ok()? {
                        Opened::Whole(data) => {
                            let cost = data.len().max(1);
                            Some(((ino, data), cost))
                        }
                        // Grown past the limit: not fetched ahead after all.
                        Opened::Fd(fd) => {
                            let _ = vol.close(fd).await;
                            None
                        }
                    }
                })
            });
            job
        });
        got
    }
}
