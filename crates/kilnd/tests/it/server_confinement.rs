//! Paths that try to leave the brick are refused, and nothing outside it is touched.

use crate::common;

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

/// Runs `f` on its own thread and fails the test if it has not returned within `secs` seconds
/// (a fop that blocks the brick fails the test instead of hanging it).
fn bounded<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()));
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("{what}: no answer within {secs} s (the brick blocked?)"))
}

fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>, what: &str) -> u32 {
    match r {
        Ok(v) => panic!("{what}: expected a refusal, got {v:?}"),
        Err(e) => e.raw_os_error().unwrap_or(0) as u32,
    }
}

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn a_user_may_not_make_device_nodes() {
    let k = Kilnd::start();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&k.brick, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let vol = kiln_client::Volume::connect(&k.tcp).expect("connect");
    let as_user = |uid: u32| {
        vol.on_behalf_of(Some(std::sync::Arc::new(kiln_proto::Cred {
            uid,
            gid: uid,
            groups: Vec::new(),
        })))
    };
    let dev = rustix::fs::makedev(7, 0);
    // The kernel refuses a user; root makes them only because this brick's compatibility
    // identity (no key, no root squash) holds the devices capability (identities without it
    // are refused by the brick: server_auth.rs).
    for (name, kind) in [("blk", libc::S_IFBLK), ("chr", libc::S_IFCHR)] {
        let r = block_on(as_user(1000).mknod(name, kind | 0o666, dev));
        assert_eq!(errno_of(r, name), errno::EPERM, "{name} as 1000");
        assert!(!k.brick.join(name).exists(), "{name} was made as 1000");
        let a = block_on(as_user(0).mknod(name, kind | 0o600, dev)).expect(name);
        assert_eq!(a.mode & libc::S_IFMT, kind, "{name} as root");
    }
    let user = as_user(1000);
    // A FIFO, a socket and a regular file need nothing.
    for (name, kind) in [
        ("fifo", libc::S_IFIFO),
        ("sock", libc::S_IFSOCK),
        ("reg", libc::S_IFREG),
    ] {
        let a = block_on(user.mknod(name, kind | 0o644, 0)).expect(name);
        assert_eq!(a.mode & libc::S_IFMT, kind, "{name}");
        assert_eq!(a.uid, 1000, "{name}");
    }
}

#[test]
fn special_files_are_listed_but_never_opened() {
    if !root() {
        eprintln!("skipped: making device nodes in the brick needs root");
        return;
    }
    let k = Kilnd::start();
    use rustix::fs::{mknodat, FileType, Mode, CWD};
    let mode = Mode::from_raw_mode(0o666);
    mknodat(CWD, k.brick.join("fifo"), FileType::Fifo, mode, 0).expect("mkfifo");
    mknodat(CWD, k.brick.join("sock"), FileType::Socket, mode, 0).expect("socket node");
    let null = rustix::fs::makedev(1, 3);
    mknodat(
        CWD,
        k.brick.join("null"),
        FileType::CharacterDevice,
        mode,
        null,
    )
    .expect("mknod");
    std::os::unix::fs::symlink("fifo", k.brick.join("to-fifo")).expect("symlink");

    let c = Client::connect(&k.tcp).expect("connect");
    let listed: Vec<_> = block_on(c.readdir(""))
        .expect("readdir")
        .into_iter()
        .map(|e| (e.name, e.attr.mode & libc::S_IFMT))
        .collect();
    for (name, kind) in [
        ("fifo", libc::S_IFIFO),
        ("sock", libc::S_IFSOCK),
        ("null", libc::S_IFCHR),
    ] {
        assert!(listed.contains(&(name.into(), kind)), "{name}: {listed:?}");
        let a = block_on(c.lookup(name)).expect("lookup");
        assert_eq!(a.mode & libc::S_IFMT, kind, "{name}");
    }
    let vol = kiln_client::Volume::connect(&k.tcp).expect("connect");
    let vol = std::sync::Arc::new(vol);
    for name in ["fifo", "sock", "null", "to-fifo"] {
        for flags in [libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR] {
            let addr = k.tcp.clone();
            let what = format!("open {name} {flags:#o}");
            let r = bounded(5, &what, move || {
                let c = Client::connect(&addr).expect("connect");
                block_on(c.open(name, flags))
            });
            assert_eq!(errno_of(r, &what), libc::ENXIO as u32, "{what}");
            let v = vol.clone();
            let r = bounded(5, &what, move || {
                block_on(v.create(name, flags | libc::O_CREAT, 0o644))
            });
            assert_eq!(errno_of(r, &what), libc::ENXIO as u32, "create {what}");
        }
        // The whole-file open of small files (what fetch-ahead uses) is refused the same way.
        let v = vol.clone();
        let r = bounded(5, name, move || {
            block_on(v.open_small(name, libc::O_RDONLY, 64 * 1024)).map(|_| ())
        });
        assert_eq!(errno_of(r, name), libc::ENXIO as u32, "open_small {name}");
    }
    // Their attributes still change without opening them.
    let a = block_on(vol.setattr(
        "fifo",
        SetAttrs {
            valid: SETATTR_MODE,
            mode: 0o600,
            ..SetAttrs::default()
        },
    ))
    .expect("chmod of a FIFO");
    assert_eq!(a.mode & 0o7777, 0o600);
}

#[test]
fn a_fifo_open_does_not_stall_other_clients() {
    let mut k = Kilnd::start();
    let c = Client::connect(&k.tcp).expect("connect");
    block_on(c.mknod("fifo", libc::S_IFIFO | 0o666, 0)).expect("mkfifo through the brick");
    // Opened for reading, a FIFO without a writer would never let the open return.
    let addr = k.tcp.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let c = Client::connect(&addr).expect("connect");
        let _ = tx.send(block_on(c.open("fifo", libc::O_RDONLY)));
    });
    // Meanwhile another client's I/O goes on.
    let addr = k.tcp.clone();
    bounded(10, "another client's I/O", move || {
        let c = Client::connect(&addr).expect("connect");
        let (fh, _) = block_on(c.create("other", libc::O_RDWR, 0o644)).expect("create");
        block_on(c.pwritev(fh, vec![b"still served".to_vec()], 0))
            .0
            .expect("write");
        let (n, bufs) = block_on(c.preadv(fh, vec![vec![0u8; 64]], 0));
        assert_eq!(&bufs[0][..n.expect("read")], b"still served");
        block_on(c.close(fh)).expect("close");
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("the FIFO open answered");
    assert_eq!(errno_of(r, "open fifo"), libc::ENXIO as u32);
    assert!(k.alive());
}

#[test]
fn the_bricks_state_dir_is_unreachable_through_symlinks() {
    let k = Kilnd::start();
    let state = k.brick.join(".kiln");
    std::fs::create_dir(&state).expect(".kiln");
    std::fs::write(state.join("identity"), b"brick identity").expect("identity");
    std::fs::create_dir(k.brick.join("dir")).expect("dir");
    std::fs::write(k.brick.join("dir/file"), b"shared").expect("file");
    let before = snapshot(&state);

    let c = Client::connect(&k.tcp).expect("connect");
    block_on(c.symlink(".kiln", "kk")).expect("the symlink itself may be made");
    block_on(c.symlink(".", "here")).expect("symlink");
    block_on(c.symlink("dir", "a")).expect("symlink");
    let wr = libc::O_RDWR;
    let acc = errno::EACCES;
    let refused = |r: std::io::Result<_>, what: &str| assert_eq!(errno_of(r, what), acc, "{what}");
    refused(block_on(c.lookup("kk/identity")).map(|_| ()), "lookup");
    refused(
        block_on(c.lookup("here/.kiln")).map(|_| ()),
        "lookup via here",
    );
    refused(
        block_on(c.open("kk/identity", libc::O_RDONLY)).map(|_| ()),
        "open",
    );
    refused(
        block_on(c.open("kk", libc::O_RDONLY | libc::O_DIRECTORY)).map(|_| ()),
        "open the dir",
    );
    refused(block_on(c.readdir("kk")).map(|_| ()), "readdir");
    refused(
        block_on(c.create("kk/new", wr, 0o644)).map(|_| ()),
        "create",
    );
    refused(
        block_on(c.create("kk/identity", wr | libc::O_TRUNC, 0o644)).map(|_| ()),
        "create over",
    );
    refused(
        block_on(c.create("here/.kiln/new", wr, 0o644)).map(|_| ()),
        "create via here",
    );
    refused(block_on(c.mkdir("kk/d", 0o755)).map(|_| ()), "mkdir");
    refused(
        block_on(c.rename("kk/identity", "stolen", 0)),
        "rename from",
    );
    refused(
        block_on(c.rename("dir/file", "kk/identity", 0)),
        "rename to",
    );
    refused(
        block_on(c.link("kk/identity", "hard")).map(|_| ()),
        "link from",
    );
    refused(
        block_on(c.link("dir/file", "kk/planted")).map(|_| ()),
        "link to",
    );
    refused(block_on(c.unlink("kk/identity")), "unlink");
    refused(block_on(c.symlink("x", "kk/l")).map(|_| ()), "symlink in");
    refused(
        block_on(c.setxattr("kk/identity", "user.x", b"1", 0)),
        "setxattr",
    );
    for root in ["", "here"] {
        let names: Vec<String> = block_on(c.readdir(root))
            .expect("readdir")
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert!(!names.iter().any(|n| n == ".kiln"), "{root:?}: {names:?}");
    }
    assert_eq!(snapshot(&state), before, ".kiln changed");
    // A symlink to a normal directory still works.
    let fh = block_on(c.open("a/file", libc::O_RDONLY)).expect("open through a -> dir");
    let (n, bufs) = block_on(c.preadv(fh, vec![vec![0u8; 64]], 0));
    assert_eq!(&bufs[0][..n.expect("read")], b"shared");
    block_on(c.close(fh)).expect("close");
    assert_eq!(block_on(c.readlink("kk")).expect("readlink"), ".kiln");
}
