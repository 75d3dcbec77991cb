//! Replica-3 with a brick down for names and attributes: creates (files, nested directories,
//! a symlink), removals (a file, a directory tree), renames (a file, a directory, a file over
//! another), chmod and user xattrs go through the client stack while one kilnd is killed; it
//! comes back, heal runs, and the three brick directories must be identical — names, types,
//! modes, symlink targets, user xattrs, contents (`.kiln` aside) — with nothing left to heal.
//!
//! `KILN_SEED=N` picks the brick that goes down (and the contents); a failure prints the seed.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use kiln_layer::{Ctx, LayerRef};

use crate::replica;
use replica::{index_empty, volfile, wait_for, Brick, Rng};

/// What one brick holds, as the test compares it: path → (type, mode and owner, symlink target,
/// contents or device number, user xattrs).
type Tree = BTreeMap<String, (char, (u32, u32, u32), Vec<u8>, BTreeMap<String, Vec<u8>>)>;

fn user_xattrs(p: &Path) -> BTreeMap<String, Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut names = vec![0u8; 64 << 10];
    // SAFETY: valid C string and buffer of the given length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    let mut out = BTreeMap::new();
    if n <= 0 {
        return out;
    }
    for name in names[..n as usize]
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
    {
        if !name.starts_with(b"user.") {
            continue;
        }
        let cn = std::ffi::CString::new(name).unwrap();
        let mut v = vec![0u8; 64 << 10];
        // SAFETY: as above.
        let m = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        v.truncate(m.max(0) as usize);
        out.insert(String::from_utf8_lossy(name).into_owned(), v);
    }
    out
}

fn tree(dir: &Path) -> Tree {
    fn walk(root: &Path, rel: &str, out: &mut Tree) {
        let at = if rel.is_empty() {
            root.to_owned()
        } else {
            root.join(rel)
        };
        for e in std::fs::read_dir(&at).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            if rel.is_empty() && name == ".kiln" {
                continue;
            }
            let p = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            let full = root.join(&p);
            let md = std::fs::symlink_metadata(&full).unwrap();
            let t = md.file_type();
            let (kind, body) = if t.is_symlink() {
                let to = std::fs::read_link(&full).unwrap();
                ('l', to.into_os_string().into_string().unwrap().into_bytes())
            } else if t.is_dir() {
                ('d', Vec::new())
            } else if t.is_fifo() {
                ('p', Vec::new())
            } else if t.is_socket() {
                ('s', Vec::new())
            } else if t.is_char_device() || t.is_block_device() {
                let k = if t.is_char_device() { 'c' } else { 'b' };
                (k, md.rdev().to_le_bytes().to_vec())
            } else {
                ('f', std::fs::read(&full).unwrap())
            };
            let mode = if t.is_symlink() {
                0
            } else {
                md.permissions().mode() & 0o7777
            };
            let meta = (mode, md.uid(), md.gid());
            out.insert(p.clone(), (kind, meta, body, user_xattrs(&full)));
            if t.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Tree::new();
    walk(dir, "", &mut out);
    out
}

/// Panics, naming the first difference, unless every brick holds the same tree.
fn assert_same(bricks: &[Brick], seed: u64) -> Tree {
    let trees: Vec<Tree> = bricks.iter().map(|b| tree(&b.dir)).collect();
    for (i, t) in trees.iter().enumerate().skip(1) {
        let names: Vec<&String> = trees[0].keys().chain(t.keys()).collect();
        for n in names {
            assert!(
                trees[0].get(n) == t.get(n),
                "seed {seed}: brick 0 and brick {i} differ at {n}: {:?} vs {:?}",
                trees[0].get(n).map(|e| (
                    e.0,
                    format!("{:o} {}:{}", e.1 .0, e.1 .1, e.1 .2),
                    e.2.len(),
                    &e.3
                )),
                t.get(n).map(|e| (
                    e.0,
                    format!("{:o} {}:{}", e.1 .0, e.1 .1, e.1 .2),
                    e.2.len(),
                    &e.3
                )),
            );
        }
    }
    trees.into_iter().next().unwrap()
}

struct Client {
    vol: Volume,
    rng: Rng,
}

impl Client {
    fn top(&self) -> &LayerRef {
        self.vol.top()
    }

    fn write(&mut self, path: &str, len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len).map(|_| self.rng.next() as u8).collect();
        let (fd, _) = block_on(self.vol.create(
            path,
            libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC,
            0o644,
        ))
        .unwrap_or_else(|e| panic!("create {path}: errno {e}"));
        if len > 0 {
            let (r, _) = block_on(self.vol.pwritev(&fd, vec![data.clone()], 0));
            assert_eq!(r.expect("write"), len);
        }
        let _ = block_on(self.vol.close(fd));
        data
    }

    fn mkdir(&self, path: &str, mode: u32) {
        block_on(self.top().mkdir(&Ctx::NONE, path, mode))
            .unwrap_or_else(|e| panic!("mkdir {path}: errno {e}"));
    }

    fn chmod(&self, path: &str, mode: u32) {
        let a = kiln_layer::SetAttrs {
            valid: kiln_proto::ops::SETATTR_MODE,
            mode,
            ..Default::default()
        };
        block_on(self.top().setattr(&Ctx::NONE, path, &a))
            .unwrap_or_else(|e| panic!("chmod {path}: errno {e}"));
    }

    fn ok<T>(&self, what: &str, r: kiln_layer::FopResult<T>) -> T {
        r.unwrap_or_else(|e| panic!("{what}: errno {e}"))
    }
}

fn connect(bricks: &[Brick], seed: u64) -> Client {
    Client {
        vol: Volume::from_volfile(&volfile(bricks)).expect("connect"),
        rng: Rng(seed | 1),
    }
}

fn up(c: &Client, i: usize) -> bool {
    heal::replicate_layers(c.top())[0].children()[i].up()
}

fn kill(bricks: &mut [Brick], c: &Client, i: usize) {
    bricks[i].kill9();
    wait_for("the client to see the brick down", 30, || !up(c, i));
}

fn restart(bricks: &mut [Brick], c: &Client, i: usize) {
    bricks[i].start();
    wait_for("the client to reconnect", 30, || up(c, i));
}

/// Heals with a connection of its own; panics unless it ends with nothing left.
fn heal_all(bricks: &[Brick], seed: u64) {
    let healer = Volume::from_volfile(&volfile(bricks)).expect("healer connects");
    let rep = heal::replicate_layers(healer.top()).remove(0);
    wait_for("the healer to connect", 30, || {
        rep.children().iter().all(|k| k.up())
    });
    let need = block_on(heal::info(healer.top()));
    assert!(
        !need.is_empty(),
        "seed {seed}: heal info is empty before heal"
    );
    let report = block_on(heal::run(healer.top(), &|_, _| {}));
    eprintln!("seed {seed}: {report:?}");
    assert!(report.errors.is_empty(), "seed {seed}: {:?}", report.errors);
    let need = block_on(heal::info(healer.top()));
    assert!(
        need.is_empty(),
        "seed {seed}: heal info after heal: {need:?}"
    );
    assert!(index_empty(&healer), "seed {seed}: marks remain after heal");
}

fn seed() -> u64 {
    std::env::var("KILN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0001)
}

/// A tree every brick holds before the brick goes down.
fn populate(c: &mut Client) {
    c.write("old.txt", 3000);
    c.mkdir("olddir", 0o755);
    c.mkdir("olddir/sub", 0o700);
    c.write("olddir/sub/x", 100);
    c.write("olddir/y", 10);
    c.write("ren_src", 5000);
    c.write("ren_over", 7);
    c.mkdir("rendir", 0o750);
    c.write("rendir/inner", 900);
    c.mkdir("rendir/deep", 0o755);
    c.write("rendir/deep/z", 50);
    c.write("chm", 10);
    c.write("xat", 10);
    c.ok(
        "setxattr",
        block_on(c.top().setxattr(&Ctx::NONE, "xat", "user.gone", b"old", 0)),
    );
}

/// Every kind of name and attribute change, through the client.
fn changes(c: &mut Client) {
    let cx = &Ctx::NONE;
    c.mkdir("n1", 0o711);
    c.mkdir("n1/n2", 0o755);
    c.write("n1/n2/f", 70_000);
    c.write("n1/empty", 0);
    c.ok("symlink", block_on(c.top().symlink(cx, "n1/n2/f", "ln")));
    // Special files: a FIFO, a socket and a character device (1, 3: what /dev/null is).
    let fifo = libc::S_IFIFO | 0o640;
    c.ok("mkfifo", block_on(c.top().mknod(cx, "n1/fifo", fifo, 0)));
    let sock = libc::S_IFSOCK | 0o755;
    c.ok("mknod sock", block_on(c.top().mknod(cx, "sock", sock, 0)));
    let chr = libc::S_IFCHR | 0o600;
    c.ok(
        "mknod chr",
        block_on(c.top().mknod(cx, "chr", chr, libc::makedev(1, 3))),
    );
    c.ok("unlink", block_on(c.top().unlink(cx, "old.txt")));
    c.ok("unlink", block_on(c.top().unlink(cx, "olddir/sub/x")));
    c.ok("rmdir", block_on(c.top().rmdir(cx, "olddir/sub")));
    c.ok("unlink", block_on(c.top().unlink(cx, "olddir/y")));
    c.ok("rmdir", block_on(c.top().rmdir(cx, "olddir")));
    c.ok(
        "rename",
        block_on(c.top().rename(cx, "ren_src", "ren_dst", 0)),
    );
    c.write("ren_new", 333);
    c.ok(
        "rename over",
        block_on(c.top().rename(cx, "ren_new", "ren_over", 0)),
    );
    c.ok(
        "rename dir",
        block_on(c.top().rename(cx, "rendir", "rendir2", 0)),
    );
    c.chmod("chm", 0o600);
    let chown = kiln_layer::SetAttrs {
        valid: kiln_proto::ops::SETATTR_UID | kiln_proto::ops::SETATTR_GID,
        uid: 1000,
        gid: 100,
        ..Default::default()
    };
    c.ok("chown", block_on(c.top().setattr(cx, "n1/n2/f", &chown)));
    // Ownership is healed too (checked by the tree comparison).
    c.ok(
        "chown fifo",
        block_on(c.top().setattr(cx, "n1/fifo", &chown)),
    );
    c.chmod("n1/n2", 0o700);
    c.ok(
        "setxattr",
        block_on(c.top().setxattr(cx, "xat", "user.k", b"v1", 0)),
    );
    c.ok(
        "removexattr",
        block_on(c.top().removexattr(cx, "xat", "user.gone")),
    );
    c.ok(
        "setxattr dir",
        block_on(c.top().setxattr(cx, "n1", "user.d", b"dir", 0)),
    );
}

#[test]
fn heal_repairs_names_and_attributes_a_brick_missed() {
    let seed = seed();
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let mut c = connect(&bricks, seed);
    let victim = (seed % 3) as usize;
    populate(&mut c);
    kill(&mut bricks, &c, victim);
    changes(&mut c);
    restart(&mut bricks, &c, victim);
    heal_all(&bricks, seed);
    let t = assert_same(&bricks, seed);
    // The changes are there (not undone on the others).
    for gone in ["old.txt", "olddir", "ren_src", "rendir"] {
        assert!(!t.contains_key(gone), "seed {seed}: {gone} is back");
    }
    for (p, kind) in [
        ("n1/n2/f", 'f'),
        ("ln", 'l'),
        ("ren_dst", 'f'),
        ("rendir2/deep/z", 'f'),
    ] {
        assert_eq!(t.get(p).map(|e| e.0), Some(kind), "seed {seed}: {p}");
    }
    assert_eq!(t["chm"].1 .0, 0o600, "seed {seed}");
    assert_eq!(t["n1/n2"].1 .0, 0o700, "seed {seed}");
    assert_eq!(t["n1"].1 .0, 0o711, "seed {seed}");
    assert_eq!(t["ren_over"].2.len(), 333, "seed {seed}");
    assert_eq!(
        t["xat"].3.get("user.k").map(Vec::as_slice),
        Some(&b"v1"[..])
    );
    assert!(!t["xat"].3.contains_key("user.gone"), "seed {seed}");
}

/// A brick down for only part of the changes; after it returns, more changes (to the very
/// names it missed) reach all three before heal runs.
#[test]
fn heal_repairs_names_when_a_brick_missed_only_some_changes() {
    let seed = seed() ^ 0x77;
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let mut c = connect(&bricks, seed);
    let cx = &Ctx::NONE;
    let victim = (seed % 3) as usize;
    populate(&mut c);
    c.mkdir("before", 0o755);
    c.write("before/a", 1000);
    kill(&mut bricks, &c, victim);
    changes(&mut c);
    c.write("before/b", 2000);
    c.ok("unlink", block_on(c.top().unlink(cx, "before/a")));
    restart(&mut bricks, &c, victim);
    // With all three up: changes to names the brick missed, and to names it has.
    c.chmod("ren_dst", 0o640);
    c.ok(
        "rename",
        block_on(c.top().rename(cx, "n1/n2/f", "n1/f2", 0)),
    );
    c.write("n1/n2/g", 4000);
    c.ok(
        "setxattr",
        block_on(c.top().setxattr(cx, "chm", "user.after", b"a", 0)),
    );
    c.mkdir("after", 0o700);
    c.write("after/c", 10);
    c.ok("unlink", block_on(c.top().unlink(cx, "rendir2/inner")));
    heal_all(&bricks, seed);
    let t = assert_same(&bricks, seed);
    assert!(
        t.contains_key("n1/f2") && !t.contains_key("n1/n2/f"),
        "seed {seed}"
    );
    assert!(
        t.contains_key("before/b") && !t.contains_key("before/a"),
        "seed {seed}"
    );
    assert!(!t.contains_key("rendir2/inner"), "seed {seed}");
    assert_eq!(t["ren_dst"].1 .0, 0o640, "seed {seed}");
}

/// Hard links made while a brick was away (one in the same directory, one in another) are
/// healed as links there: the three names share one inode on every brick (link count 3).
#[test]
fn heal_makes_a_missed_hard_link_a_link() {
    let seed = seed() ^ 0x11c;
    let root = tempfile::tempdir().unwrap();
    let mut bricks: Vec<Brick> = (0..3).map(|i| Brick::new(root.path(), i)).collect();
    let mut c = connect(&bricks, seed);
    let cx = &Ctx::NONE;
    let victim = (seed % 3) as usize;
    c.mkdir("d", 0o755);
    c.write("d/orig", 5000);
    kill(&mut bricks, &c, victim);
    c.ok("link", block_on(c.top().link(cx, "d/orig", "d/same-dir")));
    c.mkdir("e", 0o755);
    c.ok("link", block_on(c.top().link(cx, "d/orig", "e/other-dir")));
    restart(&mut bricks, &c, victim);
    heal_all(&bricks, seed);
    assert_same(&bricks, seed);
    for b in &bricks {
        let ino = |p: &str| std::fs::metadata(b.dir.join(p)).unwrap();
        let (o, s, e) = (ino("d/orig"), ino("d/same-dir"), ino("e/other-dir"));
        assert_eq!(o.nlink(), 3, "seed {seed}: {} link count", b.dir.display());
        assert!(
            o.ino() == s.ino() && o.ino() == e.ino(),
            "seed {seed}: {} holds copies, not links",
            b.dir.display()
        );
    }
}
