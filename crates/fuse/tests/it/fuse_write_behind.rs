//! Write-behind in the general mount (`crates/fuse/src/behind.rs`): small sequential writes
//! reach the brick as one, the mount sees them at once, another client after the close, and a
//! held write that fails is reported by `close(2)`.

use crate::common;

use std::io::Write;
use std::os::fd::IntoRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::Mounted;
use kiln_fuse::Mode;
use kiln_proto::Op;
use kiln_server::Listen;

/// Content of `len` bytes.
fn content(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

#[test]
fn small_writes_go_as_one_and_are_seen_at_once_and_after_close() {
    let m = Mounted::new(Mode::General);
    let b = m.second(Duration::from_secs(60));
    let data = content(100_000);
    // Any thread of this process that forks duplicates `f`, and the child's exec closes the
    // copy: the kernel then sends a FLUSH, which rightly sends what is held. A window with a
    // FLUSH in it proves nothing, so it is tried again on a new file (at most three times).
    let (mut f, writes, name) = (0..3)
        .find_map(|attempt| {
            let name = format!("f{attempt}");
            let flushes = m.counters.flushes.load(Ordering::Relaxed);
            let mut f = std::fs::File::create(m.path(&name)).unwrap();
            let writes = m.stats.calls(Op::Write);
            for chunk in data.chunks(1000) {
                f.write_all(chunk).unwrap();
            }
            // The brick's count first: a FLUSH counts itself before it sends anything, so a
            // send seen here shows in the FLUSH count read after it.
            let sent = m.stats.calls(Op::Write) - writes;
            if m.counters.flushes.load(Ordering::Relaxed) != flushes {
                return None;
            }
            assert_eq!(sent, 0, "100 writes of 1000 bytes are held, none sent yet");
            Some((f, writes, name))
        })
        .expect("three windows without a FLUSH from another thread's fork");
    let name = name.as_str();
    // This mount sees them at once: stat and a read through another handle.
    assert_eq!(std::fs::metadata(m.path(name)).unwrap().len(), 100_000);
    assert_eq!(m.stats.calls(Op::Write), writes + 1, "sent as one write");
    assert_eq!(std::fs::read(m.brick().join(name)).unwrap(), data);
    f.write_all(&data).unwrap();
    assert_eq!(std::fs::read(m.path(name)).unwrap().len(), 200_000);

    // Held again, then the close sends it: another client's next open sees all of it.
    f.write_all(b"tail").unwrap();
    drop(f);
    let mut want = data.clone();
    want.extend_from_slice(&data);
    want.extend_from_slice(b"tail");
    assert_eq!(std::fs::read(b.path(name)).unwrap(), want);

    // A write elsewhere in the file goes after what was held, in order.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.path(name))
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(b"AAAA", 10).unwrap();
    f.write_all_at(b"BBBB", 12).unwrap();
    drop(f);
    want[10..14].copy_from_slice(b"AABB");
    want[14..16].copy_from_slice(b"BB");
    assert_eq!(std::fs::read(m.brick().join(name)).unwrap(), want);
}

/// A tmpfs of `bytes` on `dir`, unmounted when dropped.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn new(dir: &std::path::Path, bytes: u64) -> SmallFs {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount a tmpfs (the FUSE tests run as root)");
        SmallFs(dir.to_owned())
    }
}

impl Drop for SmallFs {
    /// Lazily: the brick server may still hold a file there as it shuts down, and a plain
    /// umount would then fail and leave the tmpfs mounted for good.
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_held_write_that_fails_is_reported_by_close() {
    let dir = tempfile::tempdir().unwrap();
    let (brick, mnt) = (dir.path().join("brick"), dir.path().join("mnt"));
    std::fs::create_dir(&brick).unwrap();
    std::fs::create_dir(&mnt).unwrap();
    let _small = SmallFs::new(&brick, 1 << 20);
    let sock = dir.path().join("kilnd.sock");
    let _server = kiln_server::spawn_background(&brick, &[Listen::Unix(sock.clone())]).unwrap();
    let vol = kiln_client::Volume::connect(&format!("unix:{}", sock.display())).unwrap();
    let fs = kiln_fuse::KilnFs::new(Arc::new(vol), Mode::General, Duration::from_secs(1)).unwrap();
    let session = kiln_fuse::serve_background(fs, "small:/vol", &mnt, 4).unwrap();

    // Fill the brick.
    let mut fill = std::fs::File::create(mnt.join("fill")).unwrap();
    let block = content(4096);
    let mut full = None;
    for _ in 0..1024 {
        if let Err(e) = fill.write_all(&block) {
            full = Some(e);
            break;
        }
    }
    let e = full.expect("a 1 MiB brick fills up");
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    drop(fill);

    // A small write is held and answered; the close finds the brick full and says so.
    let mut last = std::fs::File::create(mnt.join("last")).unwrap();
    last.write_all(&block).unwrap();
    let fd = last.into_raw_fd();
    // SAFETY: `fd` is the descriptor just taken out of `last`, closed exactly once here.
    let r = unsafe { libc::close(fd) };
    let err = std::io::Error::last_os_error();
    assert_eq!(r, -1, "close reports the held write's failure");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(session);
}
