//! `kiln_discard` and `kiln_fallocate` through libkiln: a discarded range's space comes back
//! on the brick and reads as zeros, the size stays; a zeroed range reads as zeros; bad
//! arguments are refused. On a real brick server over its Unix socket.

use std::os::unix::fs::MetadataExt;
use std::ptr::null_mut;

use kiln::{kiln_close, kiln_discard, kiln_fallocate, kiln_fini, kiln_open, KilnFd};
use kiln_server::Listen;

use crate::common;

const MIB: usize = 1 << 20;

#[test]
fn discard_gives_space_back_and_zero_range_zeroes() {
    let dir = tempfile::tempdir().unwrap();
    let brick = dir.path().join("brick");
    std::fs::create_dir(&brick).unwrap();
    let sock = dir.path().join("kilnd.sock");
    let _server = kiln_server::spawn_background(&brick, &[Listen::Unix(sock.clone())]).unwrap();
    let file = brick.join("img");
    std::fs::write(&file, vec![0xa5u8; 8 * MIB]).unwrap();
    let used = || std::fs::metadata(&file).unwrap().blocks() as usize * 512;
    assert!(used() >= 8 * MIB);

    let k = common::connect(&sock);
    let mut fd: *mut KilnFd = null_mut();
    // SAFETY: a NUL-terminated path; `k` is live and `fd` is written by kiln_open and live
    // until closed below.
    unsafe {
        assert_eq!(kiln_open(k, c"/img".as_ptr(), libc::O_RDWR, &mut fd), 0);

        assert_eq!(kiln_discard(fd, 0, 4 * MIB as i64), 0);
        assert!(used() <= 4 * MIB + 64 * 1024, "{} B still used", used());
        let zero_range = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        assert_eq!(
            kiln_fallocate(fd, zero_range, 6 * MIB as i64, MIB as i64),
            0
        );
        // As the bricks' kernel answers a mode it does not know.
        assert_eq!(
            kiln_fallocate(fd, 1 << 20, 0, 1),
            -libc::EOPNOTSUPP,
            "unknown mode bits"
        );
        assert_eq!(kiln_discard(fd, -1, 1), -libc::EINVAL);
        assert_eq!(kiln_discard(null_mut(), 0, 1), -libc::EINVAL);
        assert_eq!(kiln_close(fd), 0);
        kiln_fini(k);
    }
    let data = std::fs::read(&file).unwrap();
    assert_eq!(data.len(), 8 * MIB, "the size stays");
    assert!(
        data[..4 * MIB].iter().all(|b| *b == 0),
        "discarded range reads as zeros"
    );
    assert!(data[4 * MIB..6 * MIB].iter().all(|b| *b == 0xa5));
    assert!(
        data[6 * MIB..7 * MIB].iter().all(|b| *b == 0),
        "zeroed range"
    );
    assert!(data[7 * MIB..].iter().all(|b| *b == 0xa5));
}
