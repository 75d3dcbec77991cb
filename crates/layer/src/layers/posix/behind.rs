//! Flush-behind: a file written through the brick has its dirty pages written back once a
//! window of bytes was written to it, so the page cache never holds more than a couple of
//! windows of it unwritten (the idea of RocksDB's `bytes_per_sync` and PostgreSQL's
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
//! for it — the only time a write waits, and only when the disk is slower than the writers.
//! On file systems without write-back (tmpfs) the call returns at once.

use std::fs::File;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The default window: 8 MiB.
pub const DEFAULT_WINDOW: u64 = 8 << 20;

/// Flush-behind state of one open file.
pub(super) struct Behind {
    file: Arc<File>,
    window: u64,
    /// Bytes written since the last write-back started.
    written: AtomicU64,
    /// Whether a write-back runs.
    running: Mutex<bool>,
    done: tokio::sync::Notify,
}

impl Behind {
    /// Flush-behind for `file` every `window` bytes.
    pub(super) fn new(file: Arc<File>, window: u64) -> Arc<Behind> {
        Arc::new(Behind {
            file,
            window,
            written: AtomicU64::new(0),
            running: Mutex::new(false),
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
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
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
        drop(running);
        let me = self.clone();
        Some(async move {
            loop {
                let notified = me.done.notified();
                if !*me.running.lock().unwrap_or_else(|e| e.into_inner()) {
                    return;
                }
                notified.await;
            }
        })
    }

    /// Writes the file's dirty pages back and waits for them (on the blocking pool).
    fn write_back(&self) {
        use std::os::fd::AsRawFd;
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: a plain system call on a descriptor this struct keeps open; offset 0 and
        // length 0 name the whole file.
        let r = unsafe { libc::sync_file_range(self.file.as_raw_fd(), 0, 0, flags) };
        if r != 0 {
            // Nothing is lost: the kernel writes the pages back later, and an fsync reports
            // a write error to whoever asks.
            tracing::debug!(
                "flush-behind: sync_file_range: {}",
                std::io::Error::last_os_error()
            );
        }
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) = false;
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
        let with = unwritten_after_writes(1 << 20);
        let without = unwritten_after_writes(0);
        eprintln!("unwritten after 64 MiB: {with} bytes with a 1 MiB window, {without} without");
        // At most two windows past the write-back that runs, and that one (a window and a
        // write) in flight.
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
