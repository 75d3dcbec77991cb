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
    assert!(stdout.contains("/demo/latest -> image.raw"), "{stdout}");
    let copied = stdout
        .lines()
        .find(|l| l.contains("bytes copied in user space"))
        .expect("copy line");
    assert!(
        copied.contains(" 0 ("),
        "the read path copied payload: {copied}"
    );
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
