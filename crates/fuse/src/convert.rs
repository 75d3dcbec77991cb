//! Conversions between the stack's values and FUSE's: errors, times, file types.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{Errno, FileType, TimeOrNow};
use kiln_client::Time;

/// A stack error as the errno FUSE replies with (EIO when it carries none).
pub(crate) fn errno(e: std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

pub(crate) fn systime(t: &Time) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs()) + Duration::from_nanos(t.nsec as u64)
    }
}

pub(crate) fn wire_time(t: TimeOrNow) -> (Time, bool) {
    match t {
        TimeOrNow::Now => (Time::default(), true),
        TimeOrNow::SpecificTime(st) => {
            let (sec, nsec) = match st.duration_since(UNIX_EPOCH) {
                Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
                Err(e) => {
                    let d = e.duration();
                    let (s, n) = (d.as_secs() as i64, d.subsec_nanos());
                    if n == 0 {
                        (-s, 0)
                    } else {
                        (-s - 1, 1_000_000_000 - n)
                    }
                }
            };
            (Time { sec, nsec }, false)
        }
    }
}

pub(crate) fn kind(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}
