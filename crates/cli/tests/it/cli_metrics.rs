//! `/metrics` as a Prometheus server scrapes it, and `kiln volume profile` across a volume:
//! - a brick whose volume name holds a quote, a backslash and a newline still serves an
//!   exposition that the reference parser (Python `prometheus_client`) reads back exactly;
//! - every brick kilnd runs serves `/metrics` on the port `volume status` shows, and
//!   `volume status --clients` lists the clients' endpoints;
//! - `kiln volume profile VOL` reports every brick of VOL, `--brick` one of them.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::common;
use common::{fails, kiln, mgmt_ok, BrickReaper, Kilnd};

/// GET `path` from `addr` (HTTP/1.0); the body, after checking the status is 200.
fn get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.split(' ').nth(1) == Some("200"), "{head}");
    body.to_owned()
}

/// Parses an exposition with the Prometheus project's Python client and returns, per sample,
/// `[name, labels, value]`. Panics if it does not parse.
fn parse_with_reference(text: &str) -> Vec<Value> {
    const PY: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", PY])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("No module named 'prometheus_client'"),
        "the reference parser is missing: scripts/test.sh installs it \
         (python3 -m pip install prometheus-client)"
    );
    assert!(out.status.success(), "the exposition does not parse: {err}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_hostile_volume_name_cannot_break_the_exposition() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("brick");
    std::fs::create_dir(&dir).unwrap();
    // A standalone brick's volume is what its volfile calls it: here a name no scraper should
    // see as the end of a label value or of a line.
    let hostile = "a\"b\\c\nd} x=\"1";
    let vf = tmp.path().join("brick.toml");
    let toml_name = hostile
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    std::fs::write(
        &vf,
        format!(
            "[[layer]]\nname = \"{toml_name}\"\ntype = \"io-stats\"\nsubvolumes = [\"p\"]\n\n\
             [[layer]]\nname = \"p\"\ntype = \"posix\"\ndirectory = \"{}\"\n",
            dir.display()
        ),
    )
    .unwrap();
    let (mut child, mut out) =
        kiln_testkit::daemon::spawn_piped(kiln().args(["server", "--volfile"]).arg(&vf).args([
            "--listen",
            "tcp:127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ]));
    let said = kiln_testkit::daemon::announced(&mut out, 1, true);
    let brick = said.listening.first().cloned();
    let metrics = said.metrics.expect("the metrics endpoint");
    // Some traffic through the hostile point, so it has series.
    let v = kiln_client::Volume::connect(brick.as_deref().unwrap()).unwrap();
    kiln_client::block_on(v.mkdir("/d", 0o755)).unwrap();
    let _ = kiln_client::block_on(v.lookup("/nosuch"));
    drop(v);

    let text = get(&metrics, "/metrics");
    let samples = parse_with_reference(&text);
    let calls: Vec<&Value> = samples
        .iter()
        .filter(|s| s[0] == "kiln_fop_calls_total" && s[1]["layer"] == hostile)
        .collect();
    assert!(
        calls
            .iter()
            .any(|s| s[1]["fop"] == "mkdir" && s[2].as_f64() == Some(1.0)),
        "the hostile layer's mkdir count did not survive the round trip: {calls:?}\n{text}"
    );
    // Nothing leaked out of a label: every sample names a Kiln metric, and no sample carries a
    // label `x` (what the name's `} x="1` would have made of an unescaped value).
    assert!(samples
        .iter()
        .all(|s| s[0].as_str().unwrap().starts_with("kiln_")));
    assert!(samples.iter().all(|s| s[1].get("x").is_none()));
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn every_brick_serves_metrics_and_profile_covers_the_volume() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _reaper = BrickReaper(state.clone());
    let kd = Kilnd::start(&state, &["--metrics", "127.0.0.1:0"]);
    let dirs: Vec<PathBuf> = (1..=3).map(|i| tmp.path().join(format!("b{i}"))).collect();
    let bricks: Vec<String> = dirs
        .iter()
        .map(|d| format!("127.0.0.1:{}", d.display()))
        .collect();
    let mut create = vec!["volume", "create", "pv", "replica", "3"];
    create.extend(bricks.iter().map(String::as_str));
    mgmt_ok(&kd, &state, &create);
    mgmt_ok(&kd, &state, &["volume", "start", "pv"]);

    let st: Value =
        serde_json::from_str(&mgmt_ok(&kd, &state, &["volume", "status", "pv", "--json"])).unwrap();
    let rows = st["volumes"][0]["bricks"].as_array().unwrap().clone();
    assert_eq!(rows.len(), 3, "{st}");
    // A brick's log lines say which volume and brick they are of, and who a client is.
    let brick0 = format!("127.0.0.1:{}", rows[0]["port"]);
    assert!(kiln_client::Client::connect_with_secret(&brick0, Some(b"not the secret")).is_err());
    let log = state.join("vols/pv/bricks/0.log");
    let tag = format!("volume=pv index=0 brick={} ", dirs[0].display());
    common::wait_for("the brick to log the refusal", 10, || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .any(|l| {
                l.starts_with(&tag) && l.contains("peer=127.0.0.1") && l.contains("authentication")
            })
    });
    let table = mgmt_ok(&kd, &state, &["volume", "status", "pv"]);
    assert!(table.contains("Metrics"), "{table}");
    let mut ports = Vec::new();
    for b in &rows {
        let port = b["metrics_port"]
            .as_u64()
            .unwrap_or_else(|| panic!("brick without a metrics port: {b}"));
        // The table's last column, on the brick's row.
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("Brick {} ", b["brick"].as_str().unwrap())))
            .unwrap_or_else(|| panic!("no row for {b} in {table}"));
        assert_eq!(
            row.split_whitespace().last(),
            Some(port.to_string().as_str())
        );
        let text = get(&format!("127.0.0.1:{port}"), "/metrics");
        // The brick's own counters and its io-stats point, named after the volume.
        assert!(text.contains("kiln_brick_connections_total"), "{text}");
        parse_with_reference(&text);
        ports.push(port);
    }

    // Traffic through the volume, then a profile of all three bricks.
    let sf = kiln_client::mgmt::secret_file_in("pv", None, &state).expect("the secret");
    // SAFETY (edition 2021: safe fn): set before this test starts any client thread.
    std::env::set_var("KILN_SECRET_FILE", &sf);
    let vf = kiln_client::mgmt::fetch_volfile(&kd.addr, "pv").unwrap();
    let v = kiln_client::Volume::from_volfile(&vf).unwrap();
    for i in 0..12 {
        kiln_client::block_on(v.mkdir(&format!("/d{i}"), 0o755)).unwrap();
    }
    drop(v);
    let info: Value = serde_json::from_str(&mgmt_ok(
        &kd,
        &state,
        &["volume", "profile", "pv", "info", "--json"],
    ))
    .unwrap();
    let sources: Vec<&str> = info["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["source"].as_str().unwrap())
        .collect();
    for b in &bricks {
        assert!(
            sources.contains(&format!("brick {b}").as_str()),
            "{b} missing from {sources:?}"
        );
    }
    // A mkdir goes to every brick (distribute makes directories everywhere).
    for s in info["sources"].as_array().unwrap() {
        let mkdirs: u64 = s["report"]["points"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|p| {
                p["cumulative"]["fops"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter(|f| f["fop"] == "mkdir")
            .map(|f| f["calls"].as_u64().unwrap())
            .sum();
        assert!(mkdirs >= 12, "{}: {mkdirs} mkdirs", s["source"]);
    }
    let one: Value = serde_json::from_str(&mgmt_ok(
        &kd,
        &state,
        &[
            "volume", "profile", "pv", "info", "--json", "--brick", &bricks[1],
        ],
    ))
    .unwrap();
    let only: Vec<&Value> = one["sources"].as_array().unwrap().iter().collect();
    assert_eq!(only.len(), 1, "{one}");
    assert_eq!(only[0]["source"], format!("brick {}", bricks[1]));
    // Errors say what is wrong.
    let mut a = vec!["volume", "profile", "nosuch", "info", "--server", &kd.addr];
    a.extend(["--state-dir", state.to_str().unwrap()]);
    assert!(fails(&a).contains("does not exist"), "{}", fails(&a));
    let mut a = vec![
        "volume",
        "profile",
        "pv",
        "info",
        "--brick",
        "127.0.0.1:/nope",
    ];
    a.extend(["--server", &kd.addr, "--state-dir", state.to_str().unwrap()]);
    assert!(fails(&a).contains("no running brick"), "{}", fails(&a));

    // Each brick counted the mkdirs at its io-stats point.
    let mut scrapes = Vec::new();
    for port in &ports {
        let text = get(&format!("127.0.0.1:{port}"), "/metrics");
        let samples = parse_with_reference(&text);
        assert!(
            samples.iter().any(|s| s[0] == "kiln_fop_calls_total"
                && s[1]["process"] == "kilnd"
                && s[1]["fop"] == "mkdir"
                && s[2].as_f64() >= Some(12.0)),
            "{text}"
        );
        scrapes.push(text);
    }
    // The dashboard names only what some Kiln process exposes: a brick, kilnd (heal, rebuild,
    // rebalance) and a client (this test process, with a volume open).
    scrapes.push(get(kd.metrics.as_deref().unwrap(), "/metrics"));
    kiln_client::start_metrics("127.0.0.1:0", "kiln-test").unwrap();
    let v = kiln_client::Volume::from_volfile(&vf).unwrap();
    kiln_client::block_on(v.lookup("/d0")).unwrap();
    let ep = kiln_metrics::local_endpoint()
        .expect("the client's endpoint")
        .to_string();
    scrapes.push(get(&ep, "/metrics"));
    // `volume status --clients` finds this client through the bricks it announced itself to.
    let st: Value = serde_json::from_str(&mgmt_ok(
        &kd,
        &state,
        &["volume", "status", "pv", "--clients", "--json"],
    ))
    .unwrap();
    let listed = st["clients"]["pv"].as_array().expect("clients of pv");
    assert!(listed.iter().any(|e| e == ep.as_str()), "{ep} not in {st}");
    let table = mgmt_ok(&kd, &state, &["volume", "status", "pv", "--clients"]);
    assert!(table.contains(&format!("  http://{ep}/metrics")), "{table}");
    // And kilnd's own.
    let own = kd.metrics.as_deref().unwrap();
    assert_eq!(st["metrics"], own, "{st}");
    assert!(
        table.contains(&format!("kilnd serves /metrics at http://{own}/metrics")),
        "{table}"
    );
    drop(v);
    let mut exposed = std::collections::BTreeSet::new();
    for text in &scrapes {
        for s in parse_with_reference(text) {
            exposed.insert(s[0].as_str().unwrap().to_owned());
        }
        // Families declared before they have samples (a rebalance that never ran).
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                exposed.insert(rest.split(' ').next().unwrap().to_owned());
            }
        }
    }
    let dash = std::fs::read_to_string(
        std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo test sets CARGO_MANIFEST_DIR"),
        )
        .join("../../dashboards/kiln.json"),
    )
    .unwrap();
    let dash: Value = serde_json::from_str(&dash).expect("the dashboard is JSON");
    let mut named = std::collections::BTreeSet::new();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    for e in &exprs {
        let b = e.as_bytes();
        let mut i = 0;
        while let Some(at) = e[i..].find("kiln_") {
            let start = i + at;
            let mut end = start;
            while end < b.len() && (b[end].is_ascii_lowercase() || b[end] == b'_') {
                end += 1;
            }
            named.insert(e[start..end].to_owned());
            i = end;
        }
    }
    assert!(named.len() >= 20, "the dashboard names {named:?}");
    let missing: Vec<&String> = named.iter().filter(|n| !exposed.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard names metrics no process exposes: {missing:?}"
    );
}
