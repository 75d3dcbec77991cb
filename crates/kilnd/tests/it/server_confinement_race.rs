//! Confinement against a hostile brick and racing renames, each against a live kilnd:
//!
//! * hard links whose source is a symlink pointing out (the new name must be the symlink itself,
//!   never the outside inode), and links through symlinked directories that point out (refused);
//! * `/proc` magic links planted in the brick (`/proc/self/fd/N`, `/proc/self/cwd`,
//!   `/proc/<kilnd>/root`, `/proc/self/exe`, …): only the link itself is ever reached;
//! * a directory `race/d` swapped with a symlink to the outside — by a local process, and by a
//!   second Kiln client — while clients keep many requests in flight on paths beneath it.
//!
//! Beside the brick sits an `outside` directory whose names mirror the ones the clients use and
//! whose files hold [`SECRET`]. Every test compares a snapshot of it (contents, link counts,
//! times, xattrs, inode numbers) before and after, and checks that no reply carries the secret
//! or names an outside inode.
//!
//! kilnd is started here rather than with `common::Kilnd` so that its stderr (one warning per
//! refused escape: thousands in a race) goes to a log file instead of the test's output, and so
//! that its working directory is one the test watches (`/proc/self/cwd` aims there).

use std::collections::{BTreeMap, HashSet};
use std::io::{self};
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kiln_client::{block_on, join_all, Client};
use kiln_proto::ops::{Attr, SetAttrs, SETATTR_MODE};

use crate::confinement;
use confinement::*;

#[test]
fn hard_link_to_a_symlink_pointing_out_links_the_symlink_itself() {
    let mut k = Kilnd::start(false, |brick, out| {
        symlink(out.join("secret"), brick.join("abs-sym")).expect("symlink");
        symlink("../outside/secret", brick.join("rel-sym")).expect("symlink");
        std::fs::create_dir(brick.join("sub")).expect("sub");
        symlink("../../outside/secret", brick.join("sub/deep-sym")).expect("symlink");
        symlink(out, brick.join("abs-dir")).expect("symlink");
        symlink("../outside", brick.join("rel-dir")).expect("symlink");
        symlink("../../outside", brick.join("sub/deep-dir")).expect("symlink");
        symlink(out.join("made-by-link"), brick.join("dangle")).expect("symlink");
        std::fs::write(brick.join("in"), INSIDE).expect("inside file");
    });
    let before = k.watched();
    let outside_inos = inos(&before);
    let secret = k.outside.join("secret");
    let secret_nlink = std::fs::metadata(&secret).expect("secret").nlink();
    let c = k.client();
    // Symlinks a client makes itself are stored as given; they must behave like planted ones.
    let abs = secret.to_str().expect("utf-8 path");
    block_on(c.symlink(abs, "c-abs-sym")).expect("client symlink");
    block_on(c.symlink("../outside/secret", "c-rel-sym")).expect("client symlink");

    // Linking works at all, so the refusals below mean something.
    let a = block_on(c.link("in", "in2")).expect("a hard link inside the brick");
    assert_eq!((a.mode & libc::S_IFMT, a.nlink), (libc::S_IFREG, 2));

    // A symlink as the source: linkat without AT_SYMLINK_FOLLOW names the symlink itself.
    let mut linked = 0;
    let srcs = [
        "abs-sym",
        "rel-sym",
        "sub/deep-sym",
        "abs-dir",
        "rel-dir",
        "sub/deep-dir",
        "dangle",
        "c-abs-sym",
        "c-rel-sym",
    ];
    for (i, src) in srcs.iter().enumerate() {
        let new = format!("hl-{i}");
        let old = std::fs::symlink_metadata(k.brick.join(src)).expect("lstat source");
        match block_on(c.link(src, &new)) {
            Ok(a) => {
                assert!(is_link(&a), "link {src}: made a non-symlink {a:?}");
                assert_eq!(a.ino, old.ino(), "link {src}: not the symlink's inode");
                assert!(!outside_inos.contains(&a.ino), "link {src}: outside inode");
                let m = std::fs::symlink_metadata(k.brick.join(&new)).expect("lstat new");
                assert!(m.file_type().is_symlink() && m.ino() == old.ino());
                assert_eq!(
                    block_on(c.readlink(&new)).expect("readlink new"),
                    std::fs::read_link(k.brick.join(src))
                        .expect("readlink")
                        .to_str()
                        .expect("utf-8")
                );
                // Following the new name is as confined as following the old one.
                refused(
                    block_on(c.open(&new, libc::O_RDONLY)),
                    &REFUSED,
                    &format!("open {new} (a link to {src})"),
                );
                refused(
                    block_on(c.create(&format!("{new}/x"), libc::O_RDWR, 0o644)),
                    &REFUSED,
                    &format!("create {new}/x"),
                );
                linked += 1;
            }
            Err(e) => assert!(
                [libc::EACCES, libc::EPERM, libc::EXDEV, libc::ELOOP].contains(&code(&e)),
                "link {src}: unexpected error {e}"
            ),
        }
    }
    eprintln!(
        "hard links: {linked} of {} symlink sources linked as symlinks, the rest refused",
        srcs.len()
    );

    // Through a symlinked directory that points out, as source or destination: refused.
    for (src, dst) in [
        ("abs-dir/secret", "t1"),
        ("rel-dir/secret", "t2"),
        ("sub/deep-dir/secret", "t3"),
        ("abs-dir/sub/f", "t4"),
        ("in", "abs-dir/planted"),
        ("in", "rel-dir/planted"),
        ("in", "sub/deep-dir/planted"),
        ("in", "abs-dir/sub/planted"),
        ("abs-dir/secret", "rel-dir/planted2"),
        // The hard links to abs-dir and rel-dir made above (absent if those were refused).
        ("hl-3/secret", "t6"),
        ("in", "hl-4/planted"),
    ] {
        let mut ok = REFUSED.to_vec();
        if src.starts_with("hl-") || dst.starts_with("hl-") {
            ok.push(libc::ENOENT);
        }
        refused(
            block_on(c.link(src, dst)),
            &ok,
            &format!("link {src} {dst}"),
        );
        assert!(std::fs::symlink_metadata(k.brick.join(dst)).is_err());
    }
    // A dangling symlink to the outside as the destination is not followed either.
    refused(
        block_on(c.link("in", "dangle")),
        &[libc::EEXIST],
        "link onto a dangling symlink",
    );
    assert!(!k.outside.join("made-by-link").exists());

    assert_eq!(
        std::fs::metadata(&secret).expect("secret").nlink(),
        secret_nlink,
        "the outside file gained a link"
    );
    assert_eq!(
        std::fs::metadata(k.brick.join("in")).expect("in").nlink(),
        2
    );
    assert_no_outside_inode_in(&k.brick, &outside_inos);
    assert_same(&before, &k.watched(), "hard links");
    k.assert_serves("after-links");
}

#[test]
fn proc_magic_links_planted_in_the_brick_are_never_followed() {
    let mut k = Kilnd::start(false, |_, _| {});
    let pid = k.child.id();
    let climb = "../".repeat(k.brick.components().count());
    let mut links: Vec<(String, String)> = [
        ("self-cwd", "/proc/self/cwd".to_owned()),
        ("pid-cwd", format!("/proc/{pid}/cwd")),
        ("self-root", "/proc/self/root".to_owned()),
        ("pid-root", format!("/proc/{pid}/root")),
        ("self-exe", "/proc/self/exe".to_owned()),
        ("pid-exe", format!("/proc/{pid}/exe")),
        ("thread-root", "/proc/thread-self/root".to_owned()),
        ("thread-cwd", "/proc/thread-self/cwd".to_owned()),
        ("self-fd", "/proc/self/fd".to_owned()),
        ("rel-proc-root", format!("{climb}proc/self/root")),
        ("rel-proc-cwd", format!("{climb}proc/{pid}/cwd")),
        // An inside, relative link to a magic link: the chain must not be followed either.
        ("chain", "fd-2".to_owned()),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_owned(), t))
    .collect();
    // Every descriptor kilnd holds: its log (fd 2, outside the brick), /dev/null, the brick
    // root, sockets, the runtime's epoll…
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("kilnd's fds") {
        let n = e.expect("fd").file_name().into_string().expect("fd number");
        links.push((format!("fd-{n}"), format!("/proc/self/fd/{n}")));
        links.push((format!("pid-fd-{n}"), format!("/proc/{pid}/fd/{n}")));
    }
    for (name, target) in &links {
        symlink(target, k.brick.join(name)).expect("plant a magic link");
    }
    std::fs::write(k.brick.join("in"), INSIDE).expect("inside file");
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_kilnd"));
    let before = k.watched();
    let exe_before = meta(&exe);
    let outside_inos = inos(&before);
    let c = k.client();

    let r = REFUSED.as_slice();
    // Attempts to follow a link, all refused (counted for the report).
    let mut refusals = 0usize;
    for (l, target) in &links {
        // The link itself is fine to look at.
        let a = block_on(c.lookup(l)).expect("lstat of the link itself");
        assert!(is_link(&a), "lookup {l} followed the link: {a:?}");
        assert!(!outside_inos.contains(&a.ino));
        assert_eq!(&block_on(c.readlink(l)).expect("readlink"), target);

        // Following it, as the final component or as a directory on the way: refused.
        let x = format!("{l}/x");
        for flags in [
            libc::O_RDONLY,
            libc::O_RDWR,
            libc::O_WRONLY | libc::O_APPEND,
            libc::O_WRONLY | libc::O_TRUNC,
            libc::O_RDONLY | libc::O_DIRECTORY,
            libc::O_RDONLY | libc::O_NOFOLLOW,
        ] {
            refused(
                block_on(c.open(l, flags)),
                r,
                &format!("open {l} {flags:#x}"),
            );
        }
        refused(block_on(c.create(l, libc::O_RDWR, 0o644)), r, "create");
        refused(
            block_on(c.create(l, libc::O_RDWR | libc::O_EXCL, 0o644)),
            &[libc::EEXIST],
            &format!("create {l} O_EXCL"),
        );
        refused(block_on(c.create(&x, libc::O_RDWR, 0o644)), r, &x);
        refused(block_on(c.mkdir(&x, 0o755)), r, &format!("mkdir {x}"));
        refused(block_on(c.symlink("t", &x)), r, &format!("symlink {x}"));
        refused(block_on(c.lookup(&x)), r, &format!("lookup {x}"));
        refused(block_on(c.readlink(&x)), r, &format!("readlink {x}"));
        refused(block_on(c.readdir(l)), r, &format!("readdir {l}"));
        refused(block_on(c.statfs(l)), r, &format!("statfs {l}"));
        // Extended attributes and attributes of `l` are the link's own (as with lgetxattr
        // and lchown: a client's kernel follows links before it asks), never its target's:
        // no data, nothing settable on a link, or a refusal.
        let own = [r, &[libc::ENODATA, libc::EPERM, libc::EOPNOTSUPP]].concat();
        refused(block_on(c.getxattr(l, OUTSIDE_XATTR)), &own, "getxattr");
        match block_on(c.listxattr(l)) {
            Ok(names) => assert!(
                !names.iter().any(|n| n == OUTSIDE_XATTR),
                "listxattr {l} listed the target's: {names:?}"
            ),
            Err(e) => assert!(r.contains(&code(&e)), "listxattr {l}: unexpected error {e}"),
        }
        refused(
            block_on(c.setxattr(l, "user.kiln", b"1", 0)),
            &own,
            &format!("setxattr {l}"),
        );
        refused(
            block_on(c.removexattr(l, OUTSIDE_XATTR)),
            &own,
            &format!("removexattr {l}"),
        );
        let chmod = SetAttrs {
            valid: SETATTR_MODE,
            mode: 0o600,
            ..Default::default()
        };
        refused(
            block_on(c.setattr(l, &chmod)),
            &own,
            &format!("setattr {l}"),
        );
        refused(block_on(c.unlink(&x)), r, &format!("unlink {x}"));
        refused(block_on(c.rmdir(&x)), r, &format!("rmdir {x}"));
        refused(block_on(c.rename(&x, "y", 0)), r, &format!("rename {x}"));
        refused(
            block_on(c.rename("in", &x, 0)),
            r,
            &format!("rename in {x}"),
        );
        refused(block_on(c.link(&x, "y")), r, &format!("link {x}"));
        refused(block_on(c.link("in", &x)), r, &format!("link in {x}"));
        refusals += 25;
        // A hard link to it is refused or names the link itself.
        match block_on(c.link(l, &format!("hl-{l}"))) {
            Ok(h) => assert!(is_link(&h) && h.ino == a.ino, "link {l}: {h:?}"),
            Err(e) => assert!(
                [libc::EACCES, libc::EPERM, libc::EXDEV, libc::ELOOP].contains(&code(&e)),
                "link {l}: unexpected error {e}"
            ),
        }
    }
    // Names that would be there if a link were followed.
    for p in [
        "self-cwd/canary",
        "pid-cwd/canary",
        "thread-cwd/canary",
        "rel-proc-cwd/canary",
        "self-root/etc/hostname",
        "pid-root/etc/hostname",
        "self-fd/2",
        "fd-2",
        "chain",
    ] {
        refused(block_on(c.lookup(&format!("{p}/x"))), r, p);
        refused(block_on(c.open(p, libc::O_RDONLY)), r, p);
        refused(block_on(c.open(p, libc::O_WRONLY | libc::O_APPEND)), r, p);
        refusals += 3;
    }
    let outside_secret = format!(
        "pid-root{}",
        k.outside.join("secret").to_str().expect("utf-8")
    );
    refused(
        block_on(c.open(&outside_secret, libc::O_RDONLY)),
        r,
        "the outside through /proc/<pid>/root",
    );
    eprintln!(
        "magic links: {} links planted, {} following attempts refused, {} refusals logged",
        links.len(),
        refusals + 1,
        k.refusals_logged()
    );
    // Removing a link removes only the link.
    block_on(c.unlink("fd-2")).expect("unlink the link itself");
    assert!(k.log.exists());
    assert_no_outside_inode_in(&k.brick, &outside_inos);
    assert_same(&before, &k.watched(), "magic links");
    assert_eq!(meta(&exe), exe_before, "kilnd's executable changed");
    k.assert_serves("after-magic-links");
}

/// Ops each racing client cycles through, all on paths beneath `race/d`.
const KINDS: [&str; 17] = [
    "lookup",
    "read",
    "write",
    "create",
    "rename",
    "unlink",
    "mkdir",
    "rmdir",
    "setxattr",
    "getxattr",
    "readdir",
    "read-via-up",
    "create-via-up",
    "setattr",
    "readlink",
    "link",
    "unlink-link",
];
/// Names per client and kind, reused so `race/d` stays small.
const SLOTS: u64 = 8;
/// Requests each racing client keeps in flight.
const INFLIGHT: u64 = 8;
const RACING_CLIENTS: usize = 3;
/// The race runs this long…
const RACE_MIN: Duration = Duration::from_secs(2);
/// …and longer, up to this, until both a success and a refusal were seen.
const RACE_MAX: Duration = Duration::from_secs(8);
/// A bound on the swapper's iterations, should the clients never stop it.
const MAX_SWAPS: u64 = 50_000_000;

/// Outcomes of one kind of request.
#[derive(Default, Debug, Clone)]
struct Tally {
    ok: u64,
    /// EACCES/EXDEV/ELOOP: the path reached the symlink to the outside.
    refused: u64,
    /// ENOENT/ENOTDIR: the path hit the moment `race/d` was absent (or the name was).
    missing: u64,
    /// Anything else (EEXIST/ENOTEMPTY from reused names, EAGAIN from a `..` racing a rename),
    /// by errno.
    other: BTreeMap<i32, u64>,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.ok += o.ok;
        self.refused += o.refused;
        self.missing += o.missing;
        for (c, n) in &o.other {
            *self.other.entry(*c).or_default() += n;
        }
    }
    fn total(&self) -> u64 {
        self.ok + self.refused + self.missing + self.other.values().sum::<u64>()
    }
}

/// What the racing clients check every reply against.
struct RaceCtx {
    /// The inode of `race/d/f`, the one inside file reads, writes and links reach.
    f_ino: u64,
    outside_inos: HashSet<u64>,
    ok: AtomicU64,
    refused: AtomicU64,
    start: Instant,
}

impl RaceCtx {
    fn keep_going(&self) -> bool {
        let t = self.start.elapsed();
        let interleaved =
            self.ok.load(Ordering::Relaxed) > 0 && self.refused.load(Ordering::Relaxed) > 0;
        t < RACE_MIN || (t < RACE_MAX && !interleaved)
    }
    fn inside(&self, a: &Attr, what: &str) {
        assert!(
            !self.outside_inos.contains(&a.ino),
            "{what}: reached the outside inode {}",
            a.ino
        );
    }
    fn is_f(&self, a: &Attr, what: &str) {
        self.inside(a, what);
        assert_eq!(a.ino, self.f_ino, "{what}: not the inside file");
    }
}

/// Reads `path` (which must be the inside file) and checks what came back.
async fn read_f(c: &Client, cx: &RaceCtx, path: &str) -> io::Result<()> {
    let fh = c.open(path, libc::O_RDONLY).await?;
    let st = c.fstat(fh).await;
    // Exactly the inside file's length: a longer read would return short, and a short reply
    // can trip the client's speculative receive (see `race_client`). The outside files begin
    // differently, so reading one would still show.
    let (n, bufs) = c.preadv(fh, vec![vec![0u8; INSIDE.len()]], 0).await;
    let _ = c.close(fh).await;
    cx.is_f(&st?, path);
    let n = n?;
    let data = &bufs[0][..n];
    assert!(
        !SECRET.starts_with(data) || data.is_empty(),
        "read {path} returned the outside file's contents"
    );
    assert_eq!(data, INSIDE, "read {path}");
    Ok(())
}

async fn write_f(c: &Client, cx: &RaceCtx) -> io::Result<()> {
    let fh = c.open("race/d/f", libc::O_WRONLY).await?;
    let st = c.fstat(fh).await;
    let w = match &st {
        Ok(a) if a.ino == cx.f_ino => c.pwritev(fh, vec![INSIDE.to_vec()], 0).await.0,
        _ => Ok(0),
    };
    let _ = c.close(fh).await;
    cx.is_f(&st?, "write race/d/f");
    w.map(|_| ())
}

async fn create_new(c: &Client, cx: &RaceCtx, path: &str) -> io::Result<()> {
    let (fh, a) = c.create(path, libc::O_RDWR, 0o644).await?;
    cx.inside(&a, path);
    let w = c.pwritev(fh, vec![INSIDE.to_vec()], 0).await.0;
    let _ = c.close(fh).await;
    w.map(|_| ())
}

/// One request of client `t`: the `j`th in its cycle through [`KINDS`].
async fn race_op(c: &Client, cx: &RaceCtx, t: usize, j: u64) -> (&'static str, io::Result<()>) {
    let n = KINDS.len() as u64;
    let k = (j % n) as usize;
    let s = (j / n) % SLOTS;
    let name = |p: &str| format!("race/d/{p}{t}-{s}");
    let r = match k {
        0 => c
            .lookup("race/d/f")
            .await
            .map(|a| cx.is_f(&a, "lookup race/d/f")),
        1 => read_f(c, cx, "race/d/f").await,
        2 => write_f(c, cx).await,
        3 => create_new(c, cx, &name("c")).await,
        4 => c.rename(&name("c"), &name("r"), 0).await,
        5 => c.unlink(&name("r")).await,
        6 => c
            .mkdir(&name("m"), 0o755)
            .await
            .map(|a| cx.inside(&a, "mkdir")),
        7 => c.rmdir(&name("m")).await,
        8 => c.setxattr("race/d/f", "user.kiln-race", b"1", 0).await,
        9 => match c.getxattr("race/d/f", OUTSIDE_XATTR).await {
            Ok(v) => panic!("getxattr race/d/f returned the outside file's xattr {v:?}"),
            // The inside file, which has no such attribute.
            Err(e) if code(&e) == libc::ENODATA => Ok(()),
            Err(e) => Err(e),
        },
        10 => c.readdir("race/d").await.map(|es| {
            for e in es {
                assert!(
                    e.name != "secret" && e.name != "only-outside",
                    "readdir race/d listed the outside directory"
                );
                cx.inside(&e.attr, "readdir race/d");
            }
        }),
        11 => read_f(c, cx, "race/d/up/f").await,
        12 => create_new(c, cx, &format!("race/d/up/u{t}-{s}")).await,
        13 => {
            let a = SetAttrs {
                valid: SETATTR_MODE,
                mode: 0o644,
                ..Default::default()
            };
            c.setattr("race/d/f", &a)
                .await
                .map(|a| cx.is_f(&a, "setattr race/d/f"))
        }
        14 => c.readlink("race/d/lnk").await.map(|l| {
            assert_eq!(
                l, "inside-target",
                "readlink race/d/lnk read the outside link"
            )
        }),
        15 => c
            .link("race/d/f", &name("h"))
            .await
            .map(|a| cx.is_f(&a, "link race/d/f")),
        _ => c.unlink(&name("h")).await,
    };
    (KINDS[k], r)
}

/// Client `t` of a race: batches of [`INFLIGHT`] requests until the race is over.
fn race_client(addr: &str, t: usize, cx: &RaceCtx) -> BTreeMap<&'static str, Tally> {
    let c = Client::connect(addr).expect("connect");
    let mut tallies: BTreeMap<&'static str, Tally> = BTreeMap::new();
    let mut j = 0;
    while cx.keep_going() {
        let batch: Vec<_> = (j..j + INFLIGHT).map(|j| race_op(&c, cx, t, j)).collect();
        j += INFLIGHT;
        for (kind, r) in join_all(batch) {
            let e = tallies.entry(kind).or_default();
            match r {
                Ok(()) => {
                    e.ok += 1;
                    cx.ok.fetch_add(1, Ordering::Relaxed);
                }
                Err(err) if REFUSED.contains(&code(&err)) => {
                    e.refused += 1;
                    cx.refused.fetch_add(1, Ordering::Relaxed);
                }
                Err(err) if [libc::ENOENT, libc::ENOTDIR].contains(&code(&err)) => e.missing += 1,
                // A dead connection would leave the race hollow (every later request failing
                // at once). kiln-client's speculative receive dies this way if a read reply is
                // shorter than its buffer while another request is submitted during the
                // receive (the next reply spills into the read's buffer): hence exact reads.
                Err(err) if c.is_dead() => panic!("client {t}: connection lost: {err}"),
                Err(err) => *e.other.entry(code(&err)).or_default() += 1,
            }
        }
    }
    tallies
}

/// Lays out `race/` in the brick: `d/` (with `f`, `up -> ../d`, `lnk -> inside-target`), an
/// empty `deep/`, and `evil`/`evil-rel`, symlinks to the outside to swap with `d`.
fn plant_race(brick: &Path, outside: &Path) {
    let r = brick.join("race");
    std::fs::create_dir_all(r.join("d")).expect("race/d");
    std::fs::create_dir(r.join("deep")).expect("race/deep");
    std::fs::write(r.join("d/f"), INSIDE).expect("race/d/f");
    symlink("../d", r.join("d/up")).expect("race/d/up");
    symlink("inside-target", r.join("d/lnk")).expect("race/d/lnk");
    symlink(outside, r.join("evil")).expect("race/evil");
    symlink("../../outside", r.join("evil-rel")).expect("race/evil-rel");
}

/// Runs [`RACING_CLIENTS`] clients against `swapper` (given the stop flag, returns its swap
/// count), then checks the outcome and prints the counts.
fn run_race(k: &mut Kilnd, what: &str, swapper: impl FnOnce(&AtomicBool) -> u64 + Send) {
    let before = k.watched();
    let cx = RaceCtx {
        f_ino: std::fs::metadata(k.brick.join("race/d/f"))
            .expect("race/d/f")
            .ino(),
        outside_inos: inos(&before),
        ok: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        start: Instant::now(),
    };
    let stop = AtomicBool::new(false);
    let (swaps, per_client) = std::thread::scope(|s| {
        let sw = s.spawn(|| swapper(&stop));
        let clients: Vec<_> = (0..RACING_CLIENTS)
            .map(|t| {
                let (addr, cx) = (&k.addr, &cx);
                s.spawn(move || race_client(addr, t, cx))
            })
            .collect();
        let results: Vec<_> = clients.into_iter().map(|h| h.join()).collect();
        stop.store(true, Ordering::Relaxed);
        let swaps = sw.join();
        let per_client: Vec<_> = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        (
            swaps.unwrap_or_else(|p| std::panic::resume_unwind(p)),
            per_client,
        )
    });
    let elapsed = cx.start.elapsed();

    let mut by_kind: BTreeMap<&str, Tally> = BTreeMap::new();
    for t in &per_client {
        for (kind, tally) in t {
            by_kind.entry(kind).or_default().add(tally);
        }
    }
    let mut all = Tally::default();
    eprintln!(
        "{what}: {swaps} swaps in {elapsed:.2?}; per request kind (ok/refused/missing/other):"
    );
    for (kind, t) in &by_kind {
        all.add(t);
        eprintln!(
            "  {kind:>14}: {:>6} {:>6} {:>6} {:?}",
            t.ok, t.refused, t.missing, t.other
        );
    }
    eprintln!(
        "{what}: {} requests: {} ok, {} refused, {} missing, other {:?}; {} refusals logged",
        all.total(),
        all.ok,
        all.refused,
        all.missing,
        all.other,
        k.refusals_logged()
    );

    // The race interleaved: requests reached the inside directory and the symlink both.
    assert!(swaps > 0, "{what}: the swapper never ran");
    assert!(all.ok > 0, "{what}: no request succeeded");
    assert!(all.refused > 0, "{what}: no request met the symlink");
    for kind in KINDS {
        assert!(
            by_kind.get(kind).is_some_and(|t| t.total() > 0),
            "{kind} never ran"
        );
    }
    // The swapper put everything back.
    let d = std::fs::symlink_metadata(k.brick.join("race/d")).expect("race/d");
    assert!(d.is_dir(), "{what}: race/d is not the directory any more");
    assert_eq!(
        std::fs::read(k.brick.join("race/d/f")).expect("race/d/f"),
        INSIDE
    );
    assert_no_outside_inode_in(&k.brick, &cx.outside_inos);
    assert_same(&before, &k.watched(), what);
    k.assert_serves(&format!("after-{}", what.replace(' ', "-")));
}

/// Exchanges two names atomically.
fn exchange(a: &Path, b: &Path) {
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        a,
        rustix::fs::CWD,
        b,
        rustix::fs::RenameFlags::EXCHANGE,
    )
    .expect("exchange");
}

#[test]
fn rename_racing_lookups_by_a_local_process_never_escapes() {
    let mut k = Kilnd::start(false, plant_race);
    let r = k.brick.join("race");
    let (d, tmp, evil, evil_rel) = (
        r.join("d"),
        r.join("d.tmp"),
        r.join("evil"),
        r.join("evil-rel"),
    );
    let outside = k.outside.clone();
    // A local user swaps race/d with a symlink to the outside, as fast as it can: in four steps
    // (rename away, symlink, unlink, rename back) or atomically (RENAME_EXCHANGE with a planted
    // symlink, and back), with absolute and relative targets.
    let swapper = |stop: &AtomicBool| {
        let mut n = 0;
        while n < MAX_SWAPS && !stop.load(Ordering::Relaxed) {
            match n % 4 {
                0 | 2 => {
                    std::fs::rename(&d, &tmp).expect("rename d away");
                    if n % 4 == 0 {
                        symlink(&outside, &d).expect("symlink d");
                    } else {
                        symlink("../../outside", &d).expect("symlink d");
                    }
                    std::fs::remove_file(&d).expect("unlink d");
                    std::fs::rename(&tmp, &d).expect("rename d back");
                }
                1 => {
                    exchange(&d, &evil);
                    exchange(&d, &evil);
                }
                _ => {
                    exchange(&d, &evil_rel);
                    exchange(&d, &evil_rel);
                }
            }
            n += 1;
        }
        n
    };
    run_race(&mut k, "local swapper", swapper);
}

#[test]
fn rename_racing_lookups_by_a_second_client_never_escapes() {
    let mut k = Kilnd::start(false, plant_race);
    let c2 = k.client();
    let outside = k.outside.to_str().expect("utf-8").to_owned();
    // Another client does the same swaps over the wire (making its own symlinks, absolute and
    // relative), and also moves race/d into race/deep and back.
    let swapper = |stop: &AtomicBool| {
        let ex = libc::RENAME_EXCHANGE;
        let mut n = 0;
        while n < MAX_SWAPS && !stop.load(Ordering::Relaxed) {
            let target = if n % 2 == 0 {
                outside.as_str()
            } else {
                "../../outside"
            };
            block_on(async {
                match n % 5 {
                    0 | 1 => {
                        c2.rename("race/d", "race/d.tmp", 0).await?;
                        c2.symlink(target, "race/d").await?;
                        c2.unlink("race/d").await?;
                        c2.rename("race/d.tmp", "race/d", 0).await
                    }
                    2 => {
                        c2.rename("race/d", "race/evil", ex).await?;
                        c2.rename("race/d", "race/evil", ex).await
                    }
                    3 => {
                        c2.rename("race/d", "race/evil-rel", ex).await?;
                        c2.rename("race/d", "race/evil-rel", ex).await
                    }
                    _ => {
                        c2.rename("race/d", "race/deep/d", 0).await?;
                        c2.rename("race/deep/d", "race/d", 0).await
                    }
                }
            })
            .unwrap_or_else(|e| panic!("swap {n}: {e}"));
            n += 1;
        }
        n
    };
    run_race(&mut k, "client swapper", swapper);
}

/// The brick's own records (`.kiln/pending.log`, kept by the marks layer of a replicated
/// volume's brick): a local user plants symlinks there that point out, then a client records a
/// pending mark (or kilnd starts and compacts the log). Nothing outside may change.
#[test]
fn marks_state_dir_symlinks_planted_in_the_brick_are_not_followed() {
    let mark = kiln_layer::marks::Mark {
        target: 1,
        offset: 0,
        len: 4096,
    };
    let mut escapes = Vec::new();

    // `.kiln` itself a symlink to the outside directory, planted before kilnd starts (the log
    // would be created there): kilnd refuses to start the brick, and says why.
    {
        let tmp = tempfile::tempdir().expect("tempdir");
        let brick = tmp.path().join("brick");
        let outside = tmp.path().join("outside");
        for d in [&brick, &outside] {
            std::fs::create_dir(d).expect("mkdir");
        }
        populate_outside(&outside);
        symlink(&outside, brick.join(".kiln")).expect("plant .kiln");
        let before = snapshot(&[&outside]);
        let vf = tmp.path().join("brick.toml");
        let v = kiln_server::replica_volfile(&brick, "brick");
        std::fs::write(&vf, v.to_toml()).expect("volfile");
        let log = tmp.path().join("kilnd.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_kilnd"))
            .arg("--volfile")
            .arg(&vf)
            .args(["--listen", "tcp:127.0.0.1:0", "--metrics", "off"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn kilnd");
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait kilnd") {
                break Some(s);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = std::fs::read_to_string(&log).unwrap_or_default();
        eprintln!("marks, .kiln -> outside before start: {status:?}\n{err}");
        assert!(
            status.is_some_and(|s| !s.success())
                && err.contains("refusing .kiln")
                && err.contains("symbolic link"),
            "kilnd started a brick whose .kiln is a symlink to outside ({status:?}):\n{err}"
        );
        let d = diff(&before, &snapshot(&[&outside]));
        if !d.is_empty() {
            escapes.push(format!(".kiln -> outside, before start:\n{}", d.join("\n")));
        }
    }

    let mut run = |what: &str, k: &mut Kilnd, before: &Snap| {
        let c = std::sync::Arc::new(k.client());
        let (fh, _) = block_on(c.create("f", libc::O_RDWR, 0o644)).expect("create f");
        block_on(c.close(fh)).expect("close");
        let pc = kiln_client::protocol::ProtocolClient::new("marks", c);
        let r = block_on(kiln_layer::Layer::mark_add(
            &pc,
            &kiln_layer::Ctx::NONE,
            "f",
            &mark,
        ));
        eprintln!("marks, {what}: adding a mark: {r:?}");
        let d = diff(before, &k.watched());
        if !d.is_empty() {
            escapes.push(format!("{what}:\n{}", d.join("\n")));
        }
        k.assert_serves("after-marks");
    };

    // `.kiln` itself a symlink to the outside directory, planted while kilnd runs and before
    // the first mark: the log is created there.
    let mut k = Kilnd::start(true, |_, _| {});
    let before = k.watched();
    symlink(&k.outside, k.brick.join(".kiln")).expect("plant .kiln");
    run(".kiln -> outside", &mut k, &before);
    assert_marks_refusal_logged(&k, "refusing .kiln in the brick: it is a symbolic link");
    drop(k);

    // `.kiln/pending.log` a symlink to an outside file, planted while kilnd runs: records are
    // appended to that file.
    let mut k = Kilnd::start(true, |_, _| {});
    let before = k.watched();
    std::fs::create_dir(k.brick.join(".kiln")).expect(".kiln");
    symlink(k.outside.join("secret"), k.brick.join(".kiln/pending.log")).expect("plant log");
    run(".kiln/pending.log -> outside/secret", &mut k, &before);
    assert_marks_refusal_logged(&k, "refusing .kiln/pending.log in the brick");
    drop(k);

    // `.kiln/pending.log.new` (the compaction's temporary file at start) a symlink to an
    // outside file, planted before kilnd starts: the file is truncated and rewritten.
    let mut before = None;
    let mut k = Kilnd::start(true, |brick, out| {
        before = Some(snapshot(&[out]));
        std::fs::create_dir(brick.join(".kiln")).expect(".kiln");
        std::fs::write(brick.join(".kiln/pending.log"), b"").expect("empty log");
        symlink(out.join("secret"), brick.join(".kiln/pending.log.new")).expect("plant tmp");
    });
    let mut before = before.expect("planted");
    before.extend(snapshot(&[&k.cwd]));
    run(".kiln/pending.log.new -> outside/secret", &mut k, &before);
    // The planted link was removed (not followed) and the log compacted in its place.
    let tmp = std::fs::symlink_metadata(k.brick.join(".kiln/pending.log.new"));
    assert!(tmp.is_err(), "pending.log.new left behind: {tmp:?}");
    let log = std::fs::symlink_metadata(k.brick.join(".kiln/pending.log")).expect("log");
    assert!(log.file_type().is_file() && log.len() > 0, "{log:?}");

    assert!(
        escapes.is_empty(),
        "the marks layer wrote outside the brick:\n{}",
        escapes.join("\n\n")
    );
}

/// Checks kilnd logged why the marks layer refused its state files.
fn assert_marks_refusal_logged(k: &Kilnd, what: &str) {
    let log = std::fs::read_to_string(&k.log).unwrap_or_default();
    assert!(
        log.contains("cannot record a pending mark") && log.contains(what),
        "no {what:?} in kilnd's log:\n{log}"
    );
}
