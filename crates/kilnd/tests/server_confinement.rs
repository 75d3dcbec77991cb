//! Paths that try to leave the brick are refused, and nothing outside it is touched.

mod common;

use common::{snapshot, Kilnd, Raw};
use kiln_client::{block_on, Client};
use kiln_proto::codec::Wire;
use kiln_proto::ops::*;
use kiln_proto::{errno, Op};

/// A directory beside the brick with a file in it: the target every escape aims at.
fn outside(k: &Kilnd) -> std::path::PathBuf {
    let o = k.dir.path().join("outside");
    std::fs::create_dir_all(&o).expect("outside dir");
    std::fs::write(o.join("secret"), b"do not touch").expect("secret");
    o
}

fn is_refused(r: std::io::Result<impl std::fmt::Debug>, what: &str) {
    match r {
        Ok(v) => panic!("{what}: expected a refusal, got {v:?}"),
        Err(e) => {
            let code = e.raw_os_error().unwrap_or(0) as u32;
            assert!(
                [
                    errno::EACCES,
                    errno::ENOENT,
                    20, /* ENOTDIR */
                    40  /* ELOOP */
                ]
                .contains(&code),
                "{what}: unexpected error {e}"
            );
        }
    }
}

#[test]
fn dotdot_absolute_and_symlink_escapes_are_refused() {
    let k = Kilnd::start();
    let out = outside(&k);
    // Links planted in the brick by someone with local access.
    std::os::unix::fs::symlink(&out, k.brick.join("abs-link")).expect("symlink");
    std::os::unix::fs::symlink("../outside", k.brick.join("rel-link")).expect("symlink");
    std::os::unix::fs::symlink("/proc/self/root/etc", k.brick.join("proc-link")).expect("symlink");
    std::fs::create_dir(k.brick.join("sub")).expect("sub");
    std::os::unix::fs::symlink("../../outside/secret", k.brick.join("sub/deep-link"))
        .expect("symlink");
    let before = snapshot(&out);

    let c = Client::connect(&k.tcp).expect("connect");
    let wr = libc::O_RDWR;
    for p in [
        "../outside/secret",
        "sub/../../outside/secret",
        "..",
        "abs-link/secret",
        "rel-link/secret",
        "sub/deep-link",
        "proc-link/passwd",
    ] {
        is_refused(block_on(c.open(p, wr)), &format!("open {p}"));
        is_refused(
            block_on(c.create(&format!("{p}/new"), wr, 0o644)),
            &format!("create {p}/new"),
        );
    }
    for p in ["abs-link/x", "rel-link/x", "../x"] {
        is_refused(block_on(c.mkdir(p, 0o755)), &format!("mkdir {p}"));
        is_refused(
            block_on(c.symlink("/etc/passwd", p)),
            &format!("symlink {p}"),
        );
        is_refused(
            block_on(c.lookup(&format!("{p}/y"))),
            &format!("lookup {p}/y"),
        );
    }
    is_refused(
        block_on(c.unlink("rel-link/secret")),
        "unlink through a link",
    );
    is_refused(
        block_on(c.rename("rel-link/secret", "stolen", 0)),
        "rename from outside",
    );
    is_refused(
        block_on(c.link("abs-link/secret", "hard")),
        "hard link to outside",
    );
    is_refused(
        block_on(c.setxattr("rel-link/secret", "user.x", b"1", 0)),
        "setxattr outside",
    );
    is_refused(
        block_on(c.getxattr("abs-link/secret", "user.x")),
        "getxattr outside",
    );
    is_refused(block_on(c.readdir("abs-link")), "readdir outside");

    // A symlink itself is fine to look at (lstat semantics), and links inside still work.
    let a = block_on(c.lookup("abs-link")).expect("lstat of the link itself");
    assert_eq!(a.mode & libc::S_IFMT, libc::S_IFLNK);
    block_on(c.mkdir("d", 0o755)).expect("mkdir");
    block_on(c.symlink("d", "inner-link")).expect("symlink inside");
    let (fh, _) =
        block_on(c.create("inner-link/f", wr, 0o644)).expect("create through an inner link");
    block_on(c.close(fh)).expect("close");
    assert!(k.brick.join("d/f").exists());

    // Absolute paths never reach the wire from the client (they are volume paths); sent raw,
    // the server refuses them.
    let mut raw = Raw::connect(&k);
    for (i, p) in ["/etc/passwd", "/", "a/../../x", "./x", "a//b"]
        .iter()
        .enumerate()
    {
        let (h, _, _) = raw.call(
            Op::Lookup as u16,
            i as u64 + 1,
            &PathReq { path: (*p).into() }.to_wire(),
        );
        assert_eq!(h.status.get(), errno::EACCES, "raw lookup {p}");
        let (h, _, _) = raw.call(
            Op::Open as u16,
            i as u64 + 100,
            &OpenReq {
                path: (*p).into(),
                flags: 0,
                peek: 0,
            }
            .to_wire(),
        );
        assert_eq!(h.status.get(), errno::EACCES, "raw open {p}");
    }
    assert_eq!(
        snapshot(&out),
        before,
        "something outside the brick changed"
    );
}
