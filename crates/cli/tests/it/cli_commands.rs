//! The `kiln` command as a user runs it: demo, bench (table and JSON), server, and errors.

use std::process::Command;

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

#[test]
fn demo_runs_end_to_end_and_verifies_data() {
    let out = kiln()
        .args(["demo", "--size", "16m", "--runtime", "0.5"])
        .output()
        .expect("run kiln demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kiln demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("every byte matches"), "{stdout}");
    assert!(stdout.contains("user.kiln.demo = \"fired\""), "{stdout}");
    assert!(stdout.contains("demo/latest -> image.raw"), "{stdout}");
    let copied = stdout
        .lines()
        .find(|l| l.contains("bytes copied in user space"))
        .expect("copy line");
    assert!(
        copied.contains(" 0 ("),
        "the read path copied payload: {copied}"
    );

    // The same, for a script: one JSON object with the steps' results and the loads.
    let out = kiln()
        .args(["demo", "--size", "8m", "--runtime", "0.3", "--json"])
        .output()
        .expect("run kiln demo --json");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["bytes_copied"], 0, "{v}");
    assert!(
        v["steps"]["read back + verify"]
            .as_str()
            .is_some_and(|s| s.contains("every byte matches")),
        "{v}"
    );
    assert_eq!(v["loads"].as_array().map(Vec::len), Some(2), "{v}");
    assert!(v["loads"][0]["iops"].as_f64() > Some(0.0), "{v}");
}

#[test]
fn bench_json_reports_what_it_measured() {
    let out = kiln()
        .args([
            "bench",
            "--rw",
            "randrw",
            "--bs",
            "8k",
            "--iodepth",
            "8",
            "--size",
            "4m",
            "--runtime",
            "0.5",
            "--json",
        ])
        .output()
        .expect("run kiln bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["ok"], true, "the envelope every --json answer has");
    assert_eq!(v["bs"], 8192);
    assert_eq!(v["iodepth"], 8);
    let ios = v["ios"].as_u64().expect("ios");
    assert!(ios > 0);
    assert_eq!(
        v["bytes"].as_u64(),
        Some(ios * 8192),
        "every request moved a whole block"
    );
    assert!(v["lat_us"]["p50"].as_f64().expect("p50") > 0.0);
    assert!(v["lat_us"]["p99"].as_f64() >= v["lat_us"]["p50"].as_f64());
    assert!(
        v["cpu_s"]["server"].as_f64().is_some(),
        "server CPU measured"
    );
    assert_eq!(v["bytes_copied"], 0);
}

#[test]
fn bad_arguments_get_clear_errors() {
    let out = kiln().args(["bench", "--bs", "4q"]).output().expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bad size"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = kiln()
        .args(["bench", "--connect", "tcp:127.0.0.1:1", "--runtime", "0.1"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot connect to tcp:127.0.0.1:1") && err.contains("refused"),
        "{err}"
    );

    let out = kiln()
        .args(["server", "--brick", "/nonexistent/kiln-brick"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("cannot open brick directory /nonexistent/kiln-brick"));
}

fn mounted(dir: &std::path::Path) -> bool {
    let canon = dir
        .canonicalize()
        .expect("canonicalize")
        .to_string_lossy()
        .into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(canon.as_str()))
}

/// Starts `kiln ARGS` and reads the first line it prints (its "listening" or "mounted" line).
fn spawn_first_line(args: &[&str], last: &std::path::Path) -> (std::process::Child, String) {
    spawn_first_line_with(args, last, std::process::Stdio::inherit())
}

/// [`spawn_first_line`], its stderr going to `stderr`, logging at the default level.
fn spawn_first_line_with(
    args: &[&str],
    last: &std::path::Path,
    stderr: std::process::Stdio,
) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let mut child = kiln()
        .env_remove("KILN_LOG")
        .env_remove("RUST_LOG")
        .args(args)
        .arg(last)
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn kiln");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    (child, line)
}

#[test]
fn mount_serves_refuses_a_busy_mountpoint_and_unmounts_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, mnt) = (dir.path().join("brick"), dir.path().join("mnt"));
    std::fs::create_dir(&brick).expect("brick");
    std::fs::create_dir(&mnt).expect("mnt");
    let (mut server, line) = spawn_first_line(
        &["server", "--listen", "tcp:127.0.0.1:0", "--brick"],
        &brick,
    );
    let addr = line
        .trim()
        .strip_prefix("kilnd: listening on tcp:")
        .expect("tcp address")
        .to_owned();

    let src = format!("{addr}:/vol");
    // Its log is read after it stops (a few lines: the pipe never fills).
    let (mut mount, line) = spawn_first_line_with(
        &["mount", &src, "--mode", "vm-image"],
        &mnt,
        std::process::Stdio::piped(),
    );
    assert!(line.starts_with("kiln: mounted"), "{line:?}");
    assert!(mounted(&mnt));
    std::fs::write(mnt.join("hello"), b"through the mount").expect("write through the mount");
    assert_eq!(
        std::fs::read(brick.join("hello")).expect("brick"),
        b"through the mount"
    );

    let busy = kiln()
        .args(["mount", &format!("{addr}:/vol")])
        .arg(&mnt)
        .output()
        .expect("second mount");
    assert!(!busy.status.success());
    assert!(
        String::from_utf8_lossy(&busy.stderr).contains("is busy"),
        "{}",
        String::from_utf8_lossy(&busy.stderr)
    );

    let other = dir.path().join("other");
    std::fs::create_dir(&other).expect("other");
    let unreachable = kiln()
        .args(["mount", "127.0.0.1:1:/vol"])
        .arg(&other)
        .output()
        .expect("mount unreachable");
    assert!(!unreachable.status.success());
    assert!(String::from_utf8_lossy(&unreachable.stderr).contains("cannot reach 127.0.0.1:1"));
    assert!(!mounted(&other));

    // SAFETY: sending SIGTERM to our own child.
    unsafe { libc::kill(mount.id() as i32, libc::SIGTERM) };
    let st = mount.wait().expect("mount exits");
    assert!(st.success(), "kiln mount exits cleanly on SIGTERM: {st:?}");
    assert!(!mounted(&mnt), "unmounted after SIGTERM");
    let mut log = String::new();
    use std::io::Read;
    mount
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .expect("mount's log");
    let _ = server.kill();
    let _ = server.wait();
    assert!(log.contains("unmounting"), "{log}");
    assert!(
        !log.contains("WARN") && !log.contains("ERROR"),
        "a clean stop warns of nothing: {log}"
    );
}

/// Runs `kiln ARGS DIR`; its success and stderr.
fn kiln_on(args: &[&str], dir: &std::path::Path) -> (bool, String) {
    let out = kiln().args(args).arg(dir).output().expect("run kiln");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kiln mount` refuses a directory that is not empty unless told `-o nonempty`, and an
/// unknown option; `kiln umount` unmounts a Kiln mount and refuses anything else (a tmpfs, a
/// plain directory), leaving it as it was.
#[test]
fn mount_refuses_a_nonempty_dir_and_umount_only_kiln_mounts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (brick, mnt) = (dir.path().join("brick"), dir.path().join("mnt"));
    std::fs::create_dir(&brick).expect("brick");
    std::fs::create_dir(&mnt).expect("mnt");
    std::fs::write(mnt.join("underneath"), b"x").expect("a file in the mount point");
    let sock = dir.path().join("brick.sock");
    let listen = format!("unix:{}", sock.display());
    let (mut server, _) = spawn_first_line(&["server", "--listen", &listen, "--brick"], &brick);
    let src = format!("unix:{}:/vol", sock.display());

    let (ok, err) = kiln_on(&["mount", &src], &mnt);
    assert!(!ok && err.contains("is not empty"), "{err}");
    assert!(!mounted(&mnt));
    let (ok, err) = kiln_on(&["mount", &src, "-o", "bogus"], &mnt);
    assert!(!ok && err.contains("unknown mount option"), "{err}");

    let (mut mount, line) = spawn_first_line(&["mount", &src, "-o", "nonempty"], &mnt);
    assert!(line.starts_with("kiln: mounted"), "{line:?}");
    assert!(
        !mnt.join("underneath").exists(),
        "the volume hides the directory"
    );

    // A tmpfs is not kiln umount's to take down.
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).expect("tmp");
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "kiln-test", tmp.to_str().unwrap()])
        .status()
        .expect("mount tmpfs");
    assert!(st.success());
    let (ok, err) = kiln_on(&["umount"], &tmp);
    assert!(!ok && err.contains("not a Kiln mount"), "{err}");
    assert!(mounted(&tmp), "the tmpfs stays mounted");
    let st = std::process::Command::new("umount").arg(&tmp).status();
    assert!(st.expect("umount tmpfs").success());
    let (ok, err) = kiln_on(&["umount"], &tmp);
    assert!(!ok && err.contains("not a mount point"), "{err}");

    let (ok, err) = kiln_on(&["umount"], &mnt);
    assert!(ok, "{err}");
    let st = mount.wait().expect("mount exits");
    assert!(st.success(), "kiln mount exits once unmounted: {st:?}");
    assert!(!mounted(&mnt));
    assert!(
        mnt.join("underneath").exists(),
        "the directory is as it was"
    );
    let _ = server.kill();
    let _ = server.wait();
}

/// Logs are plain text when stderr is not a terminal, and `RUST_LOG` sets the filter when
/// `KILN_LOG` does not.
#[test]
fn logs_honour_rust_log_and_have_no_colour_in_a_file() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().expect("tempdir");
    let brick = dir.path().join("brick");
    std::fs::create_dir(&brick).expect("brick");
    let run = |filter: Option<&str>| {
        let err = dir.path().join("err.log");
        let mut c = kiln();
        c.env_remove("KILN_LOG").env_remove("RUST_LOG");
        if let Some(f) = filter {
            c.env("RUST_LOG", f);
        }
        let mut server = c
            .args([
                "server",
                "--listen",
                "tcp:127.0.0.1:0",
                "--metrics",
                "127.0.0.1:0",
            ])
            .arg("--brick")
            .arg(&brick)
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&err).expect("log file"))
            .spawn()
            .expect("server");
        // Its second line comes once the metrics server (which logs at debug) is up.
        let mut out = BufReader::new(server.stdout.take().expect("stdout"));
        let mut line = String::new();
        for _ in 0..2 {
            out.read_line(&mut line).expect("server output");
        }
        assert!(line.contains("metrics on"), "{line}");
        let _ = server.kill();
        let _ = server.wait();
        std::fs::read_to_string(&err).expect("log")
    };
    let debug = run(Some("debug"));
    assert!(debug.contains("DEBUG"), "RUST_LOG=debug ignored:\n{debug}");
    assert!(
        !debug.contains('\u{1b}'),
        "colour codes in a log file:\n{debug}"
    );
    let quiet = run(None);
    assert!(!quiet.contains("DEBUG"), "debug lines by default:\n{quiet}");
}

/// Runs `kiln ARGS` and expects a usage error (exit 2) saying the seconds are wrong; a process
/// still running after 10 s took the value (it is killed and the test fails).
fn refuses_seconds(args: &[&str]) {
    let mut child = kiln()
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kiln {args:?} took the value and ran");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "kiln {args:?}: {status} {err}");
    assert!(
        err.contains("is not a number of seconds"),
        "{args:?}: {err}"
    );
}

#[test]
fn durations_that_are_not_finite_bounded_seconds_are_usage_errors_not_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let brick = tmp.path().join("brick");
    std::fs::create_dir(&brick).unwrap();
    let (b, st) = (brick.to_str().unwrap(), tmp.path().join("state"));
    let st = st.to_str().unwrap();
    let brick_args = [
        "server",
        "--metrics",
        "off",
        "--brick",
        b,
        "--listen",
        "tcp:127.0.0.1:0",
    ];
    let mgmt_args = [
        "server",
        "--metrics",
        "off",
        "--mgmt",
        "tcp:127.0.0.1:0",
        "--state-dir",
        st,
    ];
    for bad in ["NaN", "inf", "1e20", "1e309", "-1"] {
        // `--opt=-1`: as a separate word, -1 would read as an option.
        let o = |opt: &str| format!("{opt}={bad}");
        for opt in ["--idle-timeout", "--handshake-timeout"] {
            let o = o(opt);
            let mut a = brick_args.to_vec();
            a.push(&o);
            refuses_seconds(&a);
        }
        let heal = o("--heal-interval");
        let mut a = mgmt_args.to_vec();
        a.push(&heal);
        refuses_seconds(&a);
        let mnt = tmp.path().to_str().unwrap();
        refuses_seconds(&["mount", "127.0.0.1:/v", mnt, &o("--attr-timeout")]);
        refuses_seconds(&["nbd", "tcp:127.0.0.1:1:/x.img", &o("--lock-wait")]);
        refuses_seconds(&["nbd", "tcp:127.0.0.1:1:/x.img", &o("--lock-ttl")]);
        refuses_seconds(&[
            "vhost-user-blk",
            "tcp:127.0.0.1:1:/x.img",
            &o("--lock-wait"),
        ]);
        refuses_seconds(&["bench", "--connect", "tcp:127.0.0.1:1", &o("--runtime")]);
        refuses_seconds(&["demo", &o("--runtime")]);
    }
}
