//! The Volumes issue's "distribute over 4 bricks" check, through a FUSE mount: 10,000 files
//! created with plain `std::fs` calls on a mounted distribute volume land on every brick (none
//! above 35%), each on exactly one brick and on the one its name hashes to, and a second,
//! cold mount finds every one by lookup, reads each small file with its open alone (no READ
//! anywhere), and lists every name exactly once.
//!
//! The graphs are the ones the management daemon makes: each brick runs
//! `mgmt::brick_volfile` (io-stats → marks → dispatch → posix) through kilnd's own entry point
//! (`kilnd::main`, the code `kilnd --volfile F --listen tcp:… --secret-file S`
//! runs) on TCP with the volume's secret, and the mount's stack is `mgmt::client_volfile`, what
//! `kiln mount HOST:/VOL` fetches (io-stats → distribute → one protocol-client per brick). The
//! bricks run in this process, not as spawned `kilnd` processes: kiln-fuse's tests have no
//! `CARGO_BIN_EXE_kilnd`, and a binary left in the target directory may be stale.

use std::ffi::OsString;
use std::io::ErrorKind;
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kiln_client::volume::layer::distribute::{name_hash, Layout};
use kiln_client::Volume;
use kiln_fuse::Mode;
use kiln_mgmt::{self as mgmt, BrickDef, VolState, VolumeDef};
use kilnd::ServeArgs;

const VOLUME: &str = "fdist";
const BRICKS: usize = 4;
const IN_ROOT: usize = 9_000;
const IN_SUB: usize = 1_000;
const TOTAL: usize = IN_ROOT + IN_SUB;
/// No brick may hold more than this share of the files, in percent.
const MAX_SHARE_PCT: usize = 35;

/// File `i`'s path relative to the mount (and to the brick that holds it).
fn rel(i: usize) -> String {
    if i < IN_ROOT {
        format!("f{i:05}.txt")
    } else {
        format!("sub/s{:04}.txt", i - IN_ROOT)
    }
}

/// File `i`'s content: a few dozen bytes that name it, so no two files are alike.
fn content(i: usize) -> String {
    format!("{}: file {i} of {TOTAL} on {VOLUME}\n", rel(i))
}

/// A port nobody listens on now (the brick binds it a moment later; a loser of that race is
/// retried on another).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Runs brick `i` of the volume as kilnd runs it, in a thread of this process, and returns
/// its TCP port once it accepts connections. The thread serves until the process exits.
fn start_brick(tmp: &Path, i: usize, dir: &Path, secret: &Path) -> u16 {
    let vf = tmp.join(format!("brick{i}.toml"));
    let def = VolumeDef {
        name: VOLUME.into(),
        id: "fuse-distribute-test".into(),
        replica: 1,
        bricks: Vec::new(),
        state: VolState::Started,
        shard_block: None,
        ..VolumeDef::default()
    };
    std::fs::write(
        &vf,
        mgmt::brick_volfile(&def, i, dir)
            .expect("brick volfile")
            .to_toml(),
    )
    .expect("brick volfile");
    for _attempt in 0..5 {
        let port = free_port();
        let argv: Vec<OsString> = vec![
            "kilnd".into(),
            "--volfile".into(),
            vf.clone().into(),
            "--listen".into(),
            format!("tcp:127.0.0.1:{port}").into(),
            "--secret-file".into(),
            secret.into(),
            "--metrics".into(),
            "off".into(),
        ];
        let args = ServeArgs::try_parse_from(argv).expect("kilnd arguments");
        let server = std::thread::Builder::new()
            .name(format!("kilnd-brick{i}"))
            .spawn(move || kilnd::main(args))
            .expect("brick thread");
        let deadline = Instant::now() + Duration::from_secs(15);
        while !server.is_finished() {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return port;
            }
            assert!(
                Instant::now() < deadline,
                "brick {i} did not listen in time"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // It exited: most likely the port was taken in between. Another one.
    }
    panic!("brick {i} did not start (see its messages above)");
}

/// A FUSE mount of a client stack, unmounted when dropped — also when the test fails.
struct Mount {
    session: Option<fuser::BackgroundSession>,
    dir: PathBuf,
}

impl Mount {
    fn new(vf: &kiln_server::Volfile, secret: &[u8], dir: &Path) -> Mount {
        std::fs::create_dir_all(dir).expect("mount point");
        let vol = Volume::from_volfile_with_secret(vf, Some(secret)).expect("client stack");
        let session = kiln_fuse::mount_background(
            Arc::new(vol),
            &format!("127.0.0.1:/{VOLUME}"),
            dir,
            Mode::General,
            Duration::from_secs(1),
            16,
        )
        .expect("mount");
        Mount {
            session: Some(session),
            dir: dir.to_owned(),
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if let Err(e) = s.umount_and_join() {
                eprintln!("unmount {}: {e}; detaching it", self.dir.display());
                let c = std::ffi::CString::new(self.dir.as_os_str().as_bytes()).expect("path");
                // SAFETY: a valid NUL-terminated path.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

/// Regular files under a brick directory (paths relative to it), leaving out the brick's own
/// records (`.kiln`).
fn files_on_brick(brick: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![brick.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read brick dir") {
            let e = e.expect("brick dir entry");
            if e.file_name().as_bytes().starts_with(b".kiln") {
                continue;
            }
            let t = e.file_type().expect("file type");
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                let p = e.path();
                let r = p.strip_prefix(brick).expect("under the brick");
                out.push(r.to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// Calls of fop `op` counted by this process's io-stats points whose name `pick` accepts.
fn calls(pick: impl Fn(&str) -> bool, op: &str) -> u64 {
    let mut n = 0;
    for p in kiln_client::volume::layer::iostats::points() {
        if pick(p.name()) {
            p.for_each_fop(|name, calls, _, _, _| {
                if name == op {
                    n += calls;
                }
            });
        }
    }
    n
}

/// The mount's (the client stack's io-stats is named after the volume).
fn client_calls(op: &str) -> u64 {
    calls(|name| name == VOLUME, op)
}

/// The bricks' (`VOLUME-brick-N`).
fn brick_calls(op: &str) -> u64 {
    calls(|name| name.starts_with(&format!("{VOLUME}-brick-")), op)
}

/// Every name of a directory through the mount, in readdir order.
fn list(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("readdir {}: {e}", dir.display()))
        .map(|e| {
            let e = e.expect("readdir entry");
            e.file_name().to_string_lossy().into_owned()
        })
        .collect()
}

/// Sorted; panics naming the first name seen twice.
fn sorted_once(mut names: Vec<String>, what: &str) -> Vec<String> {
    names.sort();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        panic!("{what}: {} listed more than once", w[0]);
    }
    names
}

#[test]
fn ten_thousand_files_through_the_mount_spread_over_four_bricks() {
    if std::env::var_os("KILN_LOG").is_none() {
        // The bricks log to this process's stderr; their start-up chatter is noise here.
        std::env::set_var("KILN_LOG", "warn");
    }
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let secret_file = tmp.path().join("volume.secret");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    let secret = format!("{nanos:064x}");
    std::fs::write(&secret_file, format!("{secret}\n")).expect("secret");

    // Four bricks, each as `kilnd --volfile` runs the brick stack the management daemon writes.
    let mut bricks = Vec::new();
    for i in 0..BRICKS {
        let dir = tmp.path().join(format!("brick{i}"));
        std::fs::create_dir(&dir).expect("brick dir");
        let port = start_brick(tmp.path(), i, &dir, &secret_file);
        bricks.push(BrickDef {
            host: "127.0.0.1".into(),
            mgmt_port: None,
            dir,
            port: Some(port),
            pid: None,
            metrics_port: None,
            settled: true,
            removed: false,
        });
    }
    // The client graph `kiln mount 127.0.0.1:/fdist` would fetch for this volume.
    let def = VolumeDef {
        name: VOLUME.into(),
        id: "fuse-distribute-test".into(),
        replica: 1,
        bricks: bricks.clone(),
        state: VolState::Started,
        shard_block: None,
        ..VolumeDef::default()
    };
    let vf = mgmt::client_volfile(&def).expect("client volfile");
    let kinds: Vec<&str> = vf.layers.iter().map(|l| l.kind.type_name()).collect();
    assert_eq!(
        kinds,
        ["io-stats", "distribute"]
            .into_iter()
            .chain(["protocol-client"; BRICKS])
            .collect::<Vec<_>>(),
        "the volume's graph"
    );
    let bricks: Vec<PathBuf> = bricks.into_iter().map(|b| b.dir).collect();
    let started = t0.elapsed();

    // Create every file through the mount.
    let t = Instant::now();
    {
        let m = Mount::new(&vf, secret.as_bytes(), &tmp.path().join("mnt"));
        std::fs::create_dir(m.path("sub")).expect("mkdir sub through the mount");
        for i in 0..TOTAL {
            let p = m.path(&rel(i));
            std::fs::write(&p, content(i))
                .unwrap_or_else(|e| panic!("create {} through the mount: {e}", p.display()));
        }
    } // unmounted: the writer's caches are gone
    let created = t.elapsed();

    // On the bricks' disks: every file exactly once, on the brick its name hashes to.
    let t = Instant::now();
    let on: Vec<Vec<String>> = bricks.iter().map(|b| files_on_brick(b)).collect();
    let counts: Vec<usize> = on.iter().map(Vec::len).collect();
    eprintln!(
        "files per brick: {}",
        counts
            .iter()
            .enumerate()
            .map(|(i, n)| format!("brick{i} {n} ({:.1}%)", *n as f64 * 100.0 / TOTAL as f64))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut all = sorted_once(on.concat(), "the bricks together");
    let mut want: Vec<String> = (0..TOTAL).map(rel).collect();
    want.sort();
    assert_eq!(
        counts.iter().sum::<usize>(),
        TOTAL,
        "brick counts {counts:?}"
    );
    if all != want {
        all.retain(|p| want.binary_search(p).is_err());
        all.truncate(20);
        panic!("the bricks hold other files than those created, e.g. {all:?}");
    }
    for (i, n) in counts.iter().enumerate() {
        assert!(*n > 0, "brick{i} holds no file: {counts:?}");
        assert!(
            n * 100 <= TOTAL * MAX_SHARE_PCT,
            "brick{i} holds {n} of {TOTAL} files, above {MAX_SHARE_PCT}%: {counts:?}"
        );
    }
    for (i, b) in bricks.iter().enumerate() {
        assert!(b.join("sub").is_dir(), "the directory is on brick{i} too");
    }
    // One layout for every directory: the volume's.
    let layout = Layout::equal(BRICKS);
    for (i, files) in on.iter().enumerate() {
        for f in files {
            let name = f.strip_prefix("sub/").unwrap_or(f.as_str());
            assert_eq!(
                layout.subvol(name_hash(name)),
                i,
                "{f} is on brick{i}, not on the brick its name hashes to"
            );
        }
    }
    let scanned = t.elapsed();

    // A second mount, with cold caches in the kernel and in the stack: every stat is a lookup
    // through distribute.
    let m = Mount::new(&vf, secret.as_bytes(), &tmp.path().join("mnt2"));
    let t = Instant::now();
    for i in 0..TOTAL {
        let p = m.path(&rel(i));
        match std::fs::metadata(&p) {
            Ok(md) => {
                assert!(md.is_file(), "{} is not a file", p.display());
                assert_eq!(md.len(), content(i).len() as u64, "size of {}", p.display());
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                panic!("lookup did not find {}", p.display())
            }
            Err(e) => panic!("lookup {}: {e}", p.display()),
        }
    }
    let looked_up = t.elapsed();
    let t = Instant::now();
    let (reads, bricks_read) = (client_calls("read"), brick_calls("read"));
    for i in (0..TOTAL).step_by(20) {
        let p = m.path(&rel(i));
        let got =
            std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
        assert_eq!(got, content(i), "content of {}", p.display());
    }
    let read = t.elapsed();
    // Each file came whole with its open, from the brick distribute routed the open to,
    // which read it once.
    assert_eq!(client_calls("read"), reads, "small files need no READ");
    assert_eq!(
        brick_calls("read"),
        bricks_read + (TOTAL / 20) as u64,
        "one read of each file on the brick that holds it"
    );

    // readdir lists every name exactly once.
    let t = Instant::now();
    let root = sorted_once(list(&m.dir), "readdir of the root");
    let mut want_root: Vec<String> = (0..IN_ROOT).map(rel).chain(["sub".into()]).collect();
    want_root.sort();
    assert_eq!(root.len(), want_root.len(), "entries in the root");
    assert!(root == want_root, "the root lists other names than created");
    let sub = sorted_once(list(&m.path("sub")), "readdir of sub");
    let mut want_sub: Vec<String> = (IN_ROOT..TOTAL)
        .map(|i| rel(i)["sub/".len()..].to_owned())
        .collect();
    want_sub.sort();
    assert_eq!(sub.len(), want_sub.len(), "entries in sub");
    assert!(sub == want_sub, "sub lists other names than created");
    let listed = t.elapsed();
    drop(m);

    eprintln!(
        "wall time {:.2?}: bricks up {started:.2?}, create {TOTAL} files {created:.2?} \
         ({:.0} files/s), brick scan {scanned:.2?}, cold lookup of all {looked_up:.2?}, \
         read {} {read:.2?}, readdir {listed:.2?}",
        t0.elapsed(),
        TOTAL as f64 / created.as_secs_f64(),
        TOTAL / 20,
    );
}
