//! A distribute volume over four real bricks: four servers in this process on Unix sockets,
//! a client stack built from a volfile, and checks against what lies on each brick's disk.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use kiln_client::Volume;
use kiln_layer::distribute::{name_hash, Layout, LAYOUT_XATTR};
use kiln_layer::exec::block_on;
use kiln_layer::volfile::Volfile;
use kiln_layer::{Ctx, Errno, Fd, IoBufs, LayerRef, ReadDst, ReadOut};
use kiln_server::Listen;

const BRICKS: usize = 4;
const ENOENT: Errno = libc::ENOENT as Errno;
const EEXIST: Errno = libc::EEXIST as Errno;
const ENOTEMPTY: Errno = libc::ENOTEMPTY as Errno;

/// Four bricks and a distribute stack over them.
struct Cluster {
    vol: Volume,
    bricks: Vec<PathBuf>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut bricks = Vec::new();
        let mut text = String::from(
            "[[layer]]\nname = \"dist\"\ntype = \"distribute\"\nsubvolumes = [\"b0\", \"b1\", \"b2\", \"b3\"]\n",
        );
        for i in 0..BRICKS {
            let brick = dir.path().join(format!("brick{i}"));
            std::fs::create_dir(&brick).expect("brick dir");
            let sock = dir.path().join(format!("b{i}.sock"));
            let bg =
                kiln_server::spawn_background(&brick, &[Listen::Unix(sock)]).expect("brick server");
            let addr = bg.unix_addr().expect("unix address");
            text.push_str(&format!(
                "\n[[layer]]\nname = \"b{i}\"\ntype = \"protocol-client\"\nremote = \"{addr}\"\n"
            ));
            bricks.push(brick);
        }
        let vf = Volfile::parse(&text).expect("volfile");
        let vol = Volume::from_volfile(&vf).expect("client stack");
        Cluster {
            vol,
            bricks,
            _dir: dir,
        }
    }

    fn top(&self) -> &LayerRef {
        self.vol.top()
    }

    /// The bricks on whose disk `path` exists.
    fn holders(&self, path: &str) -> Vec<usize> {
        (0..BRICKS)
            .filter(|&i| std::fs::symlink_metadata(self.bricks[i].join(path)).is_ok())
            .collect()
    }

    fn create(&self, path: &str) -> Fd {
        block_on(
            self.top()
                .create(&Ctx::NONE, path, libc::O_RDWR as u32, 0o644),
        )
        .unwrap_or_else(|e| panic!("create {path}: errno {e}"))
        .0
    }

    fn touch(&self, path: &str) {
        let fd = self.create(path);
        block_on(self.top().release(&Ctx::NONE, fd)).expect("release");
    }

    fn lookup(&self, path: &str) -> Result<kiln_layer::Attr, Errno> {
        block_on(self.top().lookup(&Ctx::NONE, path))
    }

    /// Every name of a directory, paging `max` entries at a time.
    fn list(&self, path: &str, max: u32) -> Vec<String> {
        let mut names = Vec::new();
        loop {
            let r = block_on(
                self.top()
                    .readdir(&Ctx::NONE, path, names.len() as u64, max),
            )
            .expect("readdir");
            assert!(r.entries.0.len() <= max as usize);
            let got = r.entries.0.len();
            names.extend(r.entries.0.into_iter().map(|e| e.name));
            if r.eof || got == 0 {
                return names;
            }
        }
    }
}

/// The raw layout xattr of a directory on disk, if any.
fn disk_layout(p: &Path) -> Option<Vec<u8>> {
    let path = CString::new(p.as_os_str().as_bytes()).ok()?;
    let name = CString::new(LAYOUT_XATTR).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid C strings and a buffer of the given length.
    let n = unsafe {
        libc::getxattr(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

/// The brick a name in a directory made by this stack hashes to.
fn hashed(name: &str) -> usize {
    Layout::equal(BRICKS).subvol(name_hash(name))
}

/// A name `prefix-N` that hashes to brick `want`.
fn name_on(prefix: &str, want: usize) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|n| hashed(n) == want)
        .expect("some name hashes there")
}

#[test]
fn ten_thousand_files_spread_over_every_brick() {
    let c = Cluster::start();
    let cx = Ctx::NONE;
    block_on(c.top().mkdir(&cx, "many", 0o755)).expect("mkdir");
    const N: usize = 10_000;
    // Four threads, each creating a quarter: the stack is shared.
    std::thread::scope(|s| {
        for t in 0..4 {
            let c = &c;
            s.spawn(move || {
                for i in (t..N).step_by(4) {
                    c.touch(&format!("many/f{i:05}"));
                }
            });
        }
    });
    let mut counts = Vec::new();
    for b in &c.bricks {
        counts.push(
            std::fs::read_dir(b.join("many"))
                .expect("brick dir")
                .count(),
        );
    }
    assert_eq!(counts.iter().sum::<usize>(), N, "counts {counts:?}");
    for (i, &n) in counts.iter().enumerate() {
        assert!(n > 0, "brick {i} holds nothing: {counts:?}");
        assert!(n * 100 <= N * 35, "brick {i} holds {n} of {N}: {counts:?}");
    }
    for i in 0..N {
        let p = format!("many/f{i:05}");
        let a = c
            .lookup(&p)
            .unwrap_or_else(|e| panic!("lookup {p}: errno {e}"));
        assert_eq!(a.mode & libc::S_IFMT, libc::S_IFREG);
        assert_eq!(c.holders(&p).len(), 1, "{p} on one brick only");
    }
    // Paged with a small odd page size: every name once.
    let mut names = c.list("many", 97);
    assert_eq!(names.len(), N);
    names.sort();
    names.dedup();
    assert_eq!(names.len(), N, "a name was listed twice");
    assert_eq!(names[0], "f00000");
    assert_eq!(names[N - 1], format!("f{:05}", N - 1));
    // A page asked for out of order (no cursor) still lands where a sequential pager would.
    let seq = c.list("many", 500);
    let r = block_on(c.top().readdir(&cx, "many", 4321, 10)).expect("readdir at offset");
    let got: Vec<String> = r.entries.0.into_iter().map(|e| e.name).collect();
    assert_eq!(got, seq[4321..4331].to_vec());
}

#[test]
fn directories_exist_everywhere_and_follow_the_volume_layout() {
    let c = Cluster::start();
    let cx = Ctx::NONE;
    for d in ["top", "top/mid", "top/mid/leaf", "top/other"] {
        block_on(c.top().mkdir(&cx, d, 0o750)).unwrap_or_else(|e| panic!("mkdir {d}: {e}"));
    }
    assert_eq!(
        block_on(c.top().mkdir(&cx, "top/mid", 0o750)).err(),
        Some(EEXIST)
    );
    for d in ["top", "top/mid", "top/mid/leaf", "top/other"] {
        for (i, b) in c.bricks.iter().enumerate() {
            let p = b.join(d);
            assert!(p.is_dir(), "{d} missing on brick {i}");
            // The layout is the volume's: no directory stores one.
            assert_eq!(
                disk_layout(&p),
                None,
                "{d} has a stored layout on brick {i}"
            );
        }
        let a = c.lookup(d).expect("lookup dir");
        assert_eq!(a.mode & libc::S_IFMT, libc::S_IFDIR);
    }
    // The layout xattr is the layer's own.
    let bad = block_on(c.top().setxattr(&cx, "top", LAYOUT_XATTR, b"x", 0));
    assert!(bad.is_err());
    // A user xattr on a directory lands on every copy.
    block_on(c.top().setxattr(&cx, "top/mid", "user.k", b"v", 0)).expect("setxattr dir");
    assert_eq!(
        block_on(c.top().getxattr(&cx, "top/mid", "user.k")).expect("getxattr"),
        b"v".to_vec()
    );
    // A listing shows files from every brick and each directory once.
    let mut files = Vec::new();
    for b in 0..BRICKS {
        let f = name_on(&format!("file{b}"), b);
        c.touch(&format!("top/{f}"));
        files.push(f);
    }
    for max in [1, 2, 3, 1000] {
        let mut names = c.list("top", max);
        names.sort();
        let mut want = files.clone();
        want.extend(["mid".to_owned(), "other".to_owned()]);
        want.sort();
        assert_eq!(names, want, "page size {max}");
    }
    // rmdir of a directory with files on some bricks fails and leaves it whole.
    assert_eq!(block_on(c.top().rmdir(&cx, "top")).err(), Some(ENOTEMPTY));
    for (i, b) in c.bricks.iter().enumerate() {
        assert!(b.join("top").is_dir(), "top lost on brick {i}");
    }
    // rmdir of an empty one removes it from every brick.
    block_on(c.top().rmdir(&cx, "top/mid/leaf")).expect("rmdir");
    assert!(c.holders("top/mid/leaf").is_empty());
    assert_eq!(c.lookup("top/mid/leaf").err(), Some(ENOENT));
    // And it can be made again.
    block_on(c.top().mkdir(&cx, "top/mid/leaf", 0o755)).expect("mkdir again");
    assert_eq!(c.holders("top/mid/leaf").len(), BRICKS);
    // Renaming a directory renames every copy.
    block_on(c.top().rename(&cx, "top/mid", "top/moved", 0)).expect("rename dir");
    assert!(c.holders("top/mid").is_empty());
    assert_eq!(c.holders("top/moved/leaf").len(), BRICKS);
    assert!(c.lookup("top/moved/leaf").is_ok());
}

#[test]
fn rename_within_and_across_bricks() {
    let c = Cluster::start();
    let cx = Ctx::NONE;
    block_on(c.top().mkdir(&cx, "d", 0o755)).expect("mkdir");
    // Same brick.
    let a = name_on("a", 1);
    let a2 = name_on("a-same", 1);
    c.touch(&format!("d/{a}"));
    assert_eq!(c.holders(&format!("d/{a}")), vec![1]);
    block_on(
        c.top()
            .rename(&cx, &format!("d/{a}"), &format!("d/{a2}"), 0),
    )
    .expect("rename");
    assert!(c.lookup(&format!("d/{a2}")).is_ok());
    assert_eq!(c.lookup(&format!("d/{a}")).err(), Some(ENOENT));
    assert_eq!(c.holders(&format!("d/{a2}")), vec![1]);
    // Across bricks: the file stays where it is, found under its new name.
    let b = name_on("b", 2);
    let b2 = name_on("b-other", 3);
    c.touch(&format!("d/{b}"));
    block_on(
        c.top()
            .rename(&cx, &format!("d/{b}"), &format!("d/{b2}"), 0),
    )
    .expect("rename");
    assert_eq!(c.lookup(&format!("d/{b}")).err(), Some(ENOENT));
    let attr = c.lookup(&format!("d/{b2}")).expect("lookup renamed");
    assert_eq!(attr.mode & libc::S_IFMT, libc::S_IFREG);
    assert_eq!(c.holders(&format!("d/{b2}")), vec![2]);
    // It can be opened, and create of the same name opens it rather than making a second one.
    let fd = block_on(c.top().open(&cx, &format!("d/{b2}"), libc::O_RDONLY as u32)).expect("open");
    block_on(c.top().release(&cx, fd)).expect("release");
    c.touch(&format!("d/{b2}"));
    assert_eq!(c.holders(&format!("d/{b2}")), vec![2]);
    let excl = block_on(c.top().create(
        &cx,
        &format!("d/{b2}"),
        (libc::O_RDWR | libc::O_EXCL) as u32,
        0o644,
    ));
    assert_eq!(excl.err(), Some(EEXIST));
    // Renaming onto a name held by another brick replaces it.
    let victim = name_on("victim", 0);
    c.touch(&format!("d/{victim}"));
    block_on(
        c.top()
            .rename(&cx, &format!("d/{b2}"), &format!("d/{victim}"), 0),
    )
    .expect("rename over");
    assert_eq!(c.holders(&format!("d/{victim}")), vec![2]);
    assert_eq!(c.lookup(&format!("d/{b2}")).err(), Some(ENOENT));
    let mut names = c.list("d", 2);
    names.sort();
    let mut want = vec![a2.clone(), victim.clone()];
    want.sort();
    assert_eq!(names, want);
    // Unlink finds it too.
    block_on(c.top().unlink(&cx, &format!("d/{victim}"))).expect("unlink");
    assert!(c.holders(&format!("d/{victim}")).is_empty());
}

#[test]
fn lookup_falls_back_for_files_placed_elsewhere() {
    let c = Cluster::start();
    // A file put on a brick its name does not hash to (as an older layout would have).
    let name = name_on("stray", 0);
    std::fs::write(c.bricks[3].join(&name), b"old layout").expect("write on brick");
    let a = c.lookup(&name).expect("fallback lookup");
    assert_eq!(a.size, 10);
    let fd = block_on(c.top().open(&Ctx::NONE, &name, libc::O_RDONLY as u32)).expect("open");
    let out = block_on(c.top().read(&Ctx::NONE, &fd, 0, ReadDst::Any(64))).expect("read");
    assert_eq!(read_bytes(out), b"old layout".to_vec());
    block_on(c.top().release(&Ctx::NONE, fd)).expect("release");
    assert_eq!(c.lookup("no-such-file").err(), Some(ENOENT));
}

#[test]
fn statfs_sums_the_bricks() {
    let c = Cluster::start();
    let s = block_on(c.top().statfs(&Ctx::NONE, "")).expect("statfs");
    let (mut blocks, mut files) = (0u64, 0u64);
    for b in &c.bricks {
        let path = CString::new(b.as_os_str().as_bytes()).unwrap();
        // SAFETY: statvfs is plain old data; all-zero is a valid value.
        let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a valid C string and a statvfs to fill, both alive for the call.
        let rc = unsafe { libc::statvfs(path.as_ptr(), &mut v) };
        assert_eq!(rc, 0);
        assert_eq!(v.f_frsize, s.frsize);
        blocks += v.f_blocks;
        files += v.f_files;
    }
    assert_eq!(s.blocks, blocks);
    assert_eq!(s.files, files);
    assert!(s.bfree <= s.blocks && s.bavail <= s.blocks);
}

#[test]
fn syncdir_reaches_every_brick() {
    let c = Cluster::start();
    let cx = Ctx::NONE;
    block_on(c.top().mkdir(&cx, "d", 0o755)).expect("mkdir");
    block_on(c.top().syncdir(&cx, "d")).expect("syncdir of a directory");
    block_on(c.top().syncdir(&cx, "")).expect("syncdir of the root");
    assert_eq!(
        block_on(c.top().syncdir(&cx, "nowhere")).err(),
        Some(ENOENT)
    );
    let (fd, _) = block_on(c.top().create(&cx, "d/f", libc::O_RDWR as u32, 0o644)).expect("create");
    block_on(c.top().release(&cx, fd)).expect("release");
    assert_eq!(
        block_on(c.top().syncdir(&cx, "d/f")).err(),
        Some(libc::ENOTDIR as Errno)
    );
    // The directory missing on the last brick (as on a brick added since): nothing there to
    // sync, and the others did.
    let last = c.bricks[BRICKS - 1].join("d");
    std::fs::remove_dir_all(&last).expect("rmdir on the last brick");
    block_on(c.top().syncdir(&cx, "d")).expect("syncdir where one brick lacks the directory");
    // A file in its place there: a syncdir that skipped that brick would still succeed.
    std::fs::write(&last, b"not a directory").expect("a file on the last brick");
    assert_eq!(
        block_on(c.top().syncdir(&cx, "d")).err(),
        Some(libc::ENOTDIR as Errno)
    );
}

fn read_bytes(out: ReadOut) -> Vec<u8> {
    match out {
        ReadOut::Into { n, bufs } => {
            let mut v: Vec<u8> = bufs.into_owned::<Vec<u8>>().expect("our buffers").concat();
            v.truncate(n);
            v
        }
        ReadOut::Buf(b) => b,
        ReadOut::File { .. } => panic!("a client read never hands out a file"),
    }
}

#[test]
fn data_written_reads_back() {
    let c = Cluster::start();
    let cx = Ctx::NONE;
    block_on(c.top().mkdir(&cx, "img", 0o755)).expect("mkdir");
    for b in 0..BRICKS {
        let path = format!("img/{}", name_on("disk", b));
        let fd = c.create(&path);
        let data: Vec<u8> = (0..(1usize << 20) + 123)
            .map(|i| (i * 31 + b * 7 + i / 4096) as u8)
            .collect();
        let chunks: Vec<Vec<u8>> = data.chunks(65_536).map(<[u8]>::to_vec).collect();
        let w = block_on(c.top().write(&cx, &fd, 4096, IoBufs::owned(chunks))).expect("write");
        assert_eq!(w.n, data.len());
        block_on(c.top().fsync(&cx, &fd, false)).expect("fsync");
        let st = block_on(c.top().fstat(&cx, &fd)).expect("fstat");
        assert_eq!(st.size, 4096 + data.len() as u64);
        let bufs: Vec<Vec<u8>> = (0..data.len().div_ceil(4096))
            .map(|_| vec![0u8; 4096])
            .collect();
        let out = block_on(
            c.top()
                .read(&cx, &fd, 4096, ReadDst::Into(IoBufs::owned(bufs))),
        )
        .expect("read");
        let back = read_bytes(out);
        assert!(back == data, "data on brick {b} differs");
        block_on(c.top().release(&cx, fd)).expect("release");
        assert_eq!(c.holders(&path), vec![b]);
        // Reopened by path, through the same stack.
        let fd = block_on(c.top().open(&cx, &path, libc::O_RDONLY as u32)).expect("open");
        let out = block_on(c.top().read(&cx, &fd, 4096 + 1000, ReadDst::Any(5000))).expect("read");
        assert!(read_bytes(out) == data[1000..6000]);
        block_on(c.top().release(&cx, fd)).expect("release");
    }
}
