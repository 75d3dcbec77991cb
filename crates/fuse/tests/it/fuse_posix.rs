//! POSIX behaviour people rely on, through a real mount, in both modes.

use crate::common;

use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};

use common::{exists, Mounted};
use kiln_fuse::Mode;

fn errno(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

fn posix(mode: Mode) {
    let m = Mounted::new(mode);
    let p = |s: &str| m.path(s);

    // O_CREAT|O_EXCL, O_TRUNC, O_APPEND.
    fs::write(p("f"), b"0123456789").expect("write");
    let e = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(p("f"))
        .expect_err("O_EXCL on an existing file");
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    let mut a = OpenOptions::new()
        .append(true)
        .open(p("f"))
        .expect("O_APPEND");
    a.write_all(b"AB").expect("append");
    drop(a);
    assert_eq!(fs::read(p("f")).expect("read"), b"0123456789AB");
    OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(p("f"))
        .expect("O_TRUNC");
    assert_eq!(fs::metadata(p("f")).expect("stat").len(), 0);

    // Read/write at offsets, truncate up and down, fallocate.
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(p("f"))
        .expect("open rw");
    f.seek(SeekFrom::Start(5000)).expect("seek");
    f.write_all(b"tail").expect("write at offset");
    f.sync_all().expect("fsync");
    let mut all = Vec::new();
    f.seek(SeekFrom::Start(0)).expect("seek");
    f.read_to_end(&mut all).expect("read");
    assert_eq!(all.len(), 5004);
    assert!(all[..5000].iter().all(|&b| b == 0) && &all[5000..] == b"tail");
    f.set_len(10).expect("truncate down");
    assert_eq!(fs::metadata(p("f")).expect("stat").len(), 10);
    f.set_len(1 << 20).expect("truncate up");
    assert_eq!(fs::metadata(p("f")).expect("stat").len(), 1 << 20);
    // SAFETY: plain fallocate on an open descriptor.
    let r = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 2 << 20) };
    assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
    assert_eq!(fs::metadata(p("f")).expect("stat").len(), 2 << 20);
    drop(f);

    // Directories: mkdir, nested, rmdir of a non-empty one fails, a large listing.
    fs::create_dir_all(p("d1/d2")).expect("mkdir -p");
    assert_eq!(
        errno(fs::remove_dir(p("d1")).expect_err("rmdir non-empty")),
        libc::ENOTEMPTY
    );
    for i in 0..600 {
        fs::write(p(&format!("d1/file{i:04}")), i.to_string()).expect("create many");
    }
    let mut names: Vec<String> = fs::read_dir(p("d1"))
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 601, "600 files and d2");
    assert_eq!(names[0], "d2");
    assert_eq!(fs::read_to_string(p("d1/file0599")).expect("read"), "599");

    // Rename over an existing file, and across directories (with open files kept working).
    fs::write(p("old"), b"new content").expect("write");
    fs::write(p("target"), b"to be replaced").expect("write");
    fs::rename(p("old"), p("target")).expect("rename over existing");
    assert_eq!(fs::read(p("target")).expect("read"), b"new content");
    assert!(!exists(&p("old")));
    fs::rename(p("target"), p("d1/d2/moved")).expect("rename across dirs");
    fs::rename(p("d1"), p("dz")).expect("rename a directory");
    assert_eq!(
        fs::read(p("dz/d2/moved")).expect("read through the renamed dir"),
        b"new content"
    );

    // Unlink of an open file: it stays readable until closed.
    fs::write(p("ghost"), b"still here").expect("write");
    let mut g = fs::File::open(p("ghost")).expect("open");
    fs::remove_file(p("ghost")).expect("unlink");
    assert!(!exists(&p("ghost")));
    let mut s = String::new();
    g.read_to_string(&mut s).expect("read after unlink");
    assert_eq!(s, "still here");
    drop(g);

    // Hard links share an inode; removing one name leaves the other.
    fs::write(p("h1"), b"linked").expect("write");
    fs::hard_link(p("h1"), p("h2")).expect("link");
    let (a, b) = (
        fs::metadata(p("h1")).expect("stat"),
        fs::metadata(p("h2")).expect("stat"),
    );
    assert_eq!(a.ino(), b.ino());
    assert_eq!(b.nlink(), 2);
    fs::remove_file(p("h1")).expect("unlink one name");
    assert_eq!(fs::read(p("h2")).expect("other name"), b"linked");
    assert_eq!(fs::metadata(p("h2")).expect("stat").nlink(), 1);

    // Symlinks.
    std::os::unix::fs::symlink("dz/d2/moved", p("sl")).expect("symlink");
    assert_eq!(
        fs::read_link(p("sl")).expect("readlink").to_str(),
        Some("dz/d2/moved")
    );
    assert_eq!(fs::read(p("sl")).expect("follow"), b"new content");
    assert!(fs::symlink_metadata(p("sl"))
        .expect("lstat")
        .file_type()
        .is_symlink());

    // chmod, chown, utimens.
    fs::set_permissions(p("h2"), fs::Permissions::from_mode(0o640)).expect("chmod");
    assert_eq!(fs::metadata(p("h2")).expect("stat").mode() & 0o7777, 0o640);
    std::os::unix::fs::chown(p("h2"), Some(1234), Some(5678)).expect("chown");
    let md = fs::metadata(p("h2")).expect("stat");
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    fs::File::options()
        .write(true)
        .open(p("h2"))
        .expect("open")
        .set_modified(t)
        .expect("utimens");
    assert_eq!(fs::metadata(p("h2")).expect("stat").mtime(), 1_000_000_000);

    // xattrs through the mount (user namespace).
    let path = std::ffi::CString::new(p("h2").into_os_string().into_encoded_bytes()).expect("cstr");
    // SAFETY: valid C strings and buffers for the xattr calls.
    unsafe {
        assert_eq!(
            libc::setxattr(
                path.as_ptr(),
                c"user.kiln".as_ptr(),
                b"v1".as_ptr().cast(),
                2,
                0
            ),
            0,
            "setxattr: {}",
            std::io::Error::last_os_error()
        );
        let mut buf = [0u8; 16];
        assert_eq!(
            libc::getxattr(
                path.as_ptr(),
                c"user.kiln".as_ptr(),
                buf.as_mut_ptr().cast(),
                16
            ),
            2
        );
        assert_eq!(&buf[..2], b"v1");
        assert_eq!(
            libc::getxattr(
                path.as_ptr(),
                c"user.kiln".as_ptr(),
                std::ptr::null_mut(),
                0
            ),
            2,
            "size query"
        );
        let n = libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), 16);
        assert!(n >= 10 && buf[..n as usize].windows(9).any(|w| w == b"user.kiln"));
        assert_eq!(libc::removexattr(path.as_ptr(), c"user.kiln".as_ptr()), 0);
        assert_eq!(
            libc::getxattr(
                path.as_ptr(),
                c"user.kiln".as_ptr(),
                buf.as_mut_ptr().cast(),
                16
            ),
            -1
        );
        assert_eq!(*libc::__errno_location(), libc::ENODATA);
    }

    // statfs reports the brick's file system.
    // SAFETY: zeroed statvfs filled by the call.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    let mp = std::ffi::CString::new(m.mnt().into_os_string().into_encoded_bytes()).expect("cstr");
    // SAFETY: valid path and out-pointer.
    assert_eq!(unsafe { libc::statvfs(mp.as_ptr(), &mut sv) }, 0);
    assert!(sv.f_blocks > 0 && sv.f_bsize > 0);

    // The errno values the kernel expects.
    assert_eq!(
        errno(fs::read(p("nope")).expect_err("missing")),
        libc::ENOENT
    );
    assert_eq!(
        errno(fs::create_dir(p("dz")).expect_err("exists")),
        libc::EEXIST
    );
    assert_eq!(
        errno(fs::remove_dir(p("h2")).expect_err("rmdir a file")),
        libc::ENOTDIR
    );
    assert_eq!(
        errno(fs::read_dir(p("h2")).map(|_| ()).expect_err("list a file")),
        libc::ENOTDIR
    );
    let e = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(p("dz"))
        .expect_err("write a dir");
    assert!(matches!(errno(e), libc::EISDIR | libc::EINVAL));

    // And the brick holds what the mount shows.
    assert_eq!(
        fs::read(m.brick().join("dz/d2/moved")).expect("brick"),
        b"new content"
    );
}

#[test]
fn posix_in_general_mode() {
    posix(Mode::General);
}

#[test]
fn posix_in_vm_image_mode() {
    posix(Mode::VmImage);
}

/// A listing in progress is stable while the directory changes: every name that existed when
/// it started and was not removed appears exactly once, and nothing appears twice.
#[test]
fn readdir_is_stable_across_concurrent_changes() {
    for mode in [Mode::General, Mode::VmImage] {
        let m = Mounted::new(mode);
        let d = m.path("big");
        fs::create_dir(&d).expect("mkdir");
        let names: Vec<String> = (0..2000)
            .map(|i| format!("entry-with-a-longish-name-{i:05}"))
            .collect();
        for n in &names {
            fs::write(d.join(n), b"").expect("create");
        }
        let mut it = fs::read_dir(&d).expect("opendir");
        let mut seen: Vec<String> = Vec::new();
        for _ in 0..300 {
            seen.push(
                it.next()
                    .expect("entry")
                    .expect("entry")
                    .file_name()
                    .into_string()
                    .expect("utf8"),
            );
        }
        // Change the directory under the open listing: add new names, remove some old ones.
        let mut removed = std::collections::HashSet::new();
        for (k, n) in names.iter().enumerate().filter(|(k, _)| k % 7 == 0) {
            if !seen.contains(n) {
                fs::remove_file(d.join(n)).expect("unlink");
                removed.insert(n.clone());
            }
            fs::write(d.join(format!("new-{k}")), b"").expect("create new");
        }
        for e in it {
            seen.push(e.expect("entry").file_name().into_string().expect("utf8"));
        }
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            seen.len(),
            "{mode:?}: a name appeared twice in one listing"
        );
        for n in names.iter().filter(|n| !removed.contains(*n)) {
            assert!(
                seen.contains(n),
                "{mode:?}: {n} existed throughout but was not listed"
            );
        }
        // A new listing sees the changes.
        let fresh = fs::read_dir(&d).expect("opendir").count();
        assert_eq!(
            fresh,
            2000 - removed.len() + names.len().div_ceil(7),
            "{mode:?}: a new listing sees the changes"
        );
    }
}

/// FIFOs, sockets and device nodes: made on the brick with their type, mode and device,
/// listed, stat'ed, renamed, used (a FIFO carries bytes, a socket accepts), and removed.
fn special_files(mode: Mode) {
    use std::ffi::CString;
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::net::{UnixListener, UnixStream};

    let m = Mounted::new(mode);
    let p = |s: &str| m.path(s);
    let c = |s: &str| CString::new(m.path(s).into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: plain system calls on NUL-terminated paths.
    unsafe {
        assert_eq!(libc::mkfifo(c("fifo").as_ptr(), 0o640), 0, "mkfifo");
        let chr = libc::S_IFCHR | 0o600;
        assert_eq!(
            libc::mknod(c("null").as_ptr(), chr, libc::makedev(1, 3)),
            0,
            "mknod c"
        );
        let blk = libc::S_IFBLK | 0o600;
        assert_eq!(
            libc::mknod(c("blk").as_ptr(), blk, libc::makedev(7, 0)),
            0,
            "mknod b"
        );
    }
    let listener = UnixListener::bind(p("sock")).expect("bind a socket in the mount");

    let t = |s: &str| fs::symlink_metadata(m.brick().join(s)).expect("on the brick");
    assert!(t("fifo").file_type().is_fifo());
    assert_eq!(t("fifo").mode() & 0o7777, 0o640);
    assert!(t("null").file_type().is_char_device());
    assert_eq!(t("null").rdev(), libc::makedev(1, 3));
    assert!(t("blk").file_type().is_block_device());
    assert!(t("sock").file_type().is_socket());
    let st = fs::symlink_metadata(p("null")).expect("stat through the mount");
    assert!(st.file_type().is_char_device());
    assert_eq!(st.rdev(), libc::makedev(1, 3));
    let mut names: Vec<String> = fs::read_dir(m.mnt())
        .expect("readdir")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["blk", "fifo", "null", "sock"]);

    // The mount is `nodev`: a device node is stored, listed and copied, but a client does not
    // open it as a device (a node made by root on one host is no key to another host's
    // devices).
    let e = fs::read(p("null")).expect_err("nodev");
    assert_eq!(errno(e), libc::EACCES);
    // The FIFO carries bytes between two local openers.
    let writer = std::thread::spawn({
        let f = p("fifo");
        move || fs::write(f, b"through the fifo").expect("write the fifo")
    });
    assert_eq!(
        fs::read(p("fifo")).expect("read the fifo"),
        b"through the fifo"
    );
    writer.join().unwrap();
    // The socket accepts a local connection.
    let _client = UnixStream::connect(p("sock")).expect("connect");
    listener.accept().expect("accept");

    fs::rename(p("fifo"), p("fifo2")).expect("rename a fifo");
    assert!(t("fifo2").file_type().is_fifo());
    fs::set_permissions(p("fifo2"), PermissionsExt::from_mode(0o600)).expect("chmod a fifo");
    assert_eq!(t("fifo2").mode() & 0o7777, 0o600);
    for n in ["fifo2", "null", "blk", "sock"] {
        fs::remove_file(p(n)).unwrap_or_else(|e| panic!("unlink {n}: {e}"));
    }
    assert_eq!(fs::read_dir(m.mnt()).expect("readdir").count(), 0);
    // mknod of a directory type is refused as mknod(2) refuses it.
    // SAFETY: as above.
    let r = unsafe { libc::mknod(c("d").as_ptr(), libc::S_IFDIR | 0o755, 0) };
    assert_eq!(r, -1, "mknod S_IFDIR");
}

#[test]
fn special_files_in_general_mode() {
    special_files(Mode::General);
}

#[test]
fn special_files_in_vm_image_mode() {
    special_files(Mode::VmImage);
}

/// Long names and deep trees: a 255-byte name works and a 256-byte one is ENAMETOOLONG; a
/// 4,095-byte path (the longest one system call takes) works from the mount's root and from
/// a directory deep inside it, where the volume path is longer than any one system call's.
fn long_paths(mode: Mode) {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    let m = Mounted::new(mode);
    let cs = |s: &str| CString::new(s).unwrap();
    let open_dir = |at: i32, p: &str| -> OwnedFd {
        // SAFETY: plain openat on a NUL-terminated path; the result is owned once valid.
        let fd = unsafe { libc::openat(at, cs(p).as_ptr(), libc::O_PATH | libc::O_DIRECTORY) };
        assert!(
            fd >= 0,
            "open {} bytes: {}",
            p.len(),
            std::io::Error::last_os_error()
        );
        // SAFETY: a fresh descriptor nobody else owns.
        unsafe { OwnedFd::from_raw_fd(fd) }
    };
    let mkdirat = |at: i32, p: &str| -> i32 {
        // SAFETY: as above.
        if unsafe { libc::mkdirat(at, cs(p).as_ptr(), 0o755) } == 0 {
            0
        } else {
            errno(std::io::Error::last_os_error())
        }
    };
    let root = open_dir(libc::AT_FDCWD, m.mnt().to_str().unwrap());
    assert_eq!(
        mkdirat(root.as_raw_fd(), &"n".repeat(255)),
        0,
        "255-byte name"
    );
    assert_eq!(
        mkdirat(root.as_raw_fd(), &"n".repeat(256)),
        libc::ENAMETOOLONG
    );

    // 16 levels of 254-byte names (4,079 bytes with slashes), then a name that brings the
    // path to 4,095 bytes.
    let level = "d".repeat(254);
    let mut rel = String::new();
    for _ in 0..16 {
        rel = if rel.is_empty() {
            level.clone()
        } else {
            format!("{rel}/{level}")
        };
        assert_eq!(
            mkdirat(root.as_raw_fd(), &rel),
            0,
            "mkdir at {} bytes",
            rel.len()
        );
    }
    let last = "e".repeat(4095 - rel.len() - 1);
    let full = format!("{rel}/{last}");
    assert_eq!(full.len(), 4095);
    assert_eq!(mkdirat(root.as_raw_fd(), &full), 0, "a 4,095-byte path");
    // From deep inside, the same 4,095-byte relative path again: its volume path is 8,191
    // bytes.
    let deep = open_dir(root.as_raw_fd(), &full);
    let mut sub = String::new();
    for _ in 0..16 {
        sub = if sub.is_empty() {
            level.clone()
        } else {
            format!("{sub}/{level}")
        };
        assert_eq!(
            mkdirat(deep.as_raw_fd(), &sub),
            0,
            "deep, {} bytes",
            sub.len()
        );
    }
    assert_eq!(
        mkdirat(deep.as_raw_fd(), &full),
        0,
        "an 8,191-byte volume path"
    );
    let bottom = open_dir(deep.as_raw_fd(), &full);
    // SAFETY: openat/write/close on descriptors this test owns.
    unsafe {
        let fd = libc::openat(
            bottom.as_raw_fd(),
            cs("f").as_ptr(),
            libc::O_CREAT | libc::O_RDWR,
            0o644,
        );
        assert!(
            fd >= 0,
            "create at the bottom: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::write(fd, b"deep".as_ptr().cast(), 4), 4);
        libc::close(fd);
    }
    // The brick holds it at the same place.
    let brick = open_dir(libc::AT_FDCWD, m.brick().to_str().unwrap());
    let b1 = open_dir(brick.as_raw_fd(), &full);
    let b2 = open_dir(b1.as_raw_fd(), &full);
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat into a stat this test owns.
    let r = unsafe { libc::fstatat(b2.as_raw_fd(), cs("f").as_ptr(), &mut st, 0) };
    assert_eq!((r, st.st_size), (0, 4), "the file on the brick");
}

#[test]
fn long_paths_in_general_mode() {
    long_paths(Mode::General);
}

#[test]
fn long_paths_in_vm_image_mode() {
    long_paths(Mode::VmImage);
}

/// Symlinks are changed themselves (lchown, utimensat with AT_SYMLINK_NOFOLLOW), dangling or
/// not, and their targets never; an open file answers fstat after its name is gone; a rename
/// over one name of a hard-linked file leaves the other name with one link.
fn links(mode: Mode) {
    use std::ffi::CString;

    let m = Mounted::new(mode);
    let c = |s: &str| CString::new(m.path(s).into_os_string().into_encoded_bytes()).unwrap();
    let b = |s: &str| fs::symlink_metadata(m.brick().join(s)).expect("on the brick");
    fs::write(m.path("target"), b"t").expect("target");
    std::os::unix::fs::symlink("target", m.path("l")).expect("symlink");
    std::os::unix::fs::symlink("nowhere", m.path("dl")).expect("dangling symlink");
    let times = [
        libc::timespec {
            tv_sec: 1_000_000,
            tv_nsec: 0,
        },
        libc::timespec {
            tv_sec: 2_000_000,
            tv_nsec: 0,
        },
    ];
    for l in ["l", "dl"] {
        // SAFETY: plain system calls on NUL-terminated paths and a two-element array.
        unsafe {
            assert_eq!(libc::lchown(c(l).as_ptr(), 1000, 1001), 0, "lchown {l}");
            let r = libc::utimensat(
                libc::AT_FDCWD,
                c(l).as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            );
            assert_eq!(
                r,
                0,
                "utimensat NOFOLLOW {l}: {}",
                std::io::Error::last_os_error()
            );
        }
        assert_eq!(
            (b(l).uid(), b(l).gid(), b(l).mtime()),
            (1000, 1001, 2_000_000),
            "{l}"
        );
        let st = fs::symlink_metadata(m.path(l)).expect("lstat");
        assert_eq!(
            (st.uid(), st.mtime()),
            (1000, 2_000_000),
            "{l} through the mount"
        );
    }
    assert_eq!(
        (b("target").uid(), b("target").gid()),
        (0, 0),
        "the target is untouched"
    );
    assert_ne!(b("target").mtime(), 2_000_000);

    // fstat of an open file whose name is gone.
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("gone"))
        .expect("create");
    f.write_all(b"12345").expect("write");
    fs::remove_file(m.path("gone")).expect("unlink");
    assert_eq!(f.metadata().expect("fstat after unlink").len(), 5);
    f.set_len(2).expect("ftruncate after unlink");
    assert_eq!(f.metadata().expect("fstat").len(), 2);
    drop(f);

    // Rename over a hard link.
    fs::write(m.path("a"), b"a").expect("a");
    fs::write(m.path("b"), b"b").expect("b");
    fs::hard_link(m.path("b"), m.path("c")).expect("link");
    assert_eq!(fs::symlink_metadata(m.path("c")).expect("lstat").nlink(), 2);
    fs::rename(m.path("a"), m.path("b")).expect("rename over a link");
    assert_eq!(fs::symlink_metadata(m.path("c")).expect("lstat").nlink(), 1);
    assert_eq!(fs::symlink_metadata(m.path("b")).expect("lstat").nlink(), 1);
    assert_eq!(fs::read(m.path("b")).expect("read"), b"a");
    assert_eq!(fs::read(m.path("c")).expect("read"), b"b");
}

#[test]
fn links_in_general_mode() {
    links(Mode::General);
}

#[test]
fn links_in_vm_image_mode() {
    links(Mode::VmImage);
}

/// fsync(2) of a directory through the mount reaches the brick as SYNCDIR (the kernel would
/// otherwise answer it itself, and the names made in it could be lost with the brick's host).
#[test]
fn fsync_of_a_directory_reaches_the_brick() {
    let m = Mounted::new(Mode::General);
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/f"), b"x").unwrap();
    let before = m.stats.calls(kiln_proto::Op::Syncdir);
    fs::File::open(m.path("d")).unwrap().sync_all().unwrap();
    assert_eq!(m.stats.calls(kiln_proto::Op::Syncdir), before + 1);
    fs::File::open(m.path("")).unwrap().sync_all().unwrap();
    assert_eq!(m.stats.calls(kiln_proto::Op::Syncdir), before + 2);
}
