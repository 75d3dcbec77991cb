//! Hard links healed as links: a name the target missed that is one of several names of a
//! file on the source is made, on the target, a link to another name of that file the target
//! already holds — not a copy that would part from the original at the next write.

use std::collections::{HashSet, VecDeque};

use crate::marks as m;
use crate::{Ctx, LayerRef};

use super::entries::{child, kind, list};

/// Most names looked at in the search for another link (past the parent directory).
const SEARCH: usize = 100_000;

/// The parent directory of `path` (`""`: the root).
fn parent(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(d, _)| d)
}

/// Another name of the source's file `ino` that the target holds as a regular file and that
/// is not itself waiting for an entry heal there: the parent of `path` is searched first,
/// then the whole tree (at most [`SEARCH`] names).
pub(super) async fn other_name(
    s: &LayerRef,
    t: &LayerRef,
    path: &str,
    ino: u64,
    target: usize,
) -> Option<String> {
    let cx = &Ctx::NONE;
    let mut todo: VecDeque<String> = VecDeque::from([parent(path).to_owned(), String::new()]);
    let mut seen: HashSet<String> = HashSet::new();
    let mut looked = 0usize;
    while let Some(dir) = todo.pop_front() {
        if !seen.insert(dir.clone()) || looked > SEARCH {
            continue;
        }
        let Ok(entries) = list(s, &dir).await else {
            continue;
        };
        for (name, a) in entries {
            looked += 1;
            let p = child(&dir, &name);
            if kind(&a) == libc::S_IFDIR {
                todo.push_back(p);
                continue;
            }
            if a.ino != ino || p == path || kind(&a) != libc::S_IFREG {
                continue;
            }
            let on_target = t.lookup(cx, &p).await;
            if !on_target.is_ok_and(|ta| kind(&ta) == libc::S_IFREG) {
                continue;
            }
            // A name the target missed a change of may hold another file there.
            let Ok(page) = s.pending(cx, &p, &()).await else {
                continue;
            };
            let flagged = page
                .targets
                .0
                .iter()
                .any(|x| x.target as usize == target && x.flags & m::ENTRY != 0);
            if !flagged {
                return Some(p);
            }
        }
    }
    None
}
