//! `kiln vhost-user-blk` under a real QEMU guest (TCG: this machine has no usable KVM), on
//! four virtqueues: the guest's fio writes a known pattern and seeded random data through the
//! device and verifies them, while the volume's only brick is killed and started again and,
//! while the guest's requests wait on the brick, the device itself is stopped and a new one
//! takes its socket (QEMU reconnects); the guest sees no error, the brick holds the pattern,
//! and neither device copied a payload byte. Then the guest reads 1 MiB at a time (one 1 MiB
//! request each at the brick), writes with a flush after each write, discards a range it
//! wrote and zeroes another (holes on the brick; zeroes read back in the guest); the device's
//! sampled requests show a waterfall from the guest's kick to the used ring.
//!
//! The guest is the machine's guest harness (`shared/vm/guest-fio.sh` beside the repository,
//! or `KILN_VM_HARNESS`): it builds a kernel and initramfs from Debian's packages, boots them
//! under QEMU with the device, runs the fio job inside and prints fio's JSON. Needs root;
//! skips (saying why) without the harness.

use crate::common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::managed::{Proc, Vol};
use common::{kill_brick_pid, kiln, wait_for, BrickReaper};
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// What the first job writes, and the brick must hold: "KILN".
const PATTERN: [u8; 4] = *b"KILN";

/// The guest harness: `KILN_VM_HARNESS`, else `shared/vm/guest-fio.sh` beside an ancestor of
/// this repository (or of the machine's work directory).
fn harness() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KILN_VM_HARNESS") {
        return Some(PathBuf::from(p));
    }
    let here = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    let found = here
        .ancestors()
        .chain([Path::new("/work")])
        .map(|a| a.join("shared/vm/guest-fio.sh"))
        .find(|p| p.exists());
    found
}

const JOB: &str = "\
[global]
filename=${KILN_DEV}
direct=1
ioengine=libaio
verify_fatal=1
do_verify=1

[pattern]
rw=write
bs=1M
size=32m
iodepth=4
verify=pattern
verify_pattern=0x4b494c4e

[random]
stonewall
offset=64m
size=64m
rw=randwrite
bs=64k
iodepth=8
loops=3
verify=crc32c
randseed=4242

[reads]
stonewall
rw=read
bs=1M
size=32m
iodepth=4

[flush]
stonewall
rw=write
bs=64k
offset=160m
size=4m
iodepth=1
fsync=1

[prefill]
stonewall
rw=write
bs=1M
offset=192m
size=16m
iodepth=1

[trim]
stonewall
ioengine=psync
rw=trim
bs=1M
offset=192m
size=8m

[zeroes]
stonewall
ioengine=falloc
rw=trim
bs=1M
offset=200m
size=8m

[zeroed]
stonewall
rw=read
bs=1M
offset=200m
size=8m
iodepth=1
verify=pattern
verify_pattern=0
";

#[test]
fn a_guest_writes_and_verifies_through_a_brick_restart() {
    if !kiln_testkit::is_root() {
        println!("skipping: the guest harness needs root");
        return;
    }
    let Some(harness) = harness() else {
        println!("skipping: no guest harness (shared/vm/guest-fio.sh; set KILN_VM_HARNESS)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    // One brick: while it restarts, the guest's I/O has nowhere else to go.
    let v = Vol::new(tmp.path(), "vm", 1, "26000");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = v.mount(&mnt);
    std::fs::File::create(mnt.join("disk.img"))
        .and_then(|f| f.set_len(256 * MIB))
        .unwrap();
    drop(m);

    let sock = tmp.path().join("v.sock");
    let first_log = tmp.path().join("vhost-1.log");
    let mut first = device(&v, &sock, &first_log);

    let job = tmp.path().join("job.fio");
    std::fs::write(&job, JOB).unwrap();
    let console = tmp.path().join("console.log");
    let guest = {
        let (harness, job, console, sock) =
            (harness.clone(), job.clone(), console.clone(), sock.clone());
        std::thread::spawn(move || {
            Command::new(&harness)
                .args(["--job"])
                .arg(&job)
                .args(["--time-based", "0", "--runtime", "120", "--mem", "1G"])
                .arg("--console")
                .arg(&console)
                .args([
                    "--",
                    "-object",
                    "memory-backend-memfd,id=mem,size=1G,share=on",
                    "-numa",
                    "node,memdev=mem",
                    "-chardev",
                    &format!("socket,id=c,path={},reconnect=1", sock.display()),
                    "-device",
                    "vhost-user-blk-pci,chardev=c,num-queues=4",
                ])
                .output()
                .unwrap()
        })
    };

    // Once the random job writes (the brick file grows past the pattern), the brick goes
    // away and comes back while the guest's requests wait. Meanwhile the device is stopped
    // for a restart: it lets the requests it started complete (once the brick is back) and
    // starts no more; a new device takes the socket, QEMU reconnects to it (`reconnect=1`)
    // and the rest of the guest's I/O goes through it.
    let brick_file = tmp.path().join("b0/disk.img");
    wait_for("the guest to write past the pattern", 300, || {
        std::fs::metadata(&brick_file).is_ok_and(|m| m.blocks() * 512 > 40 * MIB)
    });
    kill_brick_pid(v.pid(0));
    // Away for a second (the outage, not a synchronisation).
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
    unsafe { libc::kill(first.0.id() as i32, libc::SIGTERM) };
    v.mgmt(&["volume", "start", "vm", "force"]);
    wait_for("the brick to be back", 30, || v.all_online());
    wait_for("the stopped device to exit", 60, || {
        matches!(first.0.try_wait(), Ok(Some(_)))
    });
    let stopped = summary(&first_log);
    assert!(first.0.wait().unwrap().success(), "{stopped}");
    // The guest's requests waiting on the brick were in flight when it stopped, and
    // completed before it exited.
    let text = std::fs::read_to_string(&first_log).unwrap();
    let drained = text
        .lines()
        .find(|l| l.contains("stopped: every request started has completed"))
        .unwrap_or_else(|| panic!("the device did not say it drained:\n{text}"));
    assert!(count(drained, "in_flight") > 0, "{drained}");
    println!("{drained}\n{stopped}");
    let log = tmp.path().join("vhost-2.log");
    let dev = device(&v, &sock, &log);

    let run = guest.join().unwrap();
    let text = String::from_utf8_lossy(&run.stdout);
    let console_text = std::fs::read_to_string(&console).unwrap_or_default();
    assert!(
        run.status.success(),
        "the guest run failed: {}\n{}",
        String::from_utf8_lossy(&run.stderr),
        tail(&console_text)
    );
    let fio: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    for j in fio["jobs"].as_array().unwrap() {
        assert_eq!(
            j["error"], 0,
            "fio job {} failed in the guest",
            j["jobname"]
        );
    }
    assert!(
        !console_text.contains("I/O error"),
        "the guest kernel saw an I/O error:\n{}",
        tail(&console_text)
    );

    // The brick holds the pattern the guest wrote.
    let data = std::fs::read(&brick_file).unwrap();
    assert!(
        data[..32 * MIB as usize].chunks(4).all(|c| c == PATTERN),
        "the brick does not hold the guest's pattern"
    );

    // The guest's trim and its zeroing (the guest allows the device to unmap) left holes on
    // the brick where it had written; it read zeroes back.
    let f = std::fs::File::open(&brick_file).unwrap();
    assert!(
        next_data(&f, 192 * MIB) >= 208 * MIB,
        "the guest's discard and write-zeroes of [192 MiB, 208 MiB) left data on the brick"
    );

    // A guest read of 1 MiB is one request of 1 MiB at the brick (the brick restarted before
    // the reads job: its counts are of what came after).
    let info: Value =
        serde_json::from_str(&v.mgmt(&["volume", "profile", "vm", "info", "--json"])).unwrap();
    let reads_of = |size: u64| -> u64 {
        info["sources"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["source"].as_str().unwrap().starts_with("brick "))
            .flat_map(|s| s["report"]["points"].as_array().unwrap().clone())
            .flat_map(|p| p["cumulative"]["block_sizes"].as_array().unwrap().clone())
            .filter(|b| b["size"] == size)
            .map(|b| b["reads"].as_u64().unwrap())
            .sum()
    };
    assert!(
        reads_of(MIB) >= 32,
        "1 MiB reads at the brick: {}",
        reads_of(MIB)
    );
    assert_eq!(
        (reads_of(MIB / 2), reads_of(MIB / 4)),
        (0, 0),
        "1 MiB guest reads were split"
    );
    // The device's sampled requests: a waterfall from the guest's kick to the used ring.
    let trace = v.mgmt(&["volume", "profile", "vm", "trace"]);
    assert!(
        trace.contains("vhost: guest kick") && trace.contains("vhost: used ring"),
        "{trace}"
    );

    // Every read landed in guest memory: neither device's client copied anything.
    drop(dev);
    let last = summary(&log);
    for s in [&stopped, &last] {
        assert!(s.contains("bytes_copied=0"), "{s}");
        assert!(s.contains("errors=0"), "{s}");
    }
    // fsync=1: a FLUSH after each of the 64 writes of the flush job (the guest's block layer
    // may fold one into another), all after the restart.
    assert!(count(&last, "writes") > 0, "{last}");
    assert!(count(&last, "flushes") >= 32, "{last}");
    assert!(count(&last, "discards") >= 1, "{last}");
    assert!(count(&last, "zeroes") >= 1, "{last}");
    println!("{last}");
}

/// Starts `kiln vhost-user-blk` for the volume's image on `sock`, logging to `log`, and waits
/// until it serves.
fn device(v: &Vol, sock: &Path, log: &Path) -> Proc {
    let mut dev = kiln();
    dev.args(["vhost-user-blk", &v.source("/disk.img"), "--secret-file"])
        .arg(&v.secret)
        .args(["--num-queues", "4", "--trace-every", "8"])
        // Reads go to the brick, as from a device on another host (on the brick's own host
        // they would bypass it), so that the brick's counts show them.
        .env("KILN_SHORT_CIRCUIT", "off")
        .arg("--socket")
        .arg(sock)
        .env("KILN_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap());
    let mut child = dev.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("kiln vhost-user-blk: serving"), "{line:?}");
    Proc(child)
}

/// The last "device summary" line of a device's log.
fn summary(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap();
    text.lines()
        .rfind(|l| l.contains("device summary"))
        .unwrap_or_else(|| panic!("no device summary in:\n{text}"))
        .to_owned()
}

/// The number after `what=` in a summary line.
fn count(line: &str, what: &str) -> u64 {
    let at = line
        .find(&format!(" {what}="))
        .unwrap_or_else(|| panic!("no {what}: {line}"));
    line[at + what.len() + 2..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Where the next data at or after `at` starts in `f` (its size when only a hole follows).
fn next_data(f: &std::fs::File, at: u64) -> u64 {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on an open descriptor; no memory is passed.
    let r = unsafe { libc::lseek(f.as_raw_fd(), at as i64, libc::SEEK_DATA) };
    if r < 0 {
        f.metadata().unwrap().len()
    } else {
        r as u64
    }
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Whether a process of user nobody in group `gid` (and no other) can connect to `sock`.
fn connects_as_nobody(sock: &Path, gid: u32) -> bool {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", &format!("--regid={gid}"), "--clear-groups"])
        .args(["/usr/bin/python3", "-c"])
        .arg("import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])")
        .arg(sock)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() || err.contains("PermissionError"),
        "connect failed otherwise: {err}"
    );
    out.status.success()
}

/// The device's socket is its owner's alone, unless a group is let in: then that group's
/// members connect (a QEMU that does not run as root), and others still do not.
#[test]
fn the_socket_lets_in_its_owner_or_one_group() {
    if !kiln_testkit::is_root() {
        println!("skipping: needs root (to connect as another user)");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err()
        || !Path::new("/usr/bin/python3").exists()
    {
        println!("skipping: setpriv or /usr/bin/python3 is not installed");
        return;
    }
    // The group of gid 65534, by its name here (nogroup on Debian, nobody elsewhere).
    let groups = std::fs::read_to_string("/etc/group").unwrap_or_default();
    let Some(group) = groups
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "65534")
        .map(|f| f[0].to_owned())
    else {
        println!("skipping: no group 65534");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let _reaper = BrickReaper(tmp.path().join("state"));
    let v = Vol::new(tmp.path(), "vs", 1, "26030");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = v.mount(&mnt);
    std::fs::File::create(mnt.join("disk.img"))
        .and_then(|f| f.set_len(MIB))
        .unwrap();
    drop(m);
    // Other users reach the socket's directory; only the socket's mode decides.
    let dir = tmp.path().join("run");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let serve = |sock: &Path, group: Option<&str>| {
        let mut c = kiln();
        c.args(["vhost-user-blk", &v.source("/disk.img"), "--secret-file"])
            .arg(&v.secret)
            .args(["--lock", "off", "--socket"])
            .arg(sock)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(g) = group {
            c.args(["--socket-group", g]);
        }
        let mut child = c.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("kiln vhost-user-blk: serving"), "{line:?}");
        Proc(child)
    };

    let own = dir.join("own.sock");
    let p = serve(&own, None);
    let m = std::fs::metadata(&own).unwrap();
    assert_eq!(m.mode() & 0o777, 0o600);
    assert!(!connects_as_nobody(&own, 65534), "a stranger connected");
    drop(p);

    let shared = dir.join("shared.sock");
    let p = serve(&shared, Some(&group));
    let m = std::fs::metadata(&shared).unwrap();
    assert_eq!((m.mode() & 0o777, m.gid()), (0o660, 65534));
    assert!(
        connects_as_nobody(&shared, 65534),
        "the group's member was refused"
    );
    assert!(
        !connects_as_nobody(&shared, 1234),
        "another group's member connected"
    );
    drop(p);

    let out = kiln()
        .args(["vhost-user-blk", &v.source("/disk.img"), "--socket"])
        .arg(dir.join("x.sock"))
        .args(["--socket-group", "no-such-group-here", "--secret-file"])
        .arg(&v.secret)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no such group"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
