//! The command line's conventions, as a script sees them: `--json` gives one object in one
//! envelope (`{"ok": true, …}` or `{"ok": false, "error": …}`) for every command that prints
//! and ends, exit statuses are 0, 1 (failed) and 2 (usage), and a mount's log lines say whose
//! they are.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

/// Runs `kiln ARGS`; returns its exit code and its stdout parsed as exactly one JSON object
/// with a boolean `ok` (an `error` sentence when false).
fn json(args: &[&str]) -> (i32, serde_json::Value) {
    let out = kiln().args(args).output().expect("run kiln");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "kiln {args:?}: one line of JSON, got {text:?}"
    );
    let v: serde_json::Value = serde_json::from_str(lines[0])
        .unwrap_or_else(|e| panic!("kiln {args:?}: not JSON ({e}): {text:?}"));
    let ok = v["ok"]
        .as_bool()
        .unwrap_or_else(|| panic!("no \"ok\": {v}"));
    let code = out.status.code().expect("an exit code");
    assert_eq!(ok, code == 0, "kiln {args:?}: ok={ok} but exit {code}: {v}");
    if !ok {
        let e = v["error"].as_str().expect("a failure says why");
        assert!(!e.is_empty());
        // The same sentence goes to stderr for a person watching.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            code == 2 || stderr.contains(e),
            "stderr lacks the error: {stderr}"
        );
    }
    (code, v)
}

/// Starts a brick on `dir` at a Unix socket; returns it and the socket's path.
fn brick(dir: &Path) -> (std::process::Child, String) {
    let root = dir.join("brick");
    std::fs::create_dir(&root).expect("brick dir");
    let sock = dir.join("brick.sock");
    let mut child = kiln()
        .args(["server", "--metrics", "off", "--listen"])
        .arg(format!("unix:{}", sock.display()))
        .arg("--brick")
        .arg(&root)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn a brick");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("its first line");
    assert!(line.contains("listening on"), "{line:?}");
    (child, sock.display().to_string())
}

#[test]
fn every_one_shot_command_answers_json_in_one_envelope() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = |p: &str| dir.path().join(p).display().to_string();

    // tls: a result, then the same command failing.
    let (code, v) = json(&["tls", "init", &d("ca"), "--json"]);
    assert_eq!(code, 0);
    assert_eq!(v["cert"], d("ca/ca.pem"));
    // A failure says its kind, and the exit status follows it (4: exists already).
    let (code, v) = json(&["tls", "init", &d("ca"), "--json"]);
    assert_eq!((code, v["kind"].as_str()), (4, Some("exists")), "{v}");
    assert!(v["error"].as_str().unwrap().contains("exists"), "{v}");
    let (code, v) = json(&[
        "tls",
        "issue",
        "--ca",
        &d("ca"),
        "--out",
        &d("id"),
        "b1",
        "--json",
    ]);
    assert_eq!((code, v["identity"].as_str()), (0, Some("b1")), "{v}");
    assert!(dir.path().join("id/cert.pem").exists());

    // generate: the files written; the script inside the object.
    let (_, v) = json(&["generate", "man", &d("man"), "--json"]);
    let pages: Vec<&str> = v["pages"]
        .as_array()
        .expect("pages")
        .iter()
        .filter_map(|p| p.as_str())
        .collect();
    for want in [
        "kiln.1",
        "kiln-volume.1",
        "kiln-image-snapshot.1",
        "kilnd.8",
    ] {
        assert!(pages.contains(&want), "{want} missing from {pages:?}");
        assert!(dir.path().join("man").join(want).exists());
    }
    // volume layers: every layer type, each with its options.
    let (code, v) = json(&["volume", "layers", "--json"]);
    assert_eq!((code, &v["ok"]), (0, &serde_json::json!(true)), "{v}");
    let posix = v["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .find(|l| l["name"] == "posix")
        .expect("the posix layer");
    assert!(
        posix["options"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o["name"] == "directory"),
        "{posix}"
    );
    let (_, v) = json(&["generate", "completions", "bash", "--json"]);
    assert_eq!(v["shell"], "bash");
    assert!(v["script"].as_str().unwrap().contains("complete -F"), "{v}");

    // umount of something that is not a mount.
    let (code, v) = json(&["umount", &d("man"), "--json"]);
    assert_eq!((code, v["kind"].as_str()), (2, Some("invalid")), "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("not a mount point"),
        "{v}"
    );

    // image, against a real brick: a result, a refusal from the brick, an unknown image.
    let (mut server, sock) = brick(dir.path());
    std::fs::write(dir.path().join("brick/disk.img"), vec![0u8; 65536]).expect("an image");
    let image = format!("unix:{sock}:/vol/disk.img");
    let (code, v) = json(&["image", "list", &image, "--json"]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["image"], "disk.img");
    assert_eq!(v["snapshots"], serde_json::json!([]));
    let (code, v) = json(&["image", "dirty", "show", &image, "daily", "--json"]);
    // A standalone brick keeps no dirty records: asking again fails again (2, invalid).
    assert_eq!((code, v["kind"].as_str()), (2, Some("invalid")), "{v}");
    let (code, v) = json(&[
        "image",
        "list",
        &format!("unix:{sock}:/vol/nosuch"),
        "--json",
    ]);
    assert_eq!((code, v["kind"].as_str()), (3, Some("not-found")), "{v}");
    assert!(v["error"].as_str().unwrap().contains("not found"), "{v}");
    let _ = server.kill();
    let _ = server.wait();

    // volume, with no kilnd to ask.
    let (code, v) = json(&[
        "volume",
        "info",
        "nosuch",
        "--json",
        "--server",
        "127.0.0.1:1",
    ]);
    assert_eq!((code, v["kind"].as_str()), (6, Some("unavailable")), "{v}");

    // Usage errors: exit 2, still one envelope.
    for bad in [
        &["image", "list", "--json"][..],
        &["volume", "create", "--json", "--bogus"][..],
        &["tls", "init", "--json"][..],
    ] {
        let (code, v) = json(bad);
        assert_eq!(code, 2, "kiln {bad:?}: {v}");
        assert!(v["error"].as_str().unwrap().contains("Usage"), "{v}");
    }
    // Without --json a usage error stays clap's text, with the same status.
    let out = kiln().args(["image", "list"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
}

#[test]
fn help_states_the_exit_statuses() {
    let out = kiln().arg("--help").output().expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for line in [
        "Exit status:",
        "0  the command",
        "1  it failed",
        "2  the command line",
        "3  what it names does not exist",
        "6  someone who must answer cannot now",
    ] {
        assert!(text.contains(line), "{line:?} missing from:\n{text}");
    }
}

/// A mount's log lines start with `volume=V mount=DIR`, as a brick's start with its own
/// tag, so the journal of a host with many mounts can be grepped by volume; and the kernel's
/// flags given with -o are on the mount from its first moment (a ro mount is never writable).
#[test]
fn a_mounts_log_lines_name_its_volume_and_its_flags_are_set_as_it_mounts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut server, sock) = brick(dir.path());
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mnt");
    let log = dir.path().join("mount.log");
    let mut mount = kiln()
        .env_remove("KILN_LOG")
        .env("RUST_LOG", "info")
        .args(["mount", "-o", "ro,noexec", &format!("unix:{sock}:/vol")])
        .arg(&mnt)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn kiln mount");
    let mut line = String::new();
    BufReader::new(mount.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("mounted line");
    assert!(line.starts_with("kiln: mounted"), "{line:?}");
    let canon = mnt.canonicalize().expect("canonical").display().to_string();
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let opts = info
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(canon.as_str()))
        .and_then(|l| l.split(' ').nth(5))
        .expect("the mount is listed")
        .to_owned();
    let opts: Vec<&str> = opts.split(',').collect();
    assert!(opts.contains(&"ro") && opts.contains(&"noexec"), "{opts:?}");
    let e = std::fs::write(mnt.join("f"), b"x").expect_err("a ro mount took a write");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    let out = kiln().arg("umount").arg(&mnt).output().expect("umount");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(mount.wait().expect("mount exits").success());
    let _ = server.kill();
    let _ = server.wait();

    let text = std::fs::read_to_string(&log).expect("log");
    let tag = format!("volume=vol mount={} ", mnt.display());
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        lines.iter().any(|l| l.contains("metrics on")),
        "the mount logged its start:\n{text}"
    );
    for l in &lines {
        assert!(l.starts_with(&tag), "untagged line {l:?} in:\n{text}");
    }
}
