//! Pushes of changes to the connections that watch ([`kiln_proto::Op::Watch`]).
//!
//! A connection that watches is told, unasked, which paths other connections changed: each
//! change is published when its fop has run (just before its reply is queued), and waits in
//! the watcher's set until the watcher's connection sends it. Changes to one path coalesce
//! (a writer of a million blocks costs a watcher one entry until it is sent), and a watcher
//! that falls far behind is told "everything" instead of a list that grows without bound.
//! With no watcher, publishing is one atomic load.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kiln_proto::codec::Seq;
use kiln_proto::ops::{Change, Changes};
use kiln_proto::sync::MutexExt as _;
use tokio::sync::Notify;

/// Paths a watcher keeps before it is told "everything" instead.
const KEEP: usize = 4096;
/// Encoded bytes of one push frame's list, under the argument limit.
const FRAME_BUDGET: usize = 48 * 1024;

/// The brick's watchers.
#[derive(Default)]
pub struct Watchers {
    count: AtomicUsize,
    list: Mutex<Vec<Arc<Watcher>>>,
}

/// One watching connection: what it has not been told yet.
pub struct Watcher {
    conn: u64,
    pending: Mutex<Pending>,
    /// Woken when something was added.
    pub wake: Notify,
}

#[derive(Default)]
struct Pending {
    /// Path → `CHANGE_*` bits.
    paths: HashMap<String, u8>,
    all: bool,
}

impl Watchers {
    /// True when some connection watches.
    pub fn any(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// Connection `conn` starts watching (again: its old watcher is replaced).
    pub fn add(&self, conn: u64) -> Arc<Watcher> {
        let w = Arc::new(Watcher {
            conn,
            pending: Mutex::default(),
            wake: Notify::new(),
        });
        let mut l = self.list.locked();
        l.retain(|x| x.conn != conn);
        l.push(w.clone());
        self.count.store(l.len(), Ordering::Release);
        w
    }

    /// Connection `conn` stops watching (or is gone).
    pub fn remove(&self, conn: u64) {
        let mut l = self.list.locked();
        l.retain(|x| x.conn != conn);
        self.count.store(l.len(), Ordering::Release);
    }

    /// Connection `from` changed `changes` (path, `CHANGE_*` bits): every other watcher is
    /// told.
    pub fn publish(&self, from: u64, changes: &[(String, u8)]) {
        if changes.is_empty() || !self.any() {
            return;
        }
        for w in self.list.locked().iter().filter(|w| w.conn != from) {
            w.add(changes);
        }
    }
}

/// Resolves when `w` has something to push; never without a watcher.
pub async fn pushed(w: Option<&Watcher>) {
    match w {
        Some(w) => w.wake.notified().await,
        None => std::future::pending().await,
    }
}

impl Watcher {
    fn add(&self, changes: &[(String, u8)]) {
        {
            let mut p = self.pending.locked();
            if !p.all {
                for (path, bits) in changes {
                    match p.paths.get_mut(path.as_str()) {
                        Some(b) => *b |= bits,
                        None => {
                            p.paths.insert(path.clone(), *bits);
                        }
                    }
                }
                if p.paths.len() > KEEP {
                    p.paths = HashMap::new();
                    p.all = true;
                }
            }
        }
        self.wake.notify_one();
    }

    /// The next push frame's arguments, if anything waits: at most [`FRAME_BUDGET`] bytes of
    /// paths, the rest left for the next frame.
    pub fn take(&self) -> Option<Changes> {
        let mut p = self.pending.locked();
        if p.all {
            *p = Pending::default();
            return Some(Changes {
                all: true,
                changes: Seq(Vec::new()),
            });
        }
        if p.paths.is_empty() {
            return None;
        }
        let mut out = Vec::new();
        let mut bytes = 0;
        let keys: Vec<String> = p
            .paths
            .keys()
            .take_while(|k| {
                bytes += k.len() + 8;
                bytes <= FRAME_BUDGET
            })
            .cloned()
            .collect();
        for path in keys {
            if let Some(kind) = p.paths.remove(&path) {
                out.push(Change { kind, path });
            }
        }
        Some(Changes {
            all: false,
            changes: Seq(out),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_proto::ops::{CHANGE_ATTR, CHANGE_DATA};

    #[test]
    fn changes_reach_other_watchers_coalesced_and_overflow_to_all() {
        let ws = Watchers::default();
        assert!(!ws.any());
        let a = ws.add(1);
        let b = ws.add(2);
        ws.publish(1, &[("f".into(), CHANGE_DATA), ("f".into(), CHANGE_ATTR)]);
        assert!(
            a.take().is_none(),
            "a change is not pushed to the connection that made it"
        );
        let got = b.take().expect("b is told");
        assert!(!got.all);
        assert_eq!(got.changes.0.len(), 1);
        assert_eq!(got.changes.0[0].kind, CHANGE_DATA | CHANGE_ATTR);
        assert!(b.take().is_none());
        let many: Vec<(String, u8)> = (0..=KEEP).map(|i| (format!("p{i}"), CHANGE_DATA)).collect();
        ws.publish(1, &many);
        assert!(b.take().expect("overflow").all);
        ws.remove(2);
        ws.remove(1);
        assert!(!ws.any());
    }

    #[test]
    fn a_long_list_goes_in_several_frames() {
        let ws = Watchers::default();
        let w = ws.add(7);
        let long: Vec<(String, u8)> = (0..2000)
            .map(|i| (format!("{i:0>60}"), CHANGE_DATA))
            .collect();
        ws.publish(1, &long);
        let mut seen = 0;
        while let Some(c) = w.take() {
            assert!(!c.all);
            assert!(c.changes.0.iter().map(|c| c.path.len() + 8).sum::<usize>() <= FRAME_BUDGET);
            seen += c.changes.0.len();
        }
        assert_eq!(seen, 2000);
    }
}
