//! The harness of `server_confinement_race`: a kilnd with its log in a file, an outside
//! directory full of secrets, and snapshots of it to compare.
#![allow(dead_code)]

use kiln_client::{block_on, Client};
use kiln_proto::ops::Attr;
use std::collections::{BTreeMap, HashSet};
use std::io;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// What every outside file holds; no reply may ever carry it.
pub const SECRET: &[u8] = b"KILN-OUTSIDE-SECRET-5e1f0c";
/// What the inside file the races read holds.
pub const INSIDE: &[u8] = b"inside-the-brick";
/// An xattr only the outside files carry.
pub const OUTSIDE_XATTR: &str = "user.kiln-outside";
/// Errors that mean "the server refused to leave the brick".
pub const REFUSED: [i32; 3] = [libc::EACCES, libc::EXDEV, libc::ELOOP];

/// A kilnd on a temporary brick, with the directories around it.
pub struct Kilnd {
    pub child: Child,
    /// `tcp:127.0.0.1:PORT`.
    pub addr: String,
    pub brick: PathBuf,
    /// Sibling of the brick, filled by [`populate_outside`]: the target of every escape.
    pub outside: PathBuf,
    /// kilnd's working directory (what `/proc/self/cwd` names), holding a canary file.
    pub cwd: PathBuf,
    /// kilnd's stderr.
    pub log: PathBuf,
    pub _tmp: tempfile::TempDir,
}

impl Kilnd {
    /// Prepares brick, outside and cwd, lets `plant` put things in the brick (as a local user
    /// would, before kilnd starts), then starts kilnd: with the default stack, or with
    /// `replica` the stack of a replicated volume's brick (marks layer included).
    pub fn start(replica: bool, plant: impl FnOnce(&Path, &Path)) -> Kilnd {
        let tmp = tempfile::tempdir().expect("tempdir");
        let brick = tmp.path().join("brick");
        let outside = tmp.path().join("outside");
        let cwd = tmp.path().join("cwd");
        let log = tmp.path().join("kilnd.log");
        for d in [&brick, &outside, &cwd] {
            std::fs::create_dir(d).expect("mkdir");
        }
        populate_outside(&outside);
        std::fs::write(cwd.join("canary"), SECRET).expect("canary");
        plant(&brick, &outside);

        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kilnd"));
        if replica {
            let vf = tmp.path().join("brick.toml");
            let v = kiln_server::replica_volfile(&brick, "brick");
            std::fs::write(&vf, v.to_toml()).expect("volfile");
            cmd.arg("--volfile").arg(vf);
        } else {
            cmd.arg("--brick").arg(&brick);
        }
        let (child, addr) = kiln_testkit::daemon::spawn_listening(
            cmd.args(["--listen", "tcp:127.0.0.1:0", "--metrics", "off"])
                .current_dir(&cwd)
                .stdin(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("log file")),
        );
        Kilnd {
            child,
            addr,
            brick,
            outside,
            cwd,
            log,
            _tmp: tmp,
        }
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.addr).expect("connect")
    }

    /// What must not change: the outside directory and kilnd's cwd.
    pub fn watched(&self) -> Snap {
        snapshot(&[&self.outside, &self.cwd])
    }

    /// Lines of kilnd's log that report a refused escape.
    pub fn refusals_logged(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("refused a path that resolves outside the brick"))
            .count()
    }

    /// Checks kilnd is alive and still serves a well-behaved create/write/read/readdir.
    pub fn assert_serves(&mut self, name: &str) {
        assert!(
            matches!(self.child.try_wait(), Ok(None)),
            "kilnd died; its log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
        let c = self.client();
        let data = format!("well-behaved {name}").into_bytes();
        let (fh, a) = block_on(c.create(name, libc::O_RDWR | libc::O_TRUNC, 0o644))
            .expect("create after the attacks");
        assert_eq!(a.mode & libc::S_IFMT, libc::S_IFREG);
        block_on(c.pwritev(fh, vec![data.clone()], 0))
            .0
            .expect("write after the attacks");
        let (n, bufs) = block_on(c.preadv(fh, vec![vec![0u8; 256]], 0));
        let n = n.expect("read after the attacks");
        assert_eq!(&bufs[0][..n], &data[..]);
        block_on(c.close(fh)).expect("close");
        assert_eq!(std::fs::read(self.brick.join(name)).expect("on disk"), data);
        let names: Vec<String> = block_on(c.readdir(""))
            .expect("readdir after the attacks")
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert!(
            names.iter().any(|n| n == name),
            "{name} not listed: {names:?}"
        );
    }
}

impl Drop for Kilnd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Outside files under the names the tests aim at, each holding [`SECRET`] and
/// [`OUTSIDE_XATTR`].
pub fn populate_outside(o: &Path) {
    std::fs::create_dir(o.join("sub")).expect("outside/sub");
    for f in ["secret", "f", "only-outside", "sub/f"] {
        let p = o.join(f);
        std::fs::write(&p, SECRET).expect("outside file");
        rustix::fs::setxattr(&p, OUTSIDE_XATTR, SECRET, rustix::fs::XattrFlags::empty())
            .expect("outside xattr");
    }
    symlink("OUTSIDE-LINK", o.join("lnk")).expect("outside link");
}

/// Everything about one file that a write, link, chmod, xattr or rename would change.
#[derive(PartialEq, Eq)]
pub struct Meta {
    pub mode: u32,
    pub ino: u64,
    pub nlink: u64,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
    /// File contents (up to 1 MiB; larger files are compared by the fields above) or a
    /// symlink's target.
    pub data: Vec<u8>,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Meta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mode {:o} ino {} nlink {} owner {}:{} size {} mtime {:?} ctime {:?} data \"{}\"",
            self.mode,
            self.ino,
            self.nlink,
            self.uid,
            self.gid,
            self.size,
            self.mtime,
            self.ctime,
            self.data.escape_ascii()
        )?;
        for (n, v) in &self.xattrs {
            write!(f, " {}=\"{}\"", n.escape_ascii(), v.escape_ascii())?;
        }
        Ok(())
    }
}

pub type Snap = BTreeMap<PathBuf, Meta>;

pub fn meta(p: &Path) -> Meta {
    let m = std::fs::symlink_metadata(p).expect("lstat");
    let ft = m.file_type();
    let data = if ft.is_file() && m.len() <= 1 << 20 {
        std::fs::read(p).expect("read")
    } else if ft.is_symlink() {
        std::fs::read_link(p)
            .expect("readlink")
            .into_os_string()
            .into_encoded_bytes()
    } else {
        Vec::new()
    };
    let mut names = vec![0u8; 64 * 1024];
    let n = rustix::fs::llistxattr(p, &mut names[..]).unwrap_or(0);
    let mut xattrs = Vec::new();
    for name in names[..n].split(|b| *b == 0).filter(|s| !s.is_empty()) {
        let mut v = vec![0u8; 64 * 1024];
        if let Ok(k) = rustix::fs::lgetxattr(p, name, &mut v[..]) {
            v.truncate(k);
            xattrs.push((name.to_vec(), v));
        }
    }
    xattrs.sort();
    Meta {
        mode: m.mode(),
        ino: m.ino(),
        nlink: m.nlink(),
        uid: m.uid(),
        gid: m.gid(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
        data,
        xattrs,
    }
}

/// Every entry below (and including) each root, symlinks not followed.
pub fn snapshot(roots: &[&Path]) -> Snap {
    let mut out = Snap::new();
    let mut stack: Vec<PathBuf> = roots.iter().map(|r| r.to_path_buf()).collect();
    while let Some(p) = stack.pop() {
        let m = meta(&p);
        if m.mode & libc::S_IFMT == libc::S_IFDIR {
            for e in std::fs::read_dir(&p).expect("read_dir") {
                stack.push(e.expect("entry").path());
            }
        }
        out.insert(p, m);
    }
    out
}

pub fn inos(s: &Snap) -> HashSet<u64> {
    s.values().map(|m| m.ino).collect()
}

/// What differs between two snapshots, one line per entry.
pub fn diff(before: &Snap, after: &Snap) -> Vec<String> {
    let mut diffs = Vec::new();
    for (p, m) in before {
        match after.get(p) {
            None => diffs.push(format!("{} vanished", p.display())),
            Some(a) if a != m => diffs.push(format!("{} changed:\n  {m:?}\n  {a:?}", p.display())),
            Some(_) => {}
        }
    }
    for (p, m) in after.iter().filter(|(p, _)| !before.contains_key(*p)) {
        diffs.push(format!("{} appeared: {m:?}", p.display()));
    }
    diffs
}

#[track_caller]
pub fn assert_same(before: &Snap, after: &Snap, what: &str) {
    let diffs = diff(before, after);
    assert!(
        diffs.is_empty(),
        "{what}: something outside the brick changed:\n{}",
        diffs.join("\n")
    );
}

/// No entry of the brick shares an inode with the outside (no hard link to an outside file).
pub fn assert_no_outside_inode_in(brick: &Path, outside: &HashSet<u64>) {
    for (p, m) in snapshot(&[brick]) {
        assert!(
            !outside.contains(&m.ino),
            "{} is the outside inode {}",
            p.display(),
            m.ino
        );
    }
}

pub fn code(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

/// Asserts `r` failed with one of `codes`.
#[track_caller]
pub fn refused<T: std::fmt::Debug>(r: io::Result<T>, codes: &[i32], what: &str) {
    match r {
        Ok(v) => panic!("{what}: expected a refusal, got {v:?}"),
        Err(e) => assert!(codes.contains(&code(&e)), "{what}: unexpected error {e}"),
    }
}

pub fn is_link(a: &Attr) -> bool {
    a.mode & libc::S_IFMT == libc::S_IFLNK
}
