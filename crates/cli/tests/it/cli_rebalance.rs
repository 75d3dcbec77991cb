//! Elastic volumes under I/O: a 1x3 volume grows to 2x3 and a rebalance moves files to the new
//! set, then the first set is removed (drained by a rebalance, then committed) — while a
//! mounted fsx-style exerciser, a fio verify loop on the mount and another on an NBD export run
//! on files that migrate. Every file moves at least once (to set 1 when it hashes there, off
//! set 0 when that set goes). Nothing may fail; the removed bricks end up holding no file, and
//! every file's three copies are identical.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::common;
use common::fio::{need_fio, FioLoop};
use common::fsx::Fsx;
use common::managed::Vol;
use common::{brick_files, BrickReaper};

fn content(i: usize) -> Vec<u8> {
    format!("small file {i}\n").repeat(i % 40 + 1).into_bytes()
}

/// A name like `stem{n}.ext` that the two-set layout places on set 1: a file the grow's
/// rebalance moves while it is open.
fn on_second_set(stem: &str, ext: &str) -> String {
    use kiln_layer::distribute::{name_hash, Layout};
    let two = Layout::over(&[0, 1]);
    (0..)
        .map(|n| format!("{stem}{n}.{ext}"))
        .find(|n| two.subvol(name_hash(n)) == 1)
        .unwrap()
}

/// A qemu-io session on an NBD export, held open while the test disturbs the volume.
struct QemuIo {
    child: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl QemuIo {
    fn open(uri: &str) -> QemuIo {
        let mut child = std::process::Command::new("qemu-io")
            .args(["-f", "raw", uri])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("run qemu-io");
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        QemuIo { child, out }
    }

    /// Sends `cmd` and returns its output, up to the line that says how it went.
    fn run(&mut self, cmd: &str, done: &str) -> String {
        use std::io::{BufRead, Write};
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        let mut said = String::new();
        loop {
            let mut line = String::new();
            let n = self.out.read_line(&mut line).unwrap();
            assert!(n > 0, "qemu-io ended after {cmd:?}: {said}");
            said.push_str(&line);
            if line.contains(done) || line.contains("failed") || line.contains("error") {
                return said;
            }
        }
    }
}

impl Drop for QemuIo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The options `Vol::mgmt` adds, for a command expected to fail.
fn mgmt_opts(v: &Vol) -> Vec<&str> {
    vec![
        "--server",
        v.kd.addr.as_str(),
        "--state-dir",
        v.state.to_str().unwrap(),
    ]
}

#[test]
fn grow_rebalance_and_shrink_while_clients_write_and_verify() {
    need_fio();
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::with_bricks(tmp.path(), "rb", 3, 3, &["--brick-port-base", "25400"]);
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let log = tmp.path().join("mount.log");
    let log_s = log.display().to_string();
    let env = [
        ("KILN_LOG", "warn,kiln_client::graph=info"),
        ("KILN_GRAPH_POLL_MS", "100"),
        ("KILN_TEST_STDERR", log_s.as_str()),
    ];
    let _mount = v.mount_env(&mnt, &env);
    let small: Vec<String> = (0..300).map(|i| format!("d{}/f{i}", i % 7)).collect();
    for d in 0..7 {
        std::fs::create_dir_all(mnt.join(format!("d{d}"))).unwrap();
    }
    for (i, f) in small.iter().enumerate() {
        std::fs::write(mnt.join(f), content(i)).unwrap();
    }
    let image = on_second_set("disk", "img");
    let exercised = on_second_set("fsx", "bin");
    let disk = std::fs::File::create(mnt.join(&image)).unwrap();
    disk.set_len(64 << 20).unwrap();
    drop(disk);
    let nlog = tmp.path().join("nbd.log");
    let nlog_s = nlog.display().to_string();
    let nenv = [
        ("KILN_LOG", "warn,kiln_client::graph=info"),
        ("KILN_GRAPH_POLL_MS", "100"),
        ("KILN_TEST_STDERR", nlog_s.as_str()),
    ];
    let (_nbd, uri) = v.nbd_env(&format!("/{image}"), &tmp.path().join("nbd.sock"), &nenv);
    // A session held open across the grow: its image moves under it. (fio's loop on the same
    // export writes the first 2 MiB.)
    let mut held = QemuIo::open(&uri);
    let said = held.run("write -P 0x5a 32M 1M", "wrote");
    assert!(said.contains("wrote 1048576/1048576"), "{said}");
    // A file held open on the mount the same way.
    let held_name = on_second_set("held", "txt");
    std::fs::write(mnt.join(&held_name), b"held file\n").unwrap();
    let held_file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(mnt.join(&held_name))
        .unwrap();
    // It runs all along, at least 100,000 operations (a debug build, as in CI: 20,000).
    let ops = if cfg!(debug_assertions) {
        20_000
    } else {
        100_000
    };
    let fsx = Fsx::start(&mnt.join(&exercised), ops, 0x5eed);
    let fio = FioLoop::on_mount(&mnt, &tmp.path().join("fio-m"));
    let fio_nbd = FioLoop::on_nbd(&uri, &tmp.path().join("fio-n"));

    // Grow to 2x3 and rebalance.
    let brick = |i: usize| format!("127.0.0.1:{}", tmp.path().join(format!("b{i}")).display());
    let new: Vec<String> = (3..6).map(brick).collect();
    let mut args = vec!["volume", "add-brick", "rb", "replica", "3"];
    args.extend(new.iter().map(String::as_str));
    let seen = (
        std::fs::read_to_string(&log)
            .unwrap()
            .matches("graph version")
            .count(),
        std::fs::read_to_string(&nlog)
            .unwrap()
            .matches("graph version")
            .count(),
    );
    v.mgmt(&args);
    // The held handles are used once on the grown graph (so they are bound to it) before the
    // rebalance moves their files: the next use after the move meets EMOVED.
    let switches = |p: &Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .matches("graph version")
            .count()
    };
    common::wait_for("the clients to switch to the grown graph", 30, || {
        switches(&log) > seen.0 && switches(&nlog) > seen.1
    });
    let said = held.run("read -P 0x5a 32M 1M", "read ");
    assert!(said.contains("read 1048576/1048576"), "{said}");
    let mut probe = [0u8; 4];
    held_file.read_exact_at(&mut probe, 0).unwrap();
    assert_eq!(&probe, b"held");
    // fsx is still at work when its file moves.
    assert!(fsx.done() > 0, "fsx is not under way");
    v.mgmt(&["volume", "rebalance", "rb", "start"]);
    let st = v.wait_rebalance(300);
    assert_eq!(st["state"], "completed", "{st}");
    assert_eq!(st["failed"], 0, "{st}");
    let moved_in = st["files_moved"].as_u64().unwrap();
    // volume status shows the same run.
    let vs = v.status();
    assert_eq!(vs["rebalance"]["files_moved"], st["files_moved"], "{vs}");
    assert!(moved_in > 50, "{moved_in} names moved to the new set: {st}");
    let dirs: Vec<PathBuf> = (0..6).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let on1 = brick_files(&dirs[3]);
    assert!(on1.len() as u64 >= moved_in, "{on1:?}");
    // No name on both sets.
    let on0 = brick_files(&dirs[0]);
    let both: Vec<&String> = on0.iter().filter(|f| on1.contains(f)).collect();
    assert!(both.is_empty(), "on both sets: {both:?}");
    for (i, f) in small.iter().enumerate() {
        assert_eq!(std::fs::read(mnt.join(f)).unwrap(), content(i), "{f}");
    }
    // The held session reads what it wrote and goes on writing, from the image's new place.
    let said = held.run("read -P 0x5a 32M 1M", "read ");
    assert!(said.contains("read 1048576/1048576"), "{said}");
    let said = held.run("write -P 0x6b 40M 64k", "wrote");
    assert!(said.contains("wrote 65536/65536"), "{said}");
    drop(held);
    let mut probe = [0u8; 10];
    held_file.read_exact_at(&mut probe, 0).unwrap();
    assert_eq!(&probe, b"held file\n");
    held_file.write_all_at(b"HELD", 0).unwrap();
    drop(held_file);
    assert_eq!(std::fs::read(mnt.join(&held_name)).unwrap(), b"HELD file\n");

    // Shrink: the first set goes.
    let old: Vec<String> = (0..3).map(brick).collect();
    let mut args: Vec<&str> = vec!["volume", "remove-brick", "rb"];
    args.extend(old.iter().map(String::as_str));
    let commit = {
        let mut a = args.clone();
        a.push("commit");
        a
    };
    // Not draining yet: commit is refused, and nothing changes.
    let refused = common::fails(&[commit.as_slice(), &mgmt_opts(&v)].concat());
    assert!(refused.contains("not draining"), "{refused}");
    args.push("start");
    v.mgmt(&args);
    let st = v.wait_rebalance(300);
    assert_eq!(st["state"], "completed", "{st}");
    assert_eq!(st["failed"], 0, "{st}");
    // Clients keep going a while after the move, on the files that moved.
    fio.one_more(120);
    fio_nbd.one_more(120);
    v.mgmt(&commit);
    let info = v.mgmt(&["volume", "info", "rb", "--json"]);
    assert!(info.contains("\"removed\":true"), "{info}");
    let left: Vec<String> = (0..3).flat_map(|i| brick_files(&dirs[i])).collect();
    assert!(left.is_empty(), "the removed bricks still hold {left:?}");

    let done = fsx.finish().expect("fsx");
    assert!(done >= ops, "{done} fsx operations");
    eprintln!("fsx: {done} operations");
    let (runs, failures) = fio.finish();
    assert!(
        failures.is_empty(),
        "mount I/O errors: {}",
        failures.join("\n")
    );
    let (nruns, nfailures) = fio_nbd.finish();
    assert!(
        nfailures.is_empty(),
        "NBD I/O errors: {}",
        nfailures.join("\n")
    );
    assert!(runs >= 3 && nruns >= 1, "{runs} {nruns}");
    for (i, f) in small.iter().enumerate() {
        assert_eq!(std::fs::read(mnt.join(f)).unwrap(), content(i), "{f}");
    }
    // The three copies of every file are identical.
    let names = brick_files(&dirs[3]);
    assert_eq!(names, brick_files(&dirs[4]));
    assert_eq!(names, brick_files(&dirs[5]));
    for f in &names {
        let a = std::fs::read(dirs[3].join(f)).unwrap();
        assert_eq!(a, std::fs::read(dirs[4].join(f)).unwrap(), "{f}");
        assert_eq!(a, std::fs::read(dirs[5].join(f)).unwrap(), "{f}");
    }
    assert!(names.contains(&exercised) && names.contains(&image));
    // The files held open moved under their handles: each client reopened them.
    let followed = |p: &Path, name: &str| {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .any(|l| l.contains("reopened where it is now") && l.contains(name))
    };
    assert!(
        followed(&log, &held_name),
        "the mount never followed {held_name}"
    );
    assert!(followed(&nlog, &image), "the export never followed {image}");
}
