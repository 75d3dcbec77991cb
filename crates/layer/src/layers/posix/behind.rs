//! Flush-behind: a file open for writing through the brick has its dirty pages written back
//! once a window of bytes was written through that open file, so the page cache holds about
//! three windows of it unwritten at most — two ahead of a write-back and the one being written
//! back — per writer (the idea of RocksDB's `bytes_per_sync` and PostgreSQL's
//! `backend_flush_after`).
//!
//! Why a brick wants it: what waits for a file's dirty pages waits for all of them. A reflink
//! (a snapshot, `FICLONE`) writes the whole file back first; so does a guest's flush (an
//! `fsync`). Under a steady stream of writes the kernel lets gigabytes pile up before its own
//! writeback starts (`dirty_background_ratio`), and the one who asks next waits seconds. With
//! flush-behind that wait is bounded by the window instead.
//!
//! How: each window's worth of writes starts one write-back of the file
//! (`sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`) on the blocking pool, one at a time
//! per open file. A writer that gets two windows ahead of a write-back still running waits
//! for that one to end — the only time a write waits, and only when the disk is slower than
//! the writers. On file systems without write-back (tmpfs) the call returns at once.
//!
//! The write-back goes through a second open file description of the same file (opened the
//! first time it is needed): waiting for write-back consumes the file's write error for the
//! description that waits, and the client's descriptor must still report it at its next
//! `fsync`.

use std::fs::File;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kiln_proto::sync::MutexExt as _;

/// The default window: none (off). Flush-behind costs the replicated write path about 15% on
/// a disk file system (`bench/versions.py`: 4 KiB QD1 p50 0.85x, 128 KiB QD32 0.86x), so it is
/// an operator's choice (`kiln volume set VOL flush-behind 8M`) for images snapshotted or
/// flushed under steady writes.
pub const DEFAULT_WINDOW: u64 = 0;

/// Flush-behind state of one open file.
pub(super) struct Behind {
    file: Arc<File>,
    /// The description write-backs go through (see the module's notes); `None` when it
    /// could not be opened (write-back is then the kernel's alone).
    own: OnceLock<Option<File>>,
    window: u64,
    /// Bytes written since the last write-back started.
    written: AtomicU64,
    /// Whether a write-back runs.
    running: Mutex<bool>,
    /// Write-backs ended so far: a waiter waits for the one that ran when it came.
    ended: AtomicU64,
    done: tokio::sync::Notify,
}

impl Behind {
    /// Flush-behind for `file` every `window` bytes.
    pub(super) fn new(file: Arc<File>, window: u64) -> Arc<Behind> {
        Arc::new(Behind {
            file,
            own: OnceLock::new(),
            window,
            written: AtomicU64::new(0),
            running: Mutex::new(false),
            ended: AtomicU64::new(0),
            done: tokio::sync::Notify::new(),
        })
    }

    /// Counts `n` bytes written; starts a write-back when a window is full and none runs.
    /// Returns what the writer must wait for when it is two windows ahead of the one running.
    pub(super) fn wrote(self: &Arc<Self>, n: u64) -> Option<impl Future<Output = ()> + Send> {
        let total = self.written.fetch_add(n, Ordering::Relaxed) + n;
        if total < self.window {
            return None;
        }
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let mut running = self.running.locked();
        if !*running {
            *running = true;
            self.written.store(0, Ordering::Relaxed);
            let me = self.clone();
            rt.spawn_blocking(move || me.write_back());
            return None;
        }
        if total < 2 * self.window {
            return None;
        }
        // Read under the lock: the write-back running now ends with `ended` past this.
        let running_one = self.ended.load(Ordering::Acquire);
        drop(running);
        let me = self.clone();
        Some(async move {
            loop {
                let notified = me.done.notified();
                if me.ended.load(Ordering::Acquire) != running_one {
                    return;
                }
                notified.await;
            }
        })
    }

    /// Writes the file's dirty pages back and waits for them (on the blocking pool).
    fn write_back(&self) {
        use std::os::fd::AsRawFd;
        let own = self.own.get_or_init(|| {
            // Only a regular file has pages to write back (a FIFO or a device node written
            // through the brick is not opened again).
            if !self.file.metadata().is_ok_and(|m| m.is_file()) {
                return None;
            }
            // The same file, another description: /proc names the open file itself, so a
            // rename or unlink meanwhile does not matter. Read-only is enough to write back.
            use std::os::unix::fs::OpenOptionsExt;
            let path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
                .open(&path)
                .map_err(|e| tracing::warn!("flush-behind off for a file: cannot reopen it: {e}"))
                .ok()
        });
        if let Some(own) = own {
            let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            // SAFETY: a plain system call on a descriptor this struct keeps open; offset 0
            // and length 0 name the whole file.
            let r = unsafe { libc::sync_file_range(own.as_raw_fd(), 0, 0, flags) };
            if r != 0 {
                // The client's own descriptor still reports the error at its next fsync.
                tracing::warn!(
                    "flush-behind: writing a file back failed: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        let mut running = self.running.locked();
        *running = false;
        self.ended.fetch_add(1, Ordering::Release);
        drop(running);
        self.done.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::layers::posix::{brick::Brick, Posix};
    use crate::{Ctx, IoBufs, Layer};

    /// The file's pages dirty or under write-back now, in bytes (`cachestat(2)`, Linux 6.5).
    fn unwritten(f: &std::fs::File) -> u64 {
        use std::os::fd::AsRawFd;
        #[repr(C)]
        struct Range {
            off: u64,
            len: u64,
        }
        #[repr(C)]
        #[derive(Default)]
        struct Stat {
            cache: u64,
            dirty: u64,
            writeback: u64,
            evicted: u64,
            recently_evicted: u64,
        }
        const SYS_CACHESTAT: libc::c_long = 451;
        let range = Range { off: 0, len: 0 };
        let mut st = Stat::default();
        // SAFETY: cachestat reads one range and writes one stat struct, both live and of the
        // kernel's layout (include/uapi/linux/mman.h); the descriptor is open.
        let r = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                f.as_raw_fd(),
                &range,
                &mut st as *mut Stat,
                0,
            )
        };
        assert_eq!(r, 0, "cachestat: {}", std::io::Error::last_os_error());
        (st.dirty + st.writeback) * 4096
    }

    /// Whether this kernel has `cachestat(2)` (Linux 6.5 and later).
    fn have_cachestat() -> bool {
        // SAFETY: an invalid descriptor and null pointers: the call fails at once, with
        // ENOSYS when the kernel does not know it.
        let r = unsafe {
            libc::syscall(
                451,
                -1,
                std::ptr::null::<u8>(),
                std::ptr::null_mut::<u8>(),
                0,
            )
        };
        !(r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS))
    }

    /// Writes 64 MiB through a posix layer with flush-behind `window` on a disk file system
    /// (not tmpfs: it has no write-back); returns the bytes of the file not yet written back
    /// when the last write was answered.
    fn unwritten_after_writes(window: u64) -> u64 {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let brick = Arc::new(Brick::open(dir.path()).unwrap());
            let posix = Posix::new("posix", brick).flush_behind(window);
            let cx = Ctx::NONE;
            let flags = (libc::O_RDWR | libc::O_CREAT) as u32;
            let (fd, _) = posix.create(&cx, "img", flags, 0o644).await.unwrap();
            for i in 0..256u64 {
                let data = IoBufs::owned(vec![vec![i as u8; 256 << 10]]);
                posix.write(&cx, &fd, i * (256 << 10), data).await.unwrap();
            }
            let f = std::fs::File::open(dir.path().join("img")).unwrap();
            unwritten(&f)
        })
    }

    #[test]
    fn flush_behind_bounds_what_a_file_has_unwritten() {
        let fs = rustix::fs::statfs(std::env::temp_dir()).unwrap();
        if fs.f_type as i64 == libc::TMPFS_MAGIC {
            eprintln!("skipped: the temporary directory is a tmpfs, which has no write-back");
            return;
        }
        if !have_cachestat() {
            eprintln!("skipped: this kernel has no cachestat(2) (Linux 6.5)");
            return;
        }
        let with = unwritten_after_writes(1 << 20);
        let without = unwritten_after_writes(0);
        eprintln!("unwritten after 64 MiB: {with} bytes with a 1 MiB window, {without} without");
        // At most two windows ahead of the write-back that runs, and that one (a window and a
        // write) in flight: about three windows and a write.
        assert!(
            with <= 4 << 20,
            "{with} bytes unwritten with a 1 MiB window"
        );
        assert!(
            without >= 32 << 20,
            "without flush-behind only {without} of 64 MiB were unwritten: something else \
             wrote the file back, and this test shows nothing"
        );
    }
}
