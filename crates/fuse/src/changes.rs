//! Other clients' changes, pushed by the bricks ([`Volume::watch`]): the kernel is told to
//! forget the names, attributes and cached pages they made stale, so a general mount sees
//! another client's rename, unlink, `chmod` or write as soon as the push arrives instead of
//! when `--attr-timeout` runs out.
//!
//! Pushes arrive on a connection's receiving thread; they are handed to a thread of their own
//! here, because telling the kernel to forget a name waits for the directory's lock, which a
//! request in that directory may hold while it waits for a reply from that same connection.
//! When a brick's connection is lost and comes back, whatever changed meanwhile was not
//! pushed: everything the kernel holds is forgotten then.

use std::ffi::OsStr;
use std::sync::{mpsc, Arc, Mutex};

use fuser::INodeNo;
use kiln_client::volume::Pushed;
use kiln_client::Volume;
use kiln_proto::ops::{Changes, CHANGE_DATA, CHANGE_NAME};
use kiln_proto::sync::MutexExt as _;

use crate::ahead::{parent, Contents, Listings};
use crate::fresh::Fresh;
use crate::inodes::{split, Inodes};
use crate::known::Known;
use crate::listed::Listed;
use crate::xattr::NoXattrs;

/// What applying a push touches.
pub(crate) struct Caches {
    pub ahead: Arc<Listings>,
    pub contents: Arc<Contents>,
    pub known: Arc<Known>,
    /// The directories listed lately, that walks fetch ahead in.
    pub listed: Arc<Listed>,
    pub inodes: Arc<Mutex<Inodes>>,
    pub no_xattrs: Arc<NoXattrs>,
    pub fresh: Arc<Fresh>,
}

/// Asks the bricks of `vol` to push other clients' changes, applied to `caches` on a thread
/// of their own. Returns the first brick's refusal, if any (the mount then relies on
/// `--attr-timeout` for that brick's changes).
pub(crate) fn watch(vol: &Volume, caches: Caches) -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel::<Option<Changes>>();
    let tx = Mutex::new(tx);
    let known = caches.known.clone();
    std::thread::Builder::new()
        .name("kiln-changes".into())
        .spawn(move || {
            for c in rx {
                match c {
                    Some(c) => caches.apply(&c),
                    None => caches.lost(),
                }
            }
        })?;
    kiln_client::block_on(vol.watch(Arc::new(move |p: Pushed<'_>| {
        let c = match p {
            Pushed::Changes(c) => Some(c.clone()),
            Pushed::Lost => None,
        };
        let _ = tx.locked().send(c);
    })))?;
    // Every brick pushes: what this mount alone changed can be known (see [`crate::known`]).
    known.pushes(true);
    Ok(())
}

impl Caches {
    /// A brick's pushes stopped: what only pushes kept true is dropped, and nothing is known
    /// until they resume (a push of "everything" after the reconnect).
    fn lost(&self) {
        tracing::info!("a brick's pushes stopped: relying on --attr-timeout until it is back");
        self.known.pushes(false);
        self.ahead.spoil_all();
        self.contents.spoil_all();
        self.listed.forget_all();
    }

    fn apply(&self, c: &Changes) {
        let Some(n) = self.fresh.notifier() else {
            return;
        };
        if c.all {
            self.ahead.spoil_all();
            self.contents.spoil_all();
            self.listed.forget_all();
            self.known.forget_all();
            // Pushed again (after a reconnect), or a list too long to send: pushes go on.
            self.known.pushes(true);
            let all = self.inodes.locked().all();
            tracing::debug!(
                inodes = all.len(),
                "a brick's changes went unpushed: forgetting all"
            );
            for (ino, path) in all {
                self.forget_inode(n, ino, true);
                self.forget_name(n, &path);
            }
            return;
        }
        for ch in c.changes.0.iter() {
            // Every change shows in the listing of the directory it is in; a directory
            // replaced or removed takes its own listing with it.
            self.ahead.spoil(parent(&ch.path));
            self.contents.spoil(&ch.path);
            self.listed.forget(parent(&ch.path));
            self.known.forget(parent(&ch.path));
            if ch.kind & CHANGE_NAME != 0 {
                // Renamed, replaced or removed: so is everything below it.
                self.ahead.spoil_tree(&ch.path);
                self.contents.spoil_tree(&ch.path);
                self.listed.forget_tree(&ch.path);
                self.known.forget_tree(&ch.path);
            }
            // The table keeps the name: the kernel may still use its entry until told, and
            // asks again (a lookup, which corrects the table) after.
            let ino = self.inodes.locked().ino_of(&ch.path);
            if let Some(ino) = ino {
                self.forget_inode(n, ino, ch.kind & CHANGE_DATA != 0);
            }
            if ch.kind & CHANGE_NAME != 0 {
                self.forget_name(n, &ch.path);
            }
        }
    }

    /// The kernel forgets `ino`'s attributes (and with `pages` its cached content); the
    /// mount's own answers about it are asked again.
    fn forget_inode(&self, n: &fuser::Notifier, ino: u64, pages: bool) {
        self.no_xattrs.drop_entry(ino);
        self.fresh.forget(ino);
        // ENOENT: the kernel holds no such inode, nothing to forget.
        let _ = n.inval_inode(INodeNo(ino), if pages { 0 } else { -1 }, 0);
    }

    /// The kernel forgets the name `path` (its parent's entry for it).
    fn forget_name(&self, n: &fuser::Notifier, path: &str) {
        if path.is_empty() {
            return;
        }
        let (parent, name) = split(path);
        let pino = self.inodes.locked().ino_of(parent);
        if let Some(p) = pino {
            let _ = n.inval_entry(INodeNo(p), OsStr::new(name));
        }
    }
}
