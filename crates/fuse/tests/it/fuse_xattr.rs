//! What the mount answers about extended attributes without asking its brick
//! (`crates/fuse/src/xattr.rs`): "not supported" for `security.*` and, without `--acl`, for
//! POSIX ACLs; none for an entry a listing said has none, until the entry's attribute timeout;
//! its own changes are seen at once. With `--acl`, ACLs are stored and the kernel enforces
//! them.

use crate::common;

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
    // The brick host's security labels are not the client's, and ACLs are off.
    assert_eq!(
        get(&m.path("tagged"), "security.kiln-test"),
        Err(libc::EOPNOTSUPP)
    );
    assert_eq!(
        get(&m.path("tagged"), "system.posix_acl_access"),
        Err(libc::EOPNOTSUPP)
    );
    assert_eq!(list(&m.path("tagged")), b"user.t\0");
    assert_eq!(
        m.stats.calls(Op::Getxattr) + m.stats.calls(Op::Listxattr),
        asked + 2,
        "asked the brick for tagged's user.t and list, not for security.* or ACLs"
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

/// The binary form of an access ACL (`system.posix_acl_access`, version 2): the owner `rw`,
/// user `uid` read only, group and others nothing.
fn acl_granting_read(uid: u32) -> Vec<u8> {
    const UNDEFINED: u32 = u32::MAX;
    // (tag, permissions, id): user_obj, user, group_obj, mask, other.
    let entries = [
        (0x01u16, 6u16, UNDEFINED),
        (0x02, 4, uid),
        (0x04, 0, UNDEFINED),
        (0x10, 4, UNDEFINED),
        (0x20, 0, UNDEFINED),
    ];
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Whether `uid` can read `p` (through `setpriv`, as a real other user would).
fn can_read(uid: u32, p: &Path) -> bool {
    std::process::Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
        ])
        .arg("cat")
        .arg(p)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run setpriv")
        .success()
}

fn set_err(p: &Path, name: &str, v: &[u8]) -> i32 {
    let name = CString::new(name).unwrap();
    // SAFETY: valid C strings and value buffer.
    let r = unsafe { libc::setxattr(c(p).as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(r, -1, "setxattr {p:?} succeeded");
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[test]
fn acls_only_with_the_option_and_then_enforced() {
    const NOBODY: u32 = 65534;
    let acl = acl_granting_read(NOBODY);

    // Without --acl: not supported, and nothing reaches the brick.
    let m = Mounted::new(Mode::General);
    std::fs::write(m.path("f"), b"secret").unwrap();
    assert_eq!(
        set_err(&m.path("f"), "system.posix_acl_access", &acl),
        libc::EOPNOTSUPP
    );
    assert_eq!(
        set_err(&m.path("f"), "security.kiln-test", b"x"),
        libc::EOPNOTSUPP
    );
    assert_eq!(
        get(&m.brick().join("f"), "system.posix_acl_access"),
        Err(libc::ENODATA)
    );
    drop(m);

    // With --acl: stored on the brick, read back, and the kernel lets NOBODY read a 0600 file.
    let m = Mounted::with_acl();
    // Let NOBODY reach the mount point (the test's directory is 0700).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(m.dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(m.brick(), PermissionsExt::from_mode(0o755)).unwrap();
    let f = m.path("f");
    std::fs::write(&f, b"secret").unwrap();
    std::fs::set_permissions(&f, PermissionsExt::from_mode(0o600)).unwrap();
    assert!(!can_read(NOBODY, &f), "0600 and no ACL: refused");
    set(&f, "system.posix_acl_access", &acl);
    assert_eq!(
        get(&f, "system.posix_acl_access").map(|v| v.len()),
        Ok(acl.len())
    );
    assert!(
        get(&m.brick().join("f"), "system.posix_acl_access").is_ok(),
        "the ACL is stored on the brick"
    );
    assert!(can_read(NOBODY, &f), "the ACL grants NOBODY read");
}
