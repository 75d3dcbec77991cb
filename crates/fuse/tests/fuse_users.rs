//! Many users on one mount: every user may use it, the bricks act as the caller (access checks,
//! ownership of what they create, supplementary and setgid groups), and modes are stored as
//! the caller asked, umask included. Run through a real mount as real users (`setpriv`).

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::Mounted;
use kiln_client::{block_on, Volume};
use kiln_fuse::Mode;
use kiln_proto::Cred;

const NOBODY: u32 = 65534;
const GROUP: u32 = 4242;

/// Runs `script` with `sh` as `uid`/`gid` with supplementary `groups` and umask 022 (the
/// in-process brick set this process's to 0); its exit status and stderr.
fn as_user(uid: u32, gid: u32, groups: &[u32], script: &str) -> (bool, String) {
    let mut c = Command::new("setpriv");
    c.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"));
    if groups.is_empty() {
        c.arg("--clear-groups");
    } else {
        let g: Vec<String> = groups.iter().map(u32::to_string).collect();
        c.arg(format!("--groups={}", g.join(",")));
    }
    let script = format!("umask 022; {script}");
    let out = c.args(["sh", "-c", &script]).output().expect("run setpriv");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(uid: u32, gid: u32, groups: &[u32], script: &str) {
    let (good, err) = as_user(uid, gid, groups, script);
    assert!(good, "as {uid}:{gid} {groups:?}: `{script}` failed: {err}");
}

fn refused(uid: u32, gid: u32, groups: &[u32], script: &str, why: &str) {
    let (good, err) = as_user(uid, gid, groups, script);
    assert!(!good, "as {uid}:{gid}: `{script}` succeeded");
    assert!(err.contains(why), "`{script}`: wanted {why:?}, got {err}");
}

fn owner(p: &Path) -> (u32, u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

fn users(mode: Mode) {
    let m = Mounted::new(mode);
    // Let other users reach the mount point (the test's directory is 0700).
    std::fs::set_permissions(m.dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(m.brick(), PermissionsExt::from_mode(0o755)).unwrap();
    let mnt = m.mnt().display().to_string();
    let brick = m.brick();
    ok(
        0,
        0,
        &[],
        &format!(
            "umask 022; mkdir -m 0777 {mnt}/shared && mkdir -m 0700 {mnt}/private && \
         echo root > {mnt}/rootfile && chmod 0644 {mnt}/rootfile && \
         mkdir -m 0770 {mnt}/grp && chgrp {GROUP} {mnt}/grp && \
         mkdir -m 2777 {mnt}/sg && chgrp {GROUP} {mnt}/sg && chmod 2777 {mnt}/sg"
        ),
    );

    // Anyone may look and read what the modes allow, and nothing more.
    ok(
        NOBODY,
        NOBODY,
        &[],
        &format!("ls {mnt} >/dev/null && cat {mnt}/rootfile >/dev/null"),
    );
    refused(
        NOBODY,
        NOBODY,
        &[],
        &format!("echo x > {mnt}/rootfile"),
        "Permission denied",
    );
    refused(
        NOBODY,
        NOBODY,
        &[],
        &format!("ls {mnt}/private"),
        "Permission denied",
    );
    refused(
        NOBODY,
        NOBODY,
        &[],
        &format!("touch {mnt}/grp/x"),
        "Permission denied",
    );

    // What a user makes is theirs on the brick, with the mode asked for.
    ok(
        NOBODY,
        NOBODY,
        &[],
        &format!(
            "mkdir {mnt}/shared/d && echo hi > {mnt}/shared/d/f && chmod 0600 {mnt}/shared/d/f && \
         ln -s f {mnt}/shared/d/l && cat {mnt}/shared/d/f >/dev/null"
        ),
    );
    assert_eq!(owner(&brick.join("shared/d")), (NOBODY, NOBODY, 0o755));
    assert_eq!(owner(&brick.join("shared/d/f")), (NOBODY, NOBODY, 0o600));
    assert_eq!(owner(&brick.join("shared/d/l")).0, NOBODY);
    refused(
        NOBODY,
        NOBODY,
        &[],
        &format!("chown 0 {mnt}/shared/d/f"),
        "Operation not permitted",
    );
    refused(
        NOBODY,
        NOBODY,
        &[],
        &format!("chmod 0666 {mnt}/rootfile"),
        "Operation not permitted",
    );
    // Another user cannot read the 0600 file; root can.
    refused(
        1000,
        1000,
        &[],
        &format!("cat {mnt}/shared/d/f"),
        "Permission denied",
    );
    ok(0, 0, &[], &format!("cat {mnt}/shared/d/f >/dev/null"));

    // Supplementary groups count, and a setgid directory gives its group.
    ok(
        NOBODY,
        NOBODY,
        &[GROUP],
        &format!("touch {mnt}/grp/x && touch {mnt}/sg/y"),
    );
    assert_eq!(owner(&brick.join("grp/x")).0, NOBODY);
    assert_eq!(owner(&brick.join("sg/y")).1, GROUP, "setgid parent's group");
    ok(
        NOBODY,
        NOBODY,
        &[GROUP],
        &format!("chgrp {GROUP} {mnt}/shared/d/f"),
    );
    assert_eq!(owner(&brick.join("shared/d/f")).1, GROUP);

    // The caller's umask, not the brick's: umask 0 keeps 0777 and 0666.
    ok(
        NOBODY,
        NOBODY,
        &[],
        &format!(
            "umask 0; mkdir -m 0777 {mnt}/shared/open && : > {mnt}/shared/open/f && \
         chmod 0666 {mnt}/shared/open/f; umask 027; mkdir {mnt}/shared/masked"
        ),
    );
    assert_eq!(owner(&brick.join("shared/open")).2, 0o777);
    assert_eq!(owner(&brick.join("shared/masked")).2, 0o750);

    set_id_bits(&m);

    // The brick itself checks, not only the client's kernel: a stack used on behalf of a
    // user (no FUSE in between) is refused what the user may not do.
    let sock = m.dir.path().join("kilnd.sock");
    let vol = Volume::connect(&format!("unix:{}", sock.display())).expect("connect");
    let nobody = vol.on_behalf_of(Some(Arc::new(Cred {
        uid: NOBODY,
        gid: NOBODY,
        groups: vec![],
    })));
    let e = block_on(nobody.open("rootfile", libc::O_WRONLY)).expect_err("write-open refused");
    assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    let e = block_on(nobody.mkdir("private/x", 0o755)).expect_err("mkdir refused");
    assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    assert!(
        block_on(vol.mkdir("private/x", 0o755)).is_ok(),
        "the process itself is root"
    );
}

/// A write by a user without `CAP_FSETID` drops a file's set-user-ID and set-group-ID bits
/// (the mount leaves that to the bricks: `FUSE_HANDLE_KILLPRIV_V2`); root's write keeps
/// them. Seen through the mount and on the brick, through write-behind (small appends), a
/// large write and truncation alike.
fn set_id_bits(m: &Mounted) {
    let (mnt, brick) = (m.mnt(), m.brick());
    for (name, write) in [
        ("small", "echo x >>"),
        ("large", "head -c 1000000 /dev/zero >>"),
    ] {
        for (who, kept) in [(0, 0o6777), (NOBODY, 0o777)] {
            let f = format!("shared/{name}-{who}");
            ok(
                0,
                0,
                &[],
                &format!(
                    "echo a > {mnt}/{f} && chmod 6777 {mnt}/{f}",
                    mnt = mnt.display()
                ),
            );
            ok(who, who, &[], &format!("{write} {}/{f}", mnt.display()));
            assert_eq!(owner(&brick.join(&f)).2, kept, "{f} on the brick");
            assert_eq!(owner(&mnt.join(&f)).2, kept, "{f} through the mount");
        }
    }
}

#[test]
fn users_on_a_general_mount() {
    users(Mode::General);
}

#[test]
fn users_on_a_vm_image_mount() {
    users(Mode::VmImage);
}
