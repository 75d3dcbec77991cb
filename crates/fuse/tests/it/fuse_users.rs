//! Many users on one mount: every user may use it, the bricks act as the caller (access checks,
//! ownership of what they create, supplementary and setgid groups), and modes are stored as
//! the caller asked, umask included. Run through a real mount as real users (`setpriv`).

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// A's uid and gid, and B's: two users of one general mount.
const A: u32 = 1001;
const B: u32 = 1002;
/// Small files in each directory of [`cache_tree`]: a read of the first fetches the rest ahead.
const FILES: usize = 8;

/// Sets `user:uid:---` in the POSIX ACL of brick path `p` (owner, group and other keep its mode
/// bits), as `setfacl -m u:UID:--- p` does: the brick refuses `uid` what its mode allows.
fn deny_on_brick(p: &Path, uid: u32) {
    let mode = owner(p).2;
    // The `system.posix_acl_access` value: version 2, then (tag, perm, id) by tag and id.
    let mut acl = 2u32.to_le_bytes().to_vec();
    let any = u32::MAX;
    for (tag, perm, id) in [
        (0x01u16, mode >> 6 & 7, any), // the owner
        (0x02, 0, uid),                // user:uid:---
        (0x04, mode >> 3 & 7, any),    // the group
        (0x10, mode >> 3 & 7, any),    // the mask
        (0x20, mode & 7, any),         // other
    ] {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&(perm as u16).to_le_bytes());
        acl.extend_from_slice(&id.to_le_bytes());
    }
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
    let name = c"system.posix_acl_access";
    // SAFETY: valid NUL-terminated strings and a buffer of the length given.
    let r = unsafe { libc::setxattr(c.as_ptr(), name.as_ptr(), acl.as_ptr().cast(), acl.len(), 0) };
    assert_eq!(
        r,
        0,
        "ACL on {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

/// On brick `brick`, straight (nothing is cached yet): `own/` with A's 0600 small files,
/// `acl/` with 0644 small files of A's that an ACL forbids to B, and `top/` with `locked/`
/// (0700, A's) and `barred/` (0755, an ACL forbids it to B), each holding a file.
fn cache_tree(brick: &Path) {
    let mk = |p: &str, mode: u32| {
        let p = brick.join(p);
        std::fs::create_dir(&p).unwrap();
        std::fs::set_permissions(&p, PermissionsExt::from_mode(mode)).unwrap();
        std::os::unix::fs::chown(&p, Some(A), Some(A)).unwrap();
    };
    let file = |p: &str, mode: u32| {
        let p = brick.join(p);
        std::fs::write(&p, format!("secret of {}\n", p.display())).unwrap();
        std::fs::set_permissions(&p, PermissionsExt::from_mode(mode)).unwrap();
        std::os::unix::fs::chown(&p, Some(A), Some(A)).unwrap();
    };
    for (d, mode) in [("own", 0o755), ("acl", 0o755), ("top", 0o755)] {
        mk(d, mode);
    }
    mk("top/locked", 0o700);
    mk("top/barred", 0o755);
    for i in 0..FILES {
        file(&format!("own/f{i}"), 0o600);
        file(&format!("acl/g{i}"), 0o644);
        deny_on_brick(&brick.join(format!("acl/g{i}")), B);
    }
    file("top/locked/hidden-name", 0o644);
    file("top/barred/hidden-name", 0o644);
    deny_on_brick(&brick.join("top/barred"), B);
}

/// A reads the first file of `dir` in listing order (so the others are fetched ahead for
/// A), and the test waits until the mount holds them.
fn a_reads_first_of(mnt: &str, dir: &str, counters: &kiln_fuse::Counters) {
    let before = counters.ahead_ready.load(Ordering::Relaxed);
    ok(
        A,
        A,
        &[],
        &format!("cat {mnt}/{dir}/$(ls -U {mnt}/{dir} | head -n 1) >/dev/null"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while counters.ahead_ready.load(Ordering::Relaxed) < before + FILES as u64 - 1 {
        assert!(
            Instant::now() < deadline,
            "{dir}: nothing fetched ahead for A"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `who` reads each file of `dir` (some fetched ahead for A): each is refused, and none of its
/// bytes show.
fn refused_each(mnt: &str, dir: &str, who: u32) {
    for e in std::fs::read_dir(format!("{mnt}/{dir}")).unwrap() {
        let f = format!("{mnt}/{dir}/{}", e.unwrap().file_name().to_string_lossy());
        let out = Command::new("setpriv")
            .args([
                &format!("--reuid={who}"),
                &format!("--regid={who}"),
                "--clear-groups",
            ])
            .args(["cat", &f])
            .output()
            .expect("run setpriv");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{who} read {f}, fetched ahead for {A}"
        );
        assert!(err.contains("Permission denied"), "{f}: {err}");
        assert!(out.stdout.is_empty(), "{who} got bytes of {f}");
    }
}

/// `who` lists `dir`, fetched ahead for A when A listed its parent: refused, no names shown.
fn refused_listing(mnt: &str, dir: &str, who: u32) {
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={who}"),
            &format!("--regid={who}"),
            "--clear-groups",
        ])
        .args(["ls", "-a", &format!("{mnt}/{dir}")])
        .output()
        .expect("run setpriv");
    let (said, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{who} listed {dir}: {said}");
    assert!(err.contains("Permission denied"), "{dir}: {err}");
    assert!(
        !said.contains("hidden-name"),
        "{who} saw {dir}'s names: {said}"
    );
}

/// The finding "cross-user cache": what the mount fetched ahead for A (small files' content,
/// listings) is not given to B, who may not read or list them on the brick — not for mode
/// bits the kernel checks itself, nor for an ACL on the brick only the brick checks.
#[test]
fn fetched_ahead_for_one_user_is_not_anothers() {
    let m = Mounted::new(Mode::General);
    std::fs::set_permissions(m.dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(m.brick(), PermissionsExt::from_mode(0o755)).unwrap();
    cache_tree(&m.brick());
    let mnt = m.mnt().display().to_string();

    a_reads_first_of(&mnt, "own", &m.counters);
    refused_each(&mnt, "own", B);
    a_reads_first_of(&mnt, "acl", &m.counters);
    refused_each(&mnt, "acl", B);
    // A still reads what the mount fetched for A.
    ok(
        A,
        A,
        &[],
        &format!("cat {mnt}/acl/* {mnt}/own/* >/dev/null"),
    );

    // A lists top/: its subdirectories' listings are fetched ahead for A.
    ok(A, A, &[], &format!("ls {mnt}/top >/dev/null"));
    refused_listing(&mnt, "top/barred", B);
    refused_listing(&mnt, "top/locked", B);
    ok(
        A,
        A,
        &[],
        &format!("ls {mnt}/top/barred | grep -q hidden-name"),
    );
}

/// The finding's first case: root on a mount of a volume that squashes root is refused A's
/// 0600 files and 0700 directory after A read and listed them (the kernel lets root past the
/// mode bits; only the brick refuses).
#[test]
fn squashed_root_gets_nothing_fetched_ahead_for_a_user() {
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(tmp.path(), PermissionsExt::from_mode(0o755)).unwrap();
    let brick = tmp.path().join("brick");
    std::fs::create_dir(&brick).unwrap();
    std::fs::set_permissions(&brick, PermissionsExt::from_mode(0o755)).unwrap();
    cache_tree(&brick);
    let sock = squashing_brick(tmp.path(), &brick);
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let vol = Volume::connect(&format!("unix:{}", sock.display())).expect("connect");
    let fs = kiln_fuse::KilnFs::new(Arc::new(vol), Mode::General, Duration::from_secs(1))
        .expect("the volume's root");
    let counters = fs.counters();
    let session = kiln_fuse::serve_background(fs, "test:/vol", &mnt, 4).expect("mount");
    let mnt_s = mnt.display().to_string();
    refused(
        0,
        0,
        &[],
        &format!("cat {mnt_s}/own/f0"),
        "Permission denied",
    );

    a_reads_first_of(&mnt_s, "own", &counters);
    refused_each(&mnt_s, "own", 0);
    ok(A, A, &[], &format!("ls {mnt_s}/top >/dev/null"));
    refused_listing(&mnt_s, "top/locked", 0);
    // A's `ls -l` lists own/ with readdirplus: its files have no extended attributes. Root
    // (this process) may not read A's 0600 file's: the brick says so, not "none".
    ok(A, A, &[], &format!("ls -l {mnt_s}/own >/dev/null"));
    let f = std::ffi::CString::new(format!("{mnt_s}/own/f0")).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: a valid NUL-terminated path and name, and a buffer of the length given.
    let r = unsafe {
        libc::getxattr(
            f.as_ptr(),
            c"user.x".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let e = std::io::Error::last_os_error();
    assert_eq!(
        (r, e.raw_os_error()),
        (-1, Some(libc::EACCES)),
        "root's getxattr: {e}"
    );
    drop(session);
}

/// Serves brick directory `brick` with root squashed, as `kilnd --volfile` does, in a thread
/// of this process; its socket once it accepts connections.
fn squashing_brick(tmp: &Path, brick: &Path) -> std::path::PathBuf {
    use clap::Parser;
    let mut vf = kiln_server::default_volfile(brick);
    for l in vf.layers.iter_mut() {
        if let kiln_server::LayerKind::Posix(p) = &mut l.kind {
            p.root_squash = true;
        }
    }
    let (file, sock) = (tmp.join("brick.toml"), tmp.join("kilnd.sock"));
    std::fs::write(&file, vf.to_toml()).expect("volfile");
    let argv = [
        "kilnd".into(),
        "--volfile".into(),
        file.into_os_string(),
        "--listen".into(),
        format!("unix:{}", sock.display()).into(),
        "--metrics".into(),
        "off".into(),
    ];
    let args = kilnd::ServeArgs::try_parse_from(argv).expect("kilnd arguments");
    let server = std::thread::spawn(move || kilnd::main(args));
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(!server.is_finished(), "the brick ended");
        assert!(
            Instant::now() < deadline,
            "the brick did not listen in time"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    sock
}

/// A directory A made through the mount is known empty to the mount, which answers A's
/// lookups of names not there itself; B, whom an ACL on the brick bars from it, is answered
/// by the brick: refused, not told what is absent.
#[test]
fn names_known_absent_are_told_only_to_the_maker() {
    let m = Mounted::new(Mode::General);
    std::fs::set_permissions(m.dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(m.brick(), PermissionsExt::from_mode(0o755)).unwrap();
    let shared = m.brick().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, PermissionsExt::from_mode(0o777)).unwrap();
    let mnt = m.mnt().display().to_string();
    ok(A, A, &[], &format!("mkdir -m 0755 {mnt}/shared/made"));
    deny_on_brick(&m.brick().join("shared/made"), B);
    refused(
        A,
        A,
        &[],
        &format!("stat {mnt}/shared/made/none"),
        "No such file",
    );
    refused(
        B,
        B,
        &[],
        &format!("stat {mnt}/shared/made/none"),
        "Permission denied",
    );
}
