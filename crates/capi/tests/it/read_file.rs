//! `kiln_read_file` reads a small file in one round trip: the brick sees one OPEN and no READ
//! or RELEASE. A file bigger than the caller's buffer is read through a handle, which is
//! closed again. Counted on a real brick server over its Unix socket.

use std::ffi::CString;

use crate::common;

use kiln::{kiln_fini, kiln_read_file, Kiln};
use kiln_proto::Op;
use kiln_server::{Listen, Stats};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

fn counts(s: &Stats) -> [u64; 3] {
    [Op::Open, Op::Read, Op::Release].map(|op| s.calls(op))
}

fn read_file(k: *mut Kiln, path: &str, buf: &mut [u8]) -> i64 {
    let p = CString::new(path).unwrap();
    // SAFETY: `k` is live and initialised; `p` is NUL-terminated; `buf` is writable.
    unsafe { kiln_read_file(k, p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }
}

#[test]
fn a_small_file_is_one_open_on_the_brick() {
    let dir = tempfile::tempdir().unwrap();
    let brick = dir.path().join("brick");
    std::fs::create_dir(&brick).unwrap();
    let sock = dir.path().join("kilnd.sock");
    let server = kiln_server::spawn_background(&brick, &[Listen::Unix(sock.clone())]).unwrap();
    let small = pattern(20_000, 1);
    let big = pattern(300_000, 2);
    std::fs::write(brick.join("small"), &small).unwrap();
    std::fs::write(brick.join("big"), &big).unwrap();

    let k = common::connect(&sock);

    let mut buf = vec![0u8; 64 << 10];
    let [open0, read0, rel0] = counts(&server.stats);
    assert_eq!(read_file(k, "/small", &mut buf), small.len() as i64);
    assert_eq!(&buf[..small.len()], &small[..]);
    assert_eq!(
        counts(&server.stats),
        [open0 + 1, read0, rel0],
        "one OPEN, nothing read or released after it"
    );

    assert_eq!(read_file(k, "/big", &mut buf), big.len() as i64, "the size");
    assert_eq!(buf, big[..buf.len()], "the head that fits");
    let [open1, read1, rel1] = counts(&server.stats);
    assert_eq!(open1, open0 + 2);
    assert!(read1 > read0, "read through a handle");
    assert_eq!(rel1, rel0 + 1, "and the handle closed");

    // SAFETY: `k` is live and not used again.
    assert_eq!(unsafe { kiln_fini(k) }, 0);
}

/// libkiln speaks for the identity its key file names (`KILN_SECRET_FILE`, `NAME SECRET`), and
/// the brick holds it to that identity's subtree and user.
#[test]
fn libkiln_reaches_only_its_identitys_subtree() {
    use kiln_server::identity::{Caps, Identities, Identity, Users};
    let dir = tempfile::tempdir().unwrap();
    let brick = dir.path().join("brick");
    for d in ["t1", "t2"] {
        std::fs::create_dir_all(brick.join(d)).unwrap();
    }
    std::os::unix::fs::chown(brick.join("t1"), Some(1001), Some(1001)).unwrap();
    std::fs::write(brick.join("t1/mine"), b"t1's").unwrap();
    std::fs::write(brick.join("t2/theirs"), b"t2's").unwrap();
    let sock = dir.path().join("kilnd.sock");
    let ids = std::sync::Arc::new(Identities::new());
    ids.set(
        "vol",
        vec![Identity {
            name: "t1".into(),
            key: "feedfacefeedface".into(),
            caps: Caps {
                volumes: vec!["vol".into()],
                subtree: "t1".into(),
                users: Users::As {
                    uid: 1001,
                    gid: 1001,
                },
                ..Caps::default()
            },
        }],
    );
    let ids2 = ids.clone();
    kiln_server::spawn_background_with(&brick, &[Listen::Unix(sock.clone())], move |s| {
        s.with_identities(ids2)
    })
    .unwrap();
    let key = dir.path().join("t1.key");
    std::fs::write(&key, "t1 feedfacefeedface\n").unwrap();
    // Set only while connecting (edition 2021: a safe fn): the other test of this binary may
    // read it meanwhile, harmlessly (its brick asks for no key), but never after this test
    // removed the file.
    std::env::set_var("KILN_SECRET_FILE", &key);
    let k = common::connect(&sock);
    std::env::remove_var("KILN_SECRET_FILE");
    let mut buf = vec![0u8; 64];
    assert_eq!(read_file(k, "/t1/mine", &mut buf), 4);
    assert_eq!(&buf[..4], b"t1's");
    assert_eq!(read_file(k, "/t2/theirs", &mut buf), -(libc::EACCES as i64));
    assert!(read_file(k, "/../t2/theirs", &mut buf) < 0);
    // SAFETY: `k` is live and not used again.
    unsafe { kiln_fini(k) };
}
