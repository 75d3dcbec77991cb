//! A mount of a volume graph, not just one brick: a volfile with `distribute` over two bricks
//! (both in this process). Files written through the mount read back, list, and land on the
//! bricks — spread over both; a 1 MiB scatter-gather O_DIRECT read and write each stay one
//! request to the brick that holds the file; the stack's io-stats point shows in `/metrics`.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_client::volume::Volfile;
use kiln_client::Volume;
use kiln_fuse::Mode;
use kiln_proto::Op;
use kiln_server::{Listen, Stats};

struct Bricks {
    dir: tempfile::TempDir,
    stats: Vec<Arc<Stats>>,
    socks: Vec<PathBuf>,
}

fn two_bricks() -> Bricks {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut stats = Vec::new();
    let mut socks = Vec::new();
    for i in 0..2 {
        let brick = dir.path().join(format!("brick{i}"));
        std::fs::create_dir(&brick).expect("brick dir");
        let sock = dir.path().join(format!("b{i}.sock"));
        let server = kiln_server::spawn_background(&brick, &[Listen::Unix(sock.clone())])
            .expect("brick server");
        stats.push(server.stats);
        socks.push(sock);
    }
    std::fs::create_dir(dir.path().join("mnt")).expect("mnt");
    Bricks { dir, stats, socks }
}

fn dist_volfile(top: &str, socks: &[PathBuf]) -> String {
    let remotes: Vec<String> = socks
        .iter()
        .map(|s| format!("unix:{}", s.display()))
        .collect();
    kiln_testkit::volfile::distribute(top, &remotes)
}

struct Mount {
    session: Option<fuser::BackgroundSession>,
    mnt: PathBuf,
}

impl Mount {
    fn new(volfile: &str, mnt: &Path, mode: Mode) -> Mount {
        let v = Volfile::parse(volfile).expect("volfile parses");
        let vol = Volume::from_volfile(&v).expect("stack builds");
        let session = kiln_fuse::mount_background(
            Arc::new(vol),
            "test:/dist",
            mnt,
            mode,
            Duration::from_secs(1),
            4,
        )
        .expect("mount");
        Mount {
            session: Some(session),
            mnt: mnt.to_owned(),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
    }
}

fn content(i: usize) -> Vec<u8> {
    let len = 1000 + i * 3571 % 70_000;
    (0..len).map(|k| (k * 31 + i * 7) as u8).collect()
}

/// Regular files under `dir` (relative paths), skipping the brick's own `.kiln` records.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read brick dir") {
            let e = e.expect("entry");
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".kiln") {
                continue;
            }
            let t = e.file_type().expect("type");
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(
                    e.path()
                        .strip_prefix(dir)
                        .expect("under dir")
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
    }
    out.sort();
    out
}

#[test]
fn distribute_over_two_bricks_through_the_mount() {
    let b = two_bricks();
    let mnt = b.dir.path().join("mnt");
    let m = Mount::new(&dist_volfile("fusedist", &b.socks), &mnt, Mode::General);

    std::fs::create_dir(m.mnt.join("sub")).expect("mkdir through the mount");
    let mut names = Vec::new();
    for i in 0..48 {
        let rel = if i % 3 == 0 {
            format!("sub/file-{i}.bin")
        } else {
            format!("file-{i}.bin")
        };
        std::fs::write(m.mnt.join(&rel), content(i)).expect("write through the mount");
        names.push(rel);
    }
    for (i, rel) in names.iter().enumerate() {
        assert_eq!(
            std::fs::read(m.mnt.join(rel)).expect("read back"),
            content(i),
            "{rel} reads back"
        );
        assert_eq!(
            std::fs::metadata(m.mnt.join(rel)).expect("stat").len(),
            content(i).len() as u64
        );
    }
    let mut listed: Vec<String> = std::fs::read_dir(&m.mnt)
        .expect("list the mount")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    listed.sort();
    let mut want: Vec<String> = names
        .iter()
        .filter(|n| !n.starts_with("sub/"))
        .cloned()
        .chain(["sub".to_owned()])
        .collect();
    want.sort();
    assert_eq!(
        listed, want,
        "the root lists every file once, and the directory"
    );

    // Every file is on exactly one brick, with its data, and both bricks hold some.
    let on: Vec<Vec<String>> = (0..2)
        .map(|i| files_under(&b.dir.path().join(format!("brick{i}"))))
        .collect();
    let mut all: Vec<String> = on.concat();
    all.sort();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(all, sorted, "each file on exactly one brick");
    for (i, rel) in names.iter().enumerate() {
        let brick = if on[0].contains(rel) { 0 } else { 1 };
        let path = b.dir.path().join(format!("brick{brick}")).join(rel);
        assert_eq!(std::fs::read(path).expect("brick file"), content(i));
    }
    assert!(
        !on[0].is_empty() && !on[1].is_empty(),
        "files spread over both bricks: {} and {}",
        on[0].len(),
        on[1].len()
    );

    // Rename and unlink reach the right brick.
    std::fs::rename(m.mnt.join("file-1.bin"), m.mnt.join("renamed.bin")).expect("rename");
    assert_eq!(
        std::fs::read(m.mnt.join("renamed.bin")).expect("read renamed"),
        content(1)
    );
    for rel in &names[2..] {
        std::fs::remove_file(m.mnt.join(rel)).expect("unlink");
    }
    assert!(!m.mnt.join("file-2.bin").exists());

    // The stack's io-stats point is in this process's /metrics.
    let text = kiln_client::volume::layer::metrics::render("kiln-mount");
    let writes = text
        .lines()
        .find(|l| {
            l.starts_with("kiln_fop_calls_total{")
                && l.contains("layer=\"fusedist\"")
                && l.contains("fop=\"write\"")
        })
        .unwrap_or_else(|| panic!("no write counter of point fusedist in:\n{text}"));
    let n: u64 = writes
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("a count");
    assert!(n >= 48, "{writes}");
}

/// A page-aligned buffer, as O_DIRECT wants.
struct Aligned(Vec<u8>, usize);

impl Aligned {
    fn new(len: usize) -> Aligned {
        let v = vec![0u8; len + 4096];
        let off = v.as_ptr().align_offset(4096);
        Aligned(v, off)
    }
    fn slice(&mut self) -> &mut [u8] {
        let off = self.1;
        let len = self.0.len() - 4096;
        &mut self.0[off..off + len]
    }
    fn iovecs(&mut self) -> Vec<libc::iovec> {
        let base = self.slice().as_mut_ptr();
        (0..256)
            .map(|i| libc::iovec {
                iov_base: base.wrapping_add(i * 4096).cast(),
                iov_len: 4096,
            })
            .collect()
    }
}

#[test]
fn scatter_gather_direct_io_is_one_request_on_a_distributed_volume() {
    let b = two_bricks();
    let mnt = b.dir.path().join("mnt");
    let m = Mount::new(&dist_volfile("fusedio", &b.socks), &mnt, Mode::VmImage);
    let calls = |op| b.stats.iter().map(|s| s.calls(op)).sum::<u64>();
    for name in ["a.img", "b.img", "c.img", "d.img"] {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(m.mnt.join(name))
            .expect("open O_DIRECT");
        let mut src = Aligned::new(1 << 20);
        for (i, x) in src.slice().iter_mut().enumerate() {
            *x = (i as u32).wrapping_mul(2654435761).to_le_bytes()[2] ^ name.as_bytes()[0];
        }
        let (w0, r0) = (calls(Op::Write), calls(Op::Read));
        let iov = src.iovecs();
        // SAFETY: 256 valid iovecs over `src`.
        let n = unsafe { libc::pwritev(f.as_raw_fd(), iov.as_ptr(), 256, 0) };
        assert_eq!(n, 1 << 20, "pwritev: {}", std::io::Error::last_os_error());
        assert_eq!(calls(Op::Write) - w0, 1, "one WRITE over both bricks");
        let mut dst = Aligned::new(1 << 20);
        let iov = dst.iovecs();
        // SAFETY: 256 valid iovecs over `dst`.
        let n = unsafe { libc::preadv(f.as_raw_fd(), iov.as_ptr(), 256, 0) };
        assert_eq!(n, 1 << 20, "preadv: {}", std::io::Error::last_os_error());
        assert_eq!(calls(Op::Read) - r0, 1, "one READ over both bricks");
        assert!(src.slice() == dst.slice(), "{name}: data read back differs");
    }
}
