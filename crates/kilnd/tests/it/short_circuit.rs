//! Local short-circuit reads against a real kilnd (the replica brick stack: marks over posix)
//! and a second client in a process of its own (this test binary, run again as a helper that
//! takes commands on stdin): a reader on the brick's Unix socket reads straight from the
//! brick's file once granted, and never returns what a read through the brick would not —
//! after the other client's write, after its truncate, after a heal write — because the brick
//! bumps the grant's generation first. The reads are counted: the test fails if they never
//! went direct, if a change did not make the grant stale, or if the brick's profile does not
//! show them.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

use kiln_client::protocol::ProtocolClient;
use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::volfile::{LayerKind, Volfile};
use kiln_layer::{Ctx, Fd, Layer, ReadDst, SetAttrs};
use kiln_testkit::daemon;

const FILE: &str = "image.raw";

/// kilnd with the replica stack on a new brick, on a Unix socket and TCP.
struct Brick {
    child: Child,
    unix: String,
    tcp: String,
    dir: Option<tempfile::TempDir>,
}

impl Brick {
    fn start() -> Brick {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("brick")).unwrap();
        Brick::start_in(dir)
    }

    /// Stops the brick and starts it again on the same directory and Unix socket.
    fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let dir = self.dir.take().expect("a brick's directory");
        *self = Brick::start_in(dir);
    }

    fn start_in(dir: tempfile::TempDir) -> Brick {
        let brick = dir.path().join("brick");
        let vf = dir.path().join("brick.toml");
        std::fs::write(&vf, kiln_server::replica_volfile(&brick, "brick").to_toml()).unwrap();
        let sock = dir.path().join("brick.sock");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kilnd"));
        cmd.arg("--volfile")
            .arg(&vf)
            .args([
                "--listen",
                "tcp:127.0.0.1:0",
                "--metrics",
                "off",
                "--listen",
            ])
            .arg(format!("unix:{}", sock.display()))
            .stdin(Stdio::null());
        let (child, mut out) = daemon::spawn_piped(&mut cmd);
        let (mut unix, mut tcp) = (String::new(), String::new());
        for a in daemon::announced(&mut out, 2, false).listening {
            match a.starts_with("unix:") {
                true => unix = a,
                false => tcp = a,
            }
        }
        std::thread::spawn(move || for _ in out.lines() {});
        Brick {
            child,
            unix,
            tcp,
            dir: Some(dir),
        }
    }
}

impl Drop for Brick {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn volfile(addr: &str, short_circuit: bool) -> Volfile {
    let mut v = Volume::default_volfile(addr);
    for l in &mut v.layers {
        if let LayerKind::ProtocolClient(p) = &mut l.kind {
            p.short_circuit = Some(short_circuit);
        }
    }
    v
}

/// The other client: this binary again, running [`helper`], over TCP.
struct Other {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<std::process::ChildStdout>,
}

impl Other {
    fn start(addr: &str) -> Other {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "short_circuit::helper",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KILN_SC_HELPER", addr)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Other { child, stdin, out }
    }

    /// Runs one command and waits for its answer.
    fn run(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        loop {
            let mut line = String::new();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "helper ended on {cmd:?}"
            );
            match line.trim() {
                "ok" => return,
                l if l.starts_with("error") => panic!("helper: {cmd:?}: {l}"),
                _ => {} // the test harness's own lines
            }
        }
    }
}

impl Drop for Other {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Not a test of its own: the other client's process. Takes `write OFF LEN BYTE`,
/// `heal OFF LEN BYTE` (through a heal handle, as heal writes) and `truncate SIZE`.
#[test]
fn helper() {
    let Ok(addr) = std::env::var("KILN_SC_HELPER") else {
        return;
    };
    let vol = Volume::from_volfile(&volfile(&addr, false)).unwrap();
    let top = vol.top();
    let cx = Ctx::NONE;
    let fd = block_on(top.create(&cx, FILE, (libc::O_RDWR | libc::O_CREAT) as u32, 0o644))
        .unwrap()
        .0;
    println!("ok");
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let w: Vec<u64> = line
            .split(' ')
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        let r = match line.split(' ').next().unwrap() {
            "write" | "heal" => {
                let heal = line.starts_with("heal");
                let session = |begin| {
                    let req = kiln_layer::marks::HealReq { begin };
                    block_on(top.heal_session(&cx, FILE, &req)).unwrap();
                };
                let h = match heal {
                    true => {
                        session(kiln_layer::marks::SESSION_HEAL);
                        block_on(top.heal_open(&cx, FILE, libc::O_RDWR as u32)).unwrap()
                    }
                    false => fd.clone(),
                };
                let data = vec![w[2] as u8; w[1] as usize];
                let r = block_on(top.write(&cx, &h, w[0], kiln_layer::IoBufs::owned(vec![data])));
                if heal {
                    block_on(top.release(&cx, h)).unwrap();
                    session(kiln_layer::marks::SESSION_END);
                }
                r.map(|_| ())
            }
            "truncate" => {
                let a = SetAttrs {
                    valid: kiln_proto::ops::SETATTR_SIZE,
                    size: w[0],
                    ..Default::default()
                };
                block_on(top.fsetattr(&cx, &fd, &a)).map(|_| ())
            }
            other => panic!("unknown command {other:?}"),
        };
        match r {
            Ok(()) => println!("ok"),
            Err(e) => println!("error {e}"),
        }
    }
}

fn read(top: &dyn Layer, fd: &Fd, offset: u64, len: u32) -> Vec<u8> {
    match block_on(top.read(&Ctx::NONE, fd, offset, ReadDst::Any(len))).unwrap() {
        kiln_layer::ReadOut::Buf(b) => b,
        _ => unreachable!("asked for a buffer"),
    }
}

/// A read into the caller's own buffer (large ones are copied on the copy thread).
fn read_into(top: &dyn Layer, fd: &Fd, offset: u64, len: usize) -> Vec<u8> {
    let dst = ReadDst::Into(kiln_layer::IoBufs::owned(vec![vec![0u8; len]]));
    match block_on(top.read(&Ctx::NONE, fd, offset, dst)).unwrap() {
        kiln_layer::ReadOut::Into { n, bufs } => {
            let mut b = bufs.into_owned::<Vec<u8>>().unwrap().remove(0);
            b.truncate(n);
            b
        }
        _ => unreachable!("asked for my buffer"),
    }
}

/// Begins (or ends) a heal session of kind `begin` on FILE through `mover`, as a migration
/// does.
fn session(mover: &Volume, begin: u32) -> Result<(), u32> {
    let req = kiln_layer::marks::HealReq { begin };
    block_on(mover.top().heal_session(&Ctx::NONE, FILE, &req)).map(|_| ())
}

/// (direct reads, stale ones) of the volume's protocol-client.
fn counts(vol: &Volume) -> (u64, u64) {
    let mut c = None;
    let mut f = |l: &dyn Layer| {
        if let Some(p) = l.as_any().and_then(|a| a.downcast_ref::<ProtocolClient>()) {
            c = Some(p.short_circuit_counts());
        }
    };
    f(&**vol.top());
    vol.top().visit(&mut f);
    c.expect("a protocol-client")
}

#[test]
fn direct_reads_never_stale() {
    let brick = Brick::start();
    let mut other = Other::start(&brick.tcp);
    other.run("write 0 1048576 17");
    let vol = Volume::from_volfile(&volfile(&brick.unix, true)).unwrap();
    let top = vol.top().clone();
    let fd = block_on(top.open(&Ctx::NONE, FILE, libc::O_RDONLY as u32)).unwrap();
    // The first read goes through the brick, the second asks for a grant and reads direct.
    for _ in 0..3 {
        assert_eq!(read(&*top, &fd, 4096, 4096), vec![17u8; 4096]);
    }
    let (direct, stale) = counts(&vol);
    assert!(direct >= 2, "reads went direct: {direct}");
    assert_eq!(stale, 0);

    // Another client's write: the grant is stale, the read is right.
    other.run("write 4096 65536 34");
    assert_eq!(read(&*top, &fd, 4096, 4096), vec![34u8; 4096]);
    let (_, stale) = counts(&vol);
    assert_eq!(stale, 1, "the other client's write made the grant stale");

    // Truncate: the read after it ends where the file does now. Reads through the brick
    // until the backoff ends, then a new grant.
    other.run("truncate 6000");
    for _ in 0..40 {
        let b = read(&*top, &fd, 4096, 65536);
        assert_eq!(b, vec![34u8; 6000 - 4096], "read after truncate");
    }
    let (direct2, _) = counts(&vol);
    assert!(direct2 > direct, "granted again after the backoff");

    // A heal write (its own handle): stale again, and the read sees it.
    let (_, stale_before) = counts(&vol);
    other.run("heal 0 6000 51");
    assert_eq!(read(&*top, &fd, 0, 8192), vec![51u8; 6000]);
    let (_, stale_after) = counts(&vol);
    assert_eq!(
        stale_after,
        stale_before + 1,
        "the heal write made the grant stale"
    );

    // The brick's profile counts the direct reads once the handle closes.
    block_on(top.release(&Ctx::NONE, fd)).unwrap();
    let (direct, _) = counts(&vol);
    let c = kiln_client::Client::connect(&brick.tcp).unwrap();
    let p = c.profile(kiln_proto::ops::PROFILE_INFO).unwrap();
    let text = p.to_string();
    let calls = p["points"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|pt| {
            pt["cumulative"]["fops"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|f| f["fop"] == "localread")
        .map(|f| f["calls"].as_u64().unwrap_or(0))
        .sum::<u64>();
    assert_eq!(calls, direct, "profile counts every direct read: {text}");
}

#[test]
fn large_direct_reads_never_stale() {
    let brick = Brick::start();
    let mut other = Other::start(&brick.tcp);
    other.run("write 0 1048576 17");
    let vol = Volume::from_volfile(&volfile(&brick.unix, true)).unwrap();
    let top = vol.top().clone();
    let fd = block_on(top.open(&Ctx::NONE, FILE, libc::O_RDONLY as u32)).unwrap();
    let len = kiln_client::shortcut::LARGE * 4;
    for _ in 0..3 {
        assert_eq!(read_into(&*top, &fd, 4096, len), vec![17u8; len]);
    }
    let (direct, stale) = counts(&vol);
    assert!(direct >= 2, "large reads went direct: {direct}");
    assert_eq!(stale, 0);
    // Another client's write in the middle of the range: stale, and read right.
    other.run("write 65536 4096 34");
    let b = read_into(&*top, &fd, 0, len);
    assert_eq!(b.len(), len);
    assert!(b[..65536].iter().all(|&x| x == 17));
    assert!(
        b[65536..65536 + 4096].iter().all(|&x| x == 34),
        "saw the write"
    );
    assert!(b[65536 + 4096..].iter().all(|&x| x == 17));
    assert_eq!(counts(&vol).1, 1, "the write made the grant stale");
    // Short at the end of the file.
    other.run("truncate 100000");
    for _ in 0..40 {
        assert_eq!(
            read_into(&*top, &fd, 0, len).len(),
            100000,
            "read after truncate"
        );
    }
    assert!(counts(&vol).0 > direct, "granted again after the backoff");
}

#[test]
fn off_and_over_tcp_read_through_the_brick() {
    let brick = Brick::start();
    let mut other = Other::start(&brick.tcp);
    other.run("write 0 65536 7");
    for (addr, on) in [(&brick.unix, false), (&brick.tcp, true)] {
        let vol = Volume::from_volfile(&volfile(addr, on)).unwrap();
        let top = vol.top().clone();
        let fd = block_on(top.open(&Ctx::NONE, FILE, libc::O_RDONLY as u32)).unwrap();
        for _ in 0..4 {
            assert_eq!(read(&*top, &fd, 0, 4096), vec![7u8; 4096]);
        }
        assert_eq!(counts(&vol), (0, 0), "{addr} short-circuit {on}");
    }
}

/// A pinned file (FUSE passthrough's grant) may not begin to move: the brick says `EBUSY`
/// until the pinning handle is released.
#[test]
fn a_pinned_file_is_not_moved() {
    let brick = Brick::start();
    let mut other = Other::start(&brick.tcp);
    other.run("write 0 65536 9");
    let local = Volume::from_volfile(&volfile(&brick.unix, true)).unwrap();
    let fd = block_on(local.open(FILE, libc::O_RDONLY)).unwrap();
    let file = block_on(local.pin_local(&fd)).expect("a local file without replicas is pinned");
    let mut b = [0u8; 4];
    assert_eq!(rustix::io::pread(&file, &mut b, 0).unwrap(), 4);
    assert_eq!(b, [9; 4], "the pinned descriptor reads the file");

    let mover = Volume::from_volfile(&volfile(&brick.tcp, false)).unwrap();
    let begin = |begin| session(&mover, begin);
    assert_eq!(
        begin(kiln_layer::marks::SESSION_MIGRATE),
        Err(libc::EBUSY as u32),
        "a migration of a pinned file is refused"
    );
    block_on(local.close(fd)).unwrap();
    begin(kiln_layer::marks::SESSION_MIGRATE).expect("unpinned: the move may begin");
    // While the move runs, no pin (and no grant) is given: its reader could not follow.
    let fd = block_on(local.open(FILE, libc::O_RDONLY)).unwrap();
    let e = block_on(local.pin_local(&fd)).expect_err("no pin while the file moves");
    assert_eq!(e.raw_os_error(), Some(libc::EBUSY), "{e}");
    begin(kiln_layer::marks::SESSION_END).unwrap();
    block_on(local.pin_local(&fd)).expect("the move gave up: pinned again");
}

#[test]
fn a_pin_survives_a_brick_restart() {
    let mut brick = Brick::start();
    Other::start(&brick.tcp).run("write 0 65536 9");
    let local = Volume::from_volfile(&volfile(&brick.unix, true)).unwrap();
    let fd = block_on(local.open(FILE, libc::O_RDONLY)).unwrap();
    let _file = block_on(local.pin_local(&fd)).expect("pinned");
    brick.restart();
    // The next fop finds the connection gone and waits for the reconnect, which pins the
    // file again before it tells anyone.
    let other = block_on(local.open(FILE, libc::O_RDONLY)).unwrap();
    let mover = Volume::from_volfile(&volfile(&brick.tcp, false)).unwrap();
    let begin = |begin| session(&mover, begin);
    assert_eq!(
        begin(kiln_layer::marks::SESSION_MIGRATE),
        Err(libc::EBUSY as u32),
        "pinned again after the brick restarted"
    );
    block_on(local.close(fd)).unwrap();
    block_on(local.close(other)).unwrap();
    begin(kiln_layer::marks::SESSION_MIGRATE).expect("unpinned: the move may begin");
}

#[test]
fn a_damaged_block_is_never_read_direct() {
    use std::os::unix::fs::FileExt;
    let brick = Brick::start();
    let mut other = Other::start(&brick.tcp);
    other.run("write 0 1048576 17");
    let vol = Volume::from_volfile(&volfile(&brick.unix, true)).unwrap();
    let top = vol.top().clone();
    let fd = block_on(top.open(&Ctx::NONE, FILE, libc::O_RDONLY as u32)).unwrap();
    for _ in 0..3 {
        assert_eq!(read(&*top, &fd, 8192, 4096), vec![17u8; 4096]);
    }
    let (direct, _) = counts(&vol);
    assert!(direct >= 2, "reads went direct: {direct}");
    // Bytes flipped in the brick's file behind its back (a disk gone bad): no grant is bumped.
    let path = brick.dir.as_ref().unwrap().path().join("brick").join(FILE);
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&[99u8; 8], 8192 + 100).unwrap();
    let small = block_on(top.read(&Ctx::NONE, &fd, 8192, ReadDst::Any(4096)));
    assert_eq!(
        small.err(),
        Some(kiln_layer::errno::ECKSUM),
        "a damaged block read"
    );
    // Unaligned, covering the damaged block in part; and a large read into the caller's memory.
    let part = block_on(top.read(&Ctx::NONE, &fd, 8192 + 50, ReadDst::Any(100)));
    assert_eq!(
        part.err(),
        Some(kiln_layer::errno::ECKSUM),
        "part of a damaged block read"
    );
    let len = kiln_client::shortcut::LARGE * 4;
    let dst = ReadDst::Into(kiln_layer::IoBufs::owned(vec![vec![0u8; len]]));
    let large = block_on(top.read(&Ctx::NONE, &fd, 0, dst));
    assert_eq!(
        large.err(),
        Some(kiln_layer::errno::ECKSUM),
        "a large read over it"
    );
    // The blocks around it still read, straight from the file.
    let before = counts(&vol).0;
    for _ in 0..40 {
        assert_eq!(read(&*top, &fd, 65536, 4096), vec![17u8; 4096]);
    }
    assert!(
        counts(&vol).0 > before,
        "undamaged blocks are read direct again"
    );
}
