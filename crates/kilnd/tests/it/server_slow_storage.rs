//! A storage call that hangs holds up only the connection that made it: other clients' requests,
//! and new clients, are served meanwhile. Part of the brick lies on a FUSE file system this test
//! serves, whose opens do not answer until the test lets them (a disk that stopped responding);
//! the brick is a real kilnd process.

use crate::common;

use std::ffi::OsStr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    Config, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, MountOption,
    OpenFlags, ReplyAttr, ReplyEntry, ReplyOpen, Request,
};
use kiln_client::{block_on, Client};

/// Opens taken and not answered yet; `None` once the disk answers again.
#[derive(Default)]
struct Stuck {
    held: Mutex<Option<Vec<ReplyOpen>>>,
    changed: Condvar,
}

impl Stuck {
    /// Waits until `n` opens are held, or `limit` passes; how many are.
    fn wait_held(&self, n: usize, limit: Duration) -> usize {
        let end = Instant::now() + limit;
        let mut g = self.held.lock().unwrap();
        loop {
            let now = g.as_ref().map_or(0, Vec::len);
            let left = end.saturating_duration_since(Instant::now());
            if now >= n || left.is_zero() {
                return now;
            }
            g = self.changed.wait_timeout(g, left).unwrap().0;
        }
    }

    /// Answers every held open, and every later one at once.
    fn release(&self) {
        let held = self.held.lock().unwrap().take().unwrap_or_default();
        for r in held {
            r.opened(FileHandle(0), FopenFlags::empty());
        }
    }
}

/// Lets the disk answer when dropped.
struct Answer(Arc<Stuck>);

impl Drop for Answer {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Detaches the mount when dropped, even while the brick still uses it (a failed test).
struct Detach(std::path::PathBuf);

impl Drop for Detach {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A directory with one empty file, `f`, whose opens hang while the disk is stuck.
struct SlowDisk(Arc<Stuck>);

const FILE: INodeNo = INodeNo(2);

fn attr(ino: INodeNo) -> FileAttr {
    let (kind, perm) = if ino == INodeNo::ROOT {
        (FileType::Directory, 0o755)
    } else {
        (FileType::RegularFile, 0o644)
    };
    FileAttr {
        ino,
        size: 0,
        blocks: 0,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind,
        perm,
        nlink: 1,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl fuser::Filesystem for SlowDisk {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == INodeNo::ROOT && name == "f" {
            reply.entry(&Duration::ZERO, &attr(FILE), Generation(0));
        } else {
            reply.error(fuser::Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        reply.attr(&Duration::ZERO, &attr(ino));
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut g = self.0.held.lock().unwrap();
        match g.as_mut() {
            Some(held) => {
                held.push(reply);
                self.0.changed.notify_all();
            }
            None => reply.opened(FileHandle(0), FopenFlags::empty()),
        }
    }
}

/// Runs `f` on a thread; its result if it comes within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

#[test]
fn a_hung_storage_call_stalls_only_the_connection_that_made_it() {
    let kd = common::Kilnd::start();
    let addr = kd.unix.clone();
    std::fs::write(kd.brick.join("fast"), b"served meanwhile").expect("fast file");
    let slow = kd.brick.join("slow");
    std::fs::create_dir(&slow).expect("slow dir");
    let stuck = Arc::new(Stuck {
        held: Mutex::new(Some(Vec::new())),
        changed: Condvar::new(),
    });
    let mut cfg = Config::default();
    cfg.mount_options = vec![MountOption::FSName("kiln-slow-disk".into())];
    cfg.acl = fuser::SessionACL::All;
    let session = fuser::spawn_mount(SlowDisk(stuck.clone()), &slow, &cfg).expect("FUSE mount");
    let _detach = Detach(slow.clone());
    // Dropped first, also when an assertion fails: the disk answers before it is unmounted.
    let _answer = Answer(stuck.clone());

    // More clients hang in an open than the brick has runtime threads (2).
    const HUNG: usize = 4;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for _ in 0..HUNG {
        let (addr, tx) = (addr.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let c = Client::connect(&addr).expect("connect");
            let r = block_on(c.open("/slow/f", libc::O_RDONLY)).map(|fh| block_on(c.close(fh)));
            let _ = tx.send(r.map(|_| ()).map_err(|e| e.to_string()));
        });
    }
    let held = stuck.wait_held(HUNG, Duration::from_secs(20));
    assert_eq!(held, HUNG, "every client's open reached the stuck disk");

    // Meanwhile a new client connects, lists, reads and writes; an answer within 2 s each.
    let t = Instant::now();
    let served = within(Duration::from_secs(10), move || {
        let c = Client::connect(&addr).expect("connect");
        let names: Vec<String> = block_on(c.readdir("/"))
            .expect("readdir")
            .into_iter()
            .map(|e| e.name)
            .collect();
        let fh = block_on(c.open("/fast", libc::O_RDWR)).expect("open fast");
        let (n, bufs) = block_on(c.preadv(fh, vec![vec![0u8; 64]], 0));
        let got = bufs[0][..n.expect("read")].to_vec();
        block_on(c.pwritev(fh, vec![b"!".to_vec()], 0))
            .0
            .expect("write");
        block_on(c.close(fh)).expect("close");
        (names, got)
    });
    let took = t.elapsed();
    let (mut names, got) = served.expect("another client is served while storage calls hang");
    names.sort();
    assert!(
        names.contains(&"fast".to_owned()) && names.contains(&"slow".to_owned()),
        "{names:?}"
    );
    assert_eq!(got, b"served meanwhile");
    assert!(
        took < Duration::from_secs(2),
        "the other client waited {took:?}"
    );
    assert!(
        done_rx.try_recv().is_err(),
        "the hung opens are still waiting on the disk"
    );

    // The disk answers: every hung open completes, none lost.
    stuck.release();
    for _ in 0..HUNG {
        let r = done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("hung open finished");
        assert_eq!(r, Ok(()));
    }
    drop(session);
}
