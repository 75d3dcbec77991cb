//! What the mount answers about extended attributes without asking its brick
//! (`crates/fuse/src/xattr.rs`): none under `security.*`, and none for an entry a listing said
//! has none, until the entry's attribute timeout; its own changes are seen at once.

mod common;

use std::ffi::CString;
use std::path::Path;
use std::time::Duration;

use common::Mounted;
use kiln_fuse::Mode;
use kiln_proto::Op;

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("path")
}

fn set(p: &Path, name: &str, v: &[u8]) {
    let name = CString::new(name).unwrap();
    // SAFETY: valid C strings and value buffer.
    let r = unsafe { libc::setxattr(c(p).as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(r, 0, "setxattr {p:?}: {}", std::io::Error::last_os_error());
}

/// The value, or the errno.
fn get(p: &Path, name: &str) -> Result<Vec<u8>, i32> {
    let name = CString::new(name).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: valid C strings and buffer.
    let n = unsafe { libc::getxattr(c(p).as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 64) };
    match n {
        n if n >= 0 => Ok(buf[..n as usize].to_vec()),
        _ => Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)),
    }
}

fn list(p: &Path) -> Vec<u8> {
    let mut buf = [0u8; 256];
    // SAFETY: valid C string and buffer.
    let n = unsafe { libc::listxattr(c(p).as_ptr(), buf.as_mut_ptr().cast(), 256) };
    assert!(n >= 0, "listxattr: {}", std::io::Error::last_os_error());
    buf[..n as usize].to_vec()
}

#[test]
fn xattrs_known_from_a_listing() {
    // A timeout no step of this test comes near, so that what it asserts cannot time out.
    let m = Mounted::with_options(Mode::General, true, Duration::from_secs(60));
    std::fs::write(m.path("plain"), b"x").unwrap();
    std::fs::write(m.path("tagged"), b"y").unwrap();
    // Another writer, straight on the brick.
    set(&m.brick().join("tagged"), "user.t", b"1");
    set(&m.brick().join("tagged"), "security.kiln-test", b"label");

    // A listing with attributes (the first readdir of a directory is a readdirplus).
    let n = std::fs::read_dir(m.mnt()).unwrap().count();
    assert_eq!(n, 2);
    // Given one behind the mount's back after the listing.
    set(&m.brick().join("plain"), "user.late", b"2");

    let asked = m.stats.calls(Op::Getxattr) + m.stats.calls(Op::Listxattr);
    assert_eq!(get(&m.path("tagged"), "user.t"), Ok(b"1".to_vec()));
    // The brick host's security labels are not the client's.
    assert_eq!(
        get(&m.path("tagged"), "security.kiln-test"),
        Err(libc::ENODATA)
    );
    assert_eq!(list(&m.path("tagged")), b"user.t\0");
    assert_eq!(
        m.stats.calls(Op::Getxattr) + m.stats.calls(Op::Listxattr),
        asked + 2,
        "asked the brick for tagged's user.t and list, not for security.*"
    );
    assert_eq!(
        get(&m.path("plain"), "user.late"),
        Err(libc::ENODATA),
        "none, as the listing said"
    );
    assert_eq!(list(&m.path("plain")), b"");
    assert_eq!(
        m.stats.calls(Op::Getxattr) + m.stats.calls(Op::Listxattr),
        asked + 2,
        "answered without asking the brick"
    );
    // A directory is always asked.
    std::fs::create_dir(m.path("d")).unwrap();
    assert_eq!(std::fs::read_dir(m.mnt()).unwrap().count(), 3);
    set(&m.brick().join("d"), "user.d", b"4");
    assert_eq!(get(&m.path("d"), "user.d"), Ok(b"4".to_vec()));

    // A change through the mount is seen at once, and the brick is asked again.
    set(&m.path("plain"), "user.own", b"3");
    assert_eq!(get(&m.path("plain"), "user.own"), Ok(b"3".to_vec()));
    assert_eq!(get(&m.path("plain"), "user.late"), Ok(b"2".to_vec()));
}
