//! The posix layer against real brick directories: special files are never opened, device
//! nodes need a capability, and `.kiln` cannot be reached through symlinks.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::brick::Brick;
use super::Posix;
use crate::{Ctx, Layer};
use kiln_proto::ops::{SetAttrs, SETATTR_MODE, SETATTR_SIZE};

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn run<F: std::future::Future>(f: F) -> F::Output {
    crate::exec::block_on(f)
}

fn as_user(uid: u32) -> Ctx {
    Ctx::NONE.with_cred(Some(Arc::new(kiln_proto::Cred {
        uid,
        gid: uid,
        groups: Vec::new(),
    })))
}

/// Runs `f` on a thread and fails the test if it does not return within a few seconds (an
/// open that blocks on a FIFO fails the test instead of hanging it).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()));
    rx.recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what}: did not return within 5 s (blocked?)"))
}

fn mknod(p: &Path, kind: rustix::fs::FileType, dev: u64) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        p,
        kind,
        rustix::fs::Mode::from_raw_mode(0o666),
        dev,
    )
    .expect("mknod");
}

#[test]
fn a_device_mknod_with_credentials_needs_the_capability() {
    if !root() {
        eprintln!("skipped: making device nodes needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let brick = Arc::new(Brick::open(dir.path()).unwrap());
    let posix = Posix::new("posix", brick);
    let null = rustix::fs::makedev(1, 3);
    let (chr, blk) = (libc::S_IFCHR | 0o600, libc::S_IFBLK | 0o600);
    for cx in [as_user(1000), as_user(0)] {
        assert_eq!(
            run(posix.mknod(&cx, "c", chr, null)),
            Err(libc::EPERM as u32)
        );
        assert_eq!(
            run(posix.mknod(&cx, "b", blk, null)),
            Err(libc::EPERM as u32)
        );
    }
    assert!(!dir.path().join("c").exists() && !dir.path().join("b").exists());
    // FIFOs, sockets and regular files need nothing.
    let user = as_user(1000);
    for (name, kind) in [
        ("p", libc::S_IFIFO),
        ("s", libc::S_IFSOCK),
        ("r", libc::S_IFREG),
    ] {
        let a = run(posix.mknod(&user, name, kind | 0o644, 0)).expect(name);
        assert_eq!(a.mode & libc::S_IFMT, kind, "{name}");
    }
    // With the capability, and without credentials (the brick's own work, heal).
    let able = as_user(0).with_devices(true);
    let a = run(posix.mknod(&able, "c", chr, null)).expect("device with the capability");
    assert_eq!(a.mode & libc::S_IFMT, libc::S_IFCHR);
    let a = run(posix.mknod(&Ctx::NONE, "b", blk, null)).expect("device for heal");
    assert_eq!(a.mode & libc::S_IFMT, libc::S_IFBLK);
}

#[test]
fn special_files_are_listed_and_looked_up_but_never_opened() {
    if !root() {
        eprintln!("skipped: making device nodes needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    mknod(&d.join("fifo"), rustix::fs::FileType::Fifo, 0);
    mknod(&d.join("sock"), rustix::fs::FileType::Socket, 0);
    let null = rustix::fs::makedev(1, 3);
    mknod(&d.join("null"), rustix::fs::FileType::CharacterDevice, null);
    symlink("fifo", d.join("to-fifo")).unwrap();
    std::fs::write(d.join("file"), b"data").unwrap();
    let b = Arc::new(Brick::open(d).unwrap());
    let names: Vec<String> = b
        .readdir("", 0, 100)
        .unwrap()
        .entries
        .0
        .into_iter()
        .map(|e| e.name)
        .collect();
    let enxio: Result<(), u32> = Err(libc::ENXIO as u32);
    for name in ["fifo", "sock", "null", "to-fifo"] {
        if name != "to-fifo" {
            assert!(names.iter().any(|n| n == name), "{name} in {names:?}");
        }
        b.lookup(name).expect(name);
        // A FIFO opened for reading would wait for a writer: bounded, it fails instead.
        for flags in [libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR] {
            let b2 = b.clone();
            let r = bounded(name, move || b2.open_file(name, flags as u32).err());
            assert_eq!(r, enxio.err(), "{name}");
            let b2 = b.clone();
            let r = bounded(name, move || {
                b2.create(name, (flags | libc::O_CREAT) as u32, 0o644).err()
            });
            assert_eq!(r, enxio.err(), "create {name}");
        }
        let size = SetAttrs {
            valid: SETATTR_SIZE,
            ..SetAttrs::default()
        };
        if name != "to-fifo" {
            assert_eq!(b.setattr(name, &size).err(), enxio.err(), "truncate {name}");
        }
        // Attributes change without opening.
        let mode = SetAttrs {
            valid: SETATTR_MODE,
            mode: 0o640,
            ..SetAttrs::default()
        };
        if name != "to-fifo" {
            let a = b.setattr(name, &mode).expect("chmod of a special file");
            assert_eq!(a.mode & 0o7777, 0o640, "{name}");
            b.listxattr(name).expect("listxattr of a special file");
        }
    }
    // O_NOFOLLOW on a symlink is refused as before.
    let nofollow = (libc::O_RDONLY | libc::O_NOFOLLOW) as u32;
    assert_eq!(
        b.open_file("to-fifo", nofollow).err(),
        Some(libc::ELOOP as u32)
    );
    // Regular files and directories open as ever.
    let f = b
        .open_file("file", libc::O_RDWR as u32)
        .expect("regular file");
    let mut buf = [0u8; 4];
    assert_eq!(super::brick::read_full(&f, &mut buf, 0), Ok(4));
    assert_eq!(&buf, b"data");
    b.open_file("", (libc::O_RDONLY | libc::O_DIRECTORY) as u32)
        .expect("a directory");
    let (_, a) = b
        .create("file", (libc::O_RDWR | libc::O_TRUNC) as u32, 0o644)
        .expect("create over an existing file");
    assert_eq!(a.size, 0);
    assert_eq!(
        b.create("file", (libc::O_RDWR | libc::O_EXCL) as u32, 0o644)
            .err(),
        Some(libc::EEXIST as u32)
    );
}

#[test]
fn the_state_dir_is_unreachable_through_symlinks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join(".kiln")).unwrap();
    std::fs::write(d.join(".kiln/identity"), b"secret").unwrap();
    std::fs::create_dir(d.join("dir")).unwrap();
    std::fs::write(d.join("dir/file"), b"ok").unwrap();
    let b = Brick::open(d).unwrap();
    b.symlink(".kiln", "kk").expect("the link itself is fine");
    b.symlink(".", "here").unwrap();
    b.symlink("dir", "a").unwrap();
    b.symlink("../.kiln/identity", "dir/id").unwrap();
    let acc = Some(libc::EACCES as u32);
    let rd = libc::O_RDONLY as u32;
    let cr = (libc::O_CREAT | libc::O_RDWR) as u32;
    assert_eq!(b.open_file("kk/identity", rd).err(), acc);
    assert_eq!(b.open_file("dir/id", rd).err(), acc);
    assert_eq!(b.open_file("kk", rd | libc::O_DIRECTORY as u32).err(), acc);
    assert_eq!(b.create("kk/new", cr, 0o644).err(), acc);
    assert_eq!(b.create("here/.kiln/new", cr, 0o644).err(), acc);
    assert_eq!(b.lookup("kk/identity").err(), acc);
    assert_eq!(b.lookup("here/.kiln").err(), acc);
    assert_eq!(b.readdir("kk", 0, 10).err(), acc);
    assert_eq!(b.mkdir("kk/d", 0o755).err(), acc);
    assert_eq!(b.mkdir("here/.kiln", 0o755).err(), acc);
    assert_eq!(b.rename("kk/identity", "stolen", 0).err(), acc);
    assert_eq!(b.rename("dir/file", "kk/identity", 0).err(), acc);
    assert_eq!(b.rename("dir", "here/.kiln", 0).err(), acc);
    assert_eq!(b.link("kk/identity", "hard").err(), acc);
    assert_eq!(b.link("dir/file", "kk/planted").err(), acc);
    assert_eq!(b.unlink("kk/identity").err(), acc);
    assert_eq!(b.symlink("x", "kk/l").err(), acc);
    assert_eq!(b.readlink("kk/l").err(), acc);
    assert_eq!(b.listxattr("kk/identity").err(), acc);
    assert_eq!(b.getxattr("kk/identity", "user.x").err(), acc);
    assert_eq!(b.getxattr("kk", "user.x").err(), Some(libc::ENODATA as u32));
    let mode = SetAttrs {
        valid: SETATTR_MODE,
        mode: 0o777,
        ..SetAttrs::default()
    };
    assert_eq!(b.setattr("kk/identity", &mode).err(), acc);
    // The root's listing hides it however the root is reached.
    for root in ["", "here"] {
        let listed = b.readdir(root, 0, 100).unwrap().entries.0;
        assert!(listed.iter().all(|e| e.name != ".kiln"), "{root:?}");
    }
    assert_eq!(std::fs::read(d.join(".kiln/identity")).unwrap(), b"secret");
    assert_eq!(std::fs::read_dir(d.join(".kiln")).unwrap().count(), 1);
    // Symlinks elsewhere work as ever; the final link itself is fine to look at.
    let f = b.open_file("a/file", rd).expect("through a -> dir");
    let mut buf = [0u8; 2];
    assert_eq!(super::brick::read_full(&f, &mut buf, 0), Ok(2));
    b.lookup("kk").expect("lstat of kk");
    b.lookup("here/dir/file").expect("through here -> .");
    b.create("a/new", cr, 0o644)
        .expect("create through a -> dir");
    assert_eq!(b.readlink("kk").unwrap(), ".kiln");
}

/// What one open and one lookup cost, against the single `openat2` a client open and the
/// `openat2` + `statat` a lookup took before special files and `.kiln` were checked:
/// `cargo test -p kiln-layer --release --lib posix::tests::cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn cost() {
    use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, ResolveFlags};
    use std::time::Instant;
    const N: u32 = 50_000;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("a/b/c")).unwrap();
    std::fs::write(d.join("a/b/c/f"), b"x").unwrap();
    symlink("a/b", d.join("l")).unwrap();
    let b = Brick::open(d).unwrap();
    let root = rfs::open(d, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
    let how = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    let time = |what: &str, f: &mut dyn FnMut()| {
        for _ in 0..1000 {
            f();
        }
        let t = Instant::now();
        for _ in 0..N {
            f();
        }
        let ns = t.elapsed().as_nanos() / N as u128;
        eprintln!("{what:<40} {ns:>6} ns");
    };
    let cl = OFlags::CLOEXEC | OFlags::NOCTTY;
    time("open, one openat2 (before)", &mut || {
        drop(rfs::openat2(&root, "a/b/c/f", OFlags::RDONLY | cl, Mode::empty(), how).unwrap());
    });
    time("open_file (now)", &mut || {
        drop(b.open_file("a/b/c/f", 0).unwrap());
    });
    time("open_file through a symlink (now)", &mut || {
        drop(b.open_file("l/c/f", 0).unwrap());
    });
    time("lookup, openat2 + statat (before)", &mut || {
        let p = rfs::openat2(
            &root,
            "a/b/c",
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
            how,
        );
        rfs::statat(p.unwrap(), "f", AtFlags::SYMLINK_NOFOLLOW).unwrap();
    });
    time("lookup (now)", &mut || {
        b.lookup("a/b/c/f").unwrap();
    });
    time("lookup through a symlink (now)", &mut || {
        b.lookup("l/c/f").unwrap();
    });
}

#[test]
fn sync_writes_opens_files_for_writing_with_o_dsync_and_reads_without() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"x").unwrap();
    let brick = Arc::new(Brick::open(dir.path()).unwrap());
    let mut config = super::PosixConfig::at(dir.path());
    config.sync_writes = true;
    let (plain, sync) = (
        Posix::new("plain", brick.clone()),
        Posix::configured("sync", brick, &config),
    );
    // (By the raw bit: rustix's flag set names O_DSYNC differently.)
    let dsync = |fd: &crate::Fd| {
        let f = super::file(fd).unwrap();
        rustix::fs::fcntl_getfl(&**f).unwrap().bits() & libc::O_DSYNC as u32 != 0
    };
    let open = |p: &Posix, flags: i32| run(p.open(&Ctx::NONE, "f", flags as u32)).unwrap();
    assert!(!dsync(&open(&plain, libc::O_RDWR)), "off by default");
    assert!(dsync(&open(&sync, libc::O_WRONLY)));
    assert!(dsync(&open(&sync, libc::O_RDWR)));
    assert!(!dsync(&open(&sync, libc::O_RDONLY)), "reads are not slowed");
    let (made, _) = run(sync.create(&Ctx::NONE, "g", libc::O_RDWR as u32, 0o644)).unwrap();
    assert!(dsync(&made), "a file made for writing too");
}
