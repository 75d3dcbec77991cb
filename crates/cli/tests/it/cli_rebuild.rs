//! A wiped brick and a replaced brick are rebuilt in full while a checksummed writer keeps
//! writing: a managed replica-3 volume (real kilnd, brick processes and a FUSE mount) holds a
//! tree of every kind of file — nested directories, files of several sizes, a hard link, a
//! symlink, a FIFO, a device node, modes, owners, times and xattrs. Brick 2 is killed, its
//! directory wiped (`.kiln` too) and started again (`start force`); later brick 1 is replaced
//! by a new directory (`replace-brick`). Each time the heal service must notice the new
//! brick, show the rebuild's progress, finish it, and leave the three bricks identical —
//! bytes, modes, owners, times, xattrs, link counts, special files — while every write the
//! writer made reads back as written.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common;
use common::{kill_brick_pid, kiln, mgmt_ok, wait_for, BrickReaper, Kilnd};

/// The mount, unmounted (SIGTERM) when dropped.
struct Mount(Child);

impl Drop for Mount {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a pid and a signal number has no memory effects.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

struct Vol {
    kd: Kilnd,
    state: PathBuf,
}

impl Vol {
    fn mgmt(&self, args: &[&str]) -> String {
        mgmt_ok(&self.kd, &self.state, args)
    }

    fn status(&self) -> Value {
        let s = self.mgmt(&["volume", "status", "rv", "--json"]);
        serde_json::from_str::<Value>(&s).unwrap()["volumes"][0].clone()
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Sets a path's access and change times (not following a final symlink).
fn set_times(p: &Path, sec: i64) {
    let t = libc::timespec {
        tv_sec: sec,
        tv_nsec: 123_456_789,
    };
    // SAFETY: a valid C string and a two-element array, both alive for the call.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, cpath(p).as_ptr(), [t, t].as_ptr(), 0) };
    assert_eq!(r, 0, "utimensat {}", p.display());
}

fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).unwrap();
    // SAFETY: valid C strings and a buffer with its length, alive for the call.
    let r = unsafe {
        libc::setxattr(
            cpath(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr {}", p.display());
}

/// The `user.` xattrs of a path (not following a symlink), sorted, with values.
fn xattrs(p: &Path) -> Vec<(String, Vec<u8>)> {
    let c = cpath(p);
    let mut names = vec![0u8; 4096];
    // SAFETY: a valid C string and a buffer with its length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert!(n >= 0, "llistxattr {}", p.display());
    let mut out = Vec::new();
    for name in names[..n as usize]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
    {
        let s = String::from_utf8_lossy(name).into_owned();
        if !s.starts_with("user.") {
            continue;
        }
        let cn = CString::new(name).unwrap();
        let mut v = vec![0u8; 4096];
        // SAFETY: as above.
        let len =
            unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        assert!(len >= 0);
        v.truncate(len as usize);
        out.push((s, v));
    }
    out.sort();
    out
}

/// Deterministic bytes for `seed`.
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut rng = kiln_testkit::rng::Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..n).map(|_| rng.next() as u8).collect()
}

/// Fills the mount with every kind of entry; times are set last, deepest first, so that the
/// healthy bricks agree on them.
fn populate(m: &Path) {
    let mut dirs = vec![m.join("t")];
    for d in ["t/a", "t/a/b", "t/a/b/c", "t/e"] {
        dirs.push(m.join(d));
    }
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
    }
    let mut k = 0u64;
    for d in &dirs {
        for i in 0..6 {
            k += 1;
            let size = [0, 1, 4096, 100_000, 1_500_000, 3_000_001][i];
            std::fs::write(d.join(format!("f{i}")), bytes(k, size)).unwrap();
        }
    }
    std::fs::hard_link(m.join("t/a/f4"), m.join("t/e/hard")).unwrap();
    std::os::unix::fs::symlink("../a/b/f3", m.join("t/e/link")).unwrap();
    // SAFETY: valid C strings; mkfifo and mknod have no memory effects.
    unsafe {
        assert_eq!(libc::mkfifo(cpath(&m.join("t/e/fifo")).as_ptr(), 0o640), 0);
        let dev = libc::makedev(1, 3);
        let r = libc::mknod(
            cpath(&m.join("t/e/null")).as_ptr(),
            libc::S_IFCHR | 0o600,
            dev,
        );
        assert_eq!(r, 0);
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(m.join("t/a/f2"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::set_permissions(m.join("t/a/b"), std::fs::Permissions::from_mode(0o750)).unwrap();
    std::os::unix::fs::chown(m.join("t/a/b/f1"), Some(1000), Some(1001)).unwrap();
    std::os::unix::fs::chown(m.join("t/e"), Some(1002), Some(1002)).unwrap();
    set_xattr(&m.join("t/a/f3"), "user.colour", b"blue");
    set_xattr(&m.join("t/a/b"), "user.dir", b"yes");
    for d in dirs.iter().rev() {
        for e in std::fs::read_dir(d).unwrap().flatten() {
            let ft = e.file_type().unwrap();
            if ft.is_file() {
                set_times(&e.path(), 1_600_000_000);
            }
        }
        set_times(d, 1_500_000_000);
    }
}

/// Everything a brick holds under `t/`, one line per name: kind, mode, owner, size, links,
/// device, link target, xattrs, a hash of the bytes and the times.
fn tree(brick: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![brick.join("t")];
    while let Some(p) = todo.pop() {
        let md = std::fs::symlink_metadata(&p).unwrap();
        let ft = md.file_type();
        let rel = p.strip_prefix(brick).unwrap().display().to_string();
        let mut line = format!(
            "mode {:o} owner {}:{} links {} rdev {} xattrs {:?}",
            md.mode(),
            md.uid(),
            md.gid(),
            md.nlink(),
            md.rdev(),
            xattrs(&p)
        );
        if ft.is_dir() {
            line += &format!(" mtime {}.{:09}", md.mtime(), md.mtime_nsec());
            for e in std::fs::read_dir(&p).unwrap().flatten() {
                todo.push(e.path());
            }
        } else if ft.is_file() {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            std::fs::read(&p).unwrap().hash(&mut h);
            line += &format!(
                " size {} hash {:x} mtime {}.{:09}",
                md.len(),
                h.finish(),
                md.mtime(),
                md.mtime_nsec()
            );
        } else if ft.is_symlink() {
            line += &format!(" -> {}", std::fs::read_link(&p).unwrap().display());
        }
        out.insert(rel, line);
    }
    out
}

/// The writer: 4 KiB blocks at random places of `w/img`, each holding its block number, its
/// version and bytes derived from both; what it wrote last, per block.
struct Writer {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<u64>>,
}

const BLOCKS: u64 = 512;

fn block(b: u64, v: u64) -> Vec<u8> {
    let mut d = bytes(b * 1_000_003 + v, 4096);
    d[..8].copy_from_slice(&b.to_le_bytes());
    d[8..16].copy_from_slice(&v.to_le_bytes());
    d
}

impl Writer {
    fn start(img: &Path, last: Arc<Mutex<BTreeMap<u64, u64>>>) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
        let (s, l) = (stop.clone(), last.clone());
        let handle = std::thread::spawn(move || {
            let mut n = 0u64;
            let mut x = 12345u64 + l.lock().unwrap().len() as u64;
            while !s.load(Ordering::Acquire) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let b = (x >> 33) % BLOCKS;
                let v = l.lock().unwrap().get(&b).copied().unwrap_or(0) + 1;
                f.write_all_at(&block(b, v), b * 4096)
                    .unwrap_or_else(|e| panic!("write of block {b} failed: {e}"));
                l.lock().unwrap().insert(b, v);
                n += 1;
            }
            n
        });
        Writer {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops it; returns how many writes it made.
    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.handle.take().unwrap().join().expect("the writer")
    }
}

/// Every block reads back as the writer last wrote it.
fn verify(img: &Path, last: &BTreeMap<u64, u64>) {
    let f = std::fs::File::open(img).unwrap();
    let mut buf = vec![0u8; 4096];
    for (b, v) in last {
        f.read_exact_at(&mut buf, b * 4096).unwrap();
        assert!(buf == block(*b, *v), "block {b} is not version {v}");
    }
}

/// Waits (polling status) until no brick is new and the heal backlog is empty; returns the
/// progress lines seen on the way.
fn wait_rebuilt(v: &Vol, brick: &str, secs: u64) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut seen = Vec::new();
    loop {
        let st = v.status();
        let rebuilds = st["heal"]["rebuilds"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for r in &rebuilds {
            let line = format!(
                "{} of {} names, {} of {} bytes, done {}",
                r["files_done"], r["files_total"], r["bytes_done"], r["bytes_total"], r["done"]
            );
            if seen.last() != Some(&line) {
                seen.push(line);
            }
        }
        let info = v.mgmt(&["volume", "heal", "rv", "info"]);
        let done = rebuilds.iter().all(|r| r["done"] == true)
            && !info.contains("is NEW")
            && info.contains("backlog of volume rv: 0 file(s)");
        if done && !seen.is_empty() {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "{brick} not rebuilt in {secs} s; progress {seen:?}; heal info:\n{info}\nkilnd log:\n{}",
            v.kd.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A path's inode, birth, change and modification times (for a failure's message).
fn detail(p: &Path) -> String {
    match std::fs::symlink_metadata(p) {
        Ok(md) => format!(
            "{}: ino {} born {:?} ctime {}.{:09} mtime {}.{:09}",
            p.display(),
            md.ino(),
            md.created().ok(),
            md.ctime(),
            md.ctime_nsec(),
            md.mtime(),
            md.mtime_nsec()
        ),
        Err(e) => format!("{}: {e}", p.display()),
    }
}

fn assert_same(v: &Vol, bricks: &[&Path]) {
    let first = tree(bricks[0]);
    assert!(first.len() > 30, "the tree is there: {first:?}");
    for b in &bricks[1..] {
        let other = tree(b);
        for (k, want) in &first {
            assert_eq!(
                other.get(k),
                Some(want),
                "{k} differs between {} and {}: {}; kilnd log:\n{}",
                bricks[0].display(),
                b.display(),
                bricks
                    .iter()
                    .map(|b| detail(&b.join(k)))
                    .collect::<Vec<_>>()
                    .join("; "),
                v.kd.log_text()
            );
        }
        assert_eq!(
            first.len(),
            other.len(),
            "{} holds other names",
            b.display()
        );
    }
    // The writer's image: the same bytes everywhere.
    let img = |b: &Path| std::fs::read(b.join("w/img")).unwrap();
    for b in &bricks[1..] {
        assert!(img(bricks[0]) == img(b), "w/img differs on {}", b.display());
    }
}

fn brick_pid(v: &Vol, i: usize) -> i32 {
    v.status()["bricks"][i]["pid"].as_u64().unwrap() as i32
}

#[test]
fn wiped_and_replaced_bricks_are_rebuilt_in_full() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(
        &state,
        &["--brick-port-base", "25100", "--heal-interval", "0.3"],
    );
    let v = Vol { kd, state };
    let b: Vec<PathBuf> = (0..4).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let spec = |p: &Path| format!("127.0.0.1:{}", p.display());
    v.mgmt(&[
        "volume",
        "create",
        "rv",
        "replica",
        "3",
        &spec(&b[0]),
        &spec(&b[1]),
        &spec(&b[2]),
    ]);
    v.mgmt(&["volume", "start", "rv"]);
    for d in &b[..3] {
        let id = std::fs::read_to_string(d.join(".kiln/identity")).expect("identity at start");
        assert!(id.contains("volume-id"), "{id}");
    }

    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut c = kiln();
    c.args(["mount", &format!("{}:/rv", v.kd.addr), "--mode", "vm-image"])
        .arg(&mnt)
        .env("KILN_SECRET_FILE", v.state.join("vols/rv/secret"))
        .env("KILN_LOG", "warn")
        .stdout(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("kiln: mounted") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0);
    }
    let _mount = Mount(child);

    populate(&mnt);
    std::fs::create_dir(mnt.join("w")).unwrap();
    let img = mnt.join("w/img");
    std::fs::write(&img, vec![0u8; (BLOCKS * 4096) as usize]).unwrap();
    let last = Arc::new(Mutex::new(BTreeMap::new()));

    // 1. Brick 2 wiped (its identity too) and started again while the writer writes.
    let w = Writer::start(&img, last.clone());
    kill_brick_pid(brick_pid(&v, 2));
    std::fs::remove_dir_all(&b[2]).unwrap();
    std::fs::create_dir(&b[2]).unwrap();
    v.mgmt(&["volume", "start", "rv", "force"]);
    let seen = wait_rebuilt(&v, "the wiped brick", 120);
    let writes = w.stop();
    assert!(writes > 0, "the writer wrote during the rebuild");
    wait_rebuilt(&v, "the wiped brick (after the writer)", 60);
    assert!(b[2].join(".kiln/identity").exists(), "a member again");
    verify(&img, &last.lock().unwrap());
    assert_same(&v, &[&b[0], &b[1], &b[2]]);
    eprintln!("wiped brick: {writes} writes during the rebuild; progress {seen:?}");

    // 2. Brick 1 replaced by a new directory while the writer writes.
    let w = Writer::start(&img, last.clone());
    // GlusterFS's spelling, rebuilt from here with progress shown until done.
    let out = v.mgmt(&[
        "volume",
        "replace-brick",
        "rv",
        &spec(&b[1]),
        &spec(&b[3]),
        "commit",
        "force",
        "--wait",
    ]);
    assert!(out.contains("success"), "{out}");
    let seen: Vec<&str> = out.lines().filter(|l| l.contains("rebuil")).collect();
    assert!(
        seen.last()
            .is_some_and(|l| l.ends_with("rebuilt; a member now")),
        "no progress to the end shown: {out}"
    );
    let writes = w.stop();
    wait_for("nothing left to heal after the writer", 60, || {
        let info = v.mgmt(&["volume", "heal", "rv", "info"]);
        !info.contains("is NEW") && info.contains("backlog of volume rv: 0 file(s)")
    });
    let info = v.mgmt(&["volume", "info", "rv"]);
    assert!(info.contains(&*b[3].to_string_lossy()), "{info}");
    assert!(!info.contains(&format!("{}\n", b[1].display())), "{info}");
    verify(&img, &last.lock().unwrap());
    assert_same(&v, &[&b[0], &b[2], &b[3]]);
    eprintln!("replaced brick: {writes} writes during the rebuild; progress {seen:?}");

    // A brick of another volume (a foreign identity) does not start in its place.
    std::fs::write(
        b[3].join(".kiln/identity"),
        "kiln brick identity 1\nvolume-id 0000\nbrick 1\n",
    )
    .unwrap();
    kill_brick_pid(brick_pid(&v, 1));
    let mut c = kiln();
    c.args([
        "volume",
        "start",
        "rv",
        "force",
        "--server",
        &v.kd.addr,
        "--state-dir",
    ])
    .arg(&v.state);
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("volume id 0000"),
        "{err}"
    );
}
