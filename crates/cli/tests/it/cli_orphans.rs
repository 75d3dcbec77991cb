//! A brick process that the pool's store does not account for — left running by a `start`
//! whose leader died before recording it — is stopped by its host's kilnd once it is older
//! than the grace a start needs; the bricks of started volumes are left alone.

use std::process::{Command, Stdio};

use serde_json::Value;

use crate::common;
use common::{kiln, mgmt_ok, wait_for, BrickReaper, Kilnd};

#[test]
fn a_brick_of_a_volume_that_is_not_started_is_stopped_and_started_ones_stay() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start_env(
        &state,
        &["--brick-port-base", "25200"],
        &[("KILN_ORPHAN_GRACE_MS", "1500")],
    );
    let mgmt = |args: &[&str]| mgmt_ok(&kd, &state, args);
    for v in ["up", "down"] {
        let brick = format!("127.0.0.1:{}", tmp.path().join(v).display());
        mgmt(&["volume", "create", v, &brick]);
        mgmt(&["volume", "start", v]);
    }
    mgmt(&["volume", "stop", "down", "--yes"]);
    let st: Value = serde_json::from_str(&mgmt(&["volume", "status", "up", "--json"])).unwrap();
    let up_pid = st["volumes"][0]["bricks"][0]["pid"].as_u64().unwrap();

    // What a start cut short leaves: brick 0 of "down" running, the volume not started.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut orphan = kiln()
        .arg("server")
        .arg("--volfile")
        .arg(state.join("vols/down/bricks/0.toml"))
        .args([
            "--listen",
            &format!("tcp:127.0.0.1:{port}"),
            "--metrics",
            "off",
        ])
        .arg("--secret-file")
        .arg(state.join("vols/down/secret"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the orphan to listen", 10, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    wait_for("kilnd to stop the orphan", 30, || {
        matches!(orphan.try_wait(), Ok(Some(_)))
    });
    assert!(
        kd.log_text()
            .contains("but the volume is not started: stopping it"),
        "kilnd says why: {}",
        kd.log_text()
    );
    // Past the grace, the started volume's brick runs on.
    let st: Value = serde_json::from_str(&mgmt(&["volume", "status", "up", "--json"])).unwrap();
    assert_eq!(st["volumes"][0]["bricks"][0]["pid"].as_u64(), Some(up_pid));
    assert_eq!(st["volumes"][0]["bricks"][0]["online"], true);
    assert!(Command::new("kill")
        .args(["-0", &up_pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// A brick's log survives its restarts (appended to, not truncated: what it said before a
/// restart is what one looks for after it), and a restarted brick is still seen to listen.
#[test]
fn a_bricks_log_is_appended_to_across_restarts() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start_env(&state, &["--brick-port-base", "25300"], &[]);
    let mgmt = |args: &[&str]| mgmt_ok(&kd, &state, args);
    let brick = format!("127.0.0.1:{}", tmp.path().join("b").display());
    mgmt(&["volume", "create", "logs", &brick]);
    let log = state.join("vols/logs/bricks/0.log");
    let listening = || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            !text.contains('\u{1b}'),
            "colour codes in a log file:\n{text}"
        );
        text.matches("kilnd: listening on").count()
    };
    mgmt(&["volume", "start", "logs"]);
    let first = listening();
    assert!(first > 0, "the brick's log says where it listens");
    mgmt(&["volume", "stop", "logs", "--yes"]);
    mgmt(&["volume", "start", "logs"]);
    assert_eq!(listening(), 2 * first, "both runs are in the log");
}
