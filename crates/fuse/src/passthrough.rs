//! FUSE passthrough: reads of a file opened read-only go from the kernel straight to the
//! brick's file, never through this process.
//!
//! Only in `vm-image` mode (the kernel gives no passthrough with writeback caching), only as
//! root (registering a backing file needs `CAP_SYS_ADMIN`), and only for files the stack says
//! a reader may bypass it for ([`kiln_layer::Layer::pin_local`]): whole on one brick of this
//! host, without replicas, pinned there by the brick while the backing file is registered.
//!
//! The kernel wants one backing file per inode, and every open of an inode that has one to be
//! a passthrough open too. So the first read-only open of an inode opens a handle of its own
//! that pins the file and registers the descriptor the brick hands out; later opens of that
//! inode, while any of these is open, reuse it — writers with `FOPEN_DIRECT_IO` as well, which
//! sends their reads and writes here as before (the kernel lets direct I/O override
//! passthrough). When the last open of the inode is released, the backing file and the pin go.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use fuser::{BackingId, FileHandle, FopenFlags, ReplyOpen};
use kiln_client::{Fd, Volume};
use kiln_proto::sync::MutexExt as _;

use crate::gate::block_on;

/// One inode's backing file, while it is open.
struct Backed {
    id: BackingId,
    /// The handle that pins the brick's file, closed with the last open.
    pin: Fd,
    opens: usize,
}

/// The mount's backing files.
pub struct Passthrough {
    on: AtomicBool,
    by_ino: Mutex<HashMap<u64, Backed>>,
}

impl Passthrough {
    /// Passthrough wanted (`on`) or not; the kernel may still say no at `init`.
    pub fn new(on: bool) -> Passthrough {
        Passthrough {
            on: AtomicBool::new(on),
            by_ino: Mutex::new(HashMap::new()),
        }
    }

    /// Whether it is on.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Turns it off for good (the kernel refused it).
    pub fn off(&self, why: &str) {
        if self.on.swap(false, Ordering::Relaxed) {
            tracing::info!("FUSE passthrough off: {why}");
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Backed>> {
        self.by_ino.locked()
    }

    /// Answers an open of inode `ino` at `path` with `flags` (the stack's handle `fd`) as FUSE
    /// handle `fh`: backed by the brick's file when the inode has one or this is a read-only
    /// open that can get one, else with `plain` flags. A backed answer calls `backed` first
    /// ([`Passthrough::released`] must then follow its release). The answer is sent under the
    /// lock, so that no plain open of an inode can reach the kernel after a backed one.
    pub fn open(
        &self,
        vol: &Volume,
        at: (u64, &str, i32, &Fd),
        fh: FileHandle,
        plain: FopenFlags,
        reply: ReplyOpen,
        backed: impl FnOnce(),
    ) {
        let (ino, path, flags, fd) = at;
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let mut map = self.map();
        // Checked under the lock and before `is_on`: an inode that has a backing file is
        // opened backed even after passthrough went off.
        if !map.contains_key(&ino) && !writes && self.is_on() {
            if let Some(b) = self.back(vol, path, fd, &reply) {
                map.insert(ino, b);
            }
        }
        match map.get_mut(&ino) {
            Some(b) => {
                b.opens += 1;
                backed();
                // A writer of a backed inode must open backed too; direct I/O keeps its reads
                // and writes coming here (replication needs them).
                let extra = match writes {
                    true => FopenFlags::FOPEN_DIRECT_IO,
                    false => FopenFlags::empty(),
                };
                reply.opened_passthrough(fh, extra, &b.id);
            }
            None => reply.opened(fh, plain),
        }
    }

    /// Pins `path`'s file on its brick (the one `fd` has open) and registers it with the
    /// kernel.
    fn back(&self, vol: &Volume, path: &str, fd: &Fd, reply: &ReplyOpen) -> Option<Backed> {
        let pin = block_on(vol.open(path, libc::O_RDONLY)).ok()?;
        // The name may lead to another file than the one `fd` opened, by now.
        let same = match (block_on(vol.fstat(fd)), block_on(vol.fstat(&pin))) {
            (Ok(a), Ok(b)) => a.ino == b.ino,
            _ => false,
        };
        let pinned = match same {
            true => block_on(vol.pin_local(&pin)).map_err(|e| e.to_string()),
            false => Err("the name leads to another file now".to_owned()),
        };
        let registered = pinned.and_then(|file| {
            reply.open_backing(&file).map_err(|e| {
                if e.raw_os_error() == Some(libc::EPERM) {
                    self.off("registering a backing file needs CAP_SYS_ADMIN");
                }
                e.to_string()
            })
        });
        match registered {
            Ok(id) => Some(Backed { id, pin, opens: 0 }),
            Err(why) => {
                tracing::debug!(path, "no passthrough: {why}");
                let _ = block_on(vol.close(pin));
                None
            }
        }
    }

    /// An open of `ino` that went out backed was released; the last one closes the backing
    /// file and the pin.
    pub fn released(&self, vol: &Volume, ino: u64) {
        let gone = {
            let mut map = self.map();
            match map.get_mut(&ino) {
                Some(b) if b.opens > 1 => {
                    b.opens -= 1;
                    None
                }
                Some(_) => map.remove(&ino),
                None => None,
            }
        };
        if let Some(Backed { id, pin, .. }) = gone {
            drop(id);
            let _ = block_on(vol.close(pin));
        }
    }
}
