//! The brick's layer stack as a user configures it: `--volfile`, `/metrics`, error-gen.
//! Real kilnd processes, real sockets, a real HTTP scrape.

use std::io::{Read, Write};
use std::process::{Child, Command};

use kiln_client::{block_on, Client};

/// A kilnd child: its TCP address and metrics endpoint.
struct Brick {
    child: Child,
    addr: String,
    metrics: String,
    dir: tempfile::TempDir,
}

impl Drop for Brick {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(volfile: Option<&str>) -> Brick {
    let dir = tempfile::tempdir().unwrap();
    let brick = dir.path().join("brick");
    std::fs::create_dir(&brick).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kilnd"));
    match volfile {
        Some(v) => {
            let f = dir.path().join("brick.vol");
            std::fs::write(&f, v.replace("@BRICK@", brick.to_str().unwrap())).unwrap();
            cmd.arg("--volfile").arg(f);
        }
        None => {
            cmd.arg("--brick").arg(&brick);
        }
    }
    let (child, mut out) = kiln_testkit::daemon::spawn_piped(cmd.args([
        "--listen",
        "tcp:127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
    ]));
    let mut said = kiln_testkit::daemon::announced(&mut out, 1, true);
    Brick {
        child,
        addr: said.listening.remove(0),
        metrics: said.metrics.expect("the metrics endpoint"),
        dir,
    }
}

fn get(hostport: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(hostport).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {hostport}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.contains(" 200 "), "{head}");
    body.to_owned()
}

/// Value of the series whose name and labels contain every `want` fragment.
fn series(text: &str, name: &str, want: &[&str]) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| want.iter().all(|w| l.contains(w)))
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect()
}

#[test]
fn metrics_endpoint_shows_per_fop_latency_histograms() {
    let b = start(None);
    let c = Client::connect(&b.addr).unwrap();
    let (fh, _) = block_on(c.create("/m", libc::O_RDWR, 0o644)).unwrap();
    for i in 0..10u64 {
        let (r, _) = block_on(c.pwritev(fh, vec![vec![7u8; 4096]], i * 4096));
        assert_eq!(r.unwrap(), 4096);
    }
    for _ in 0..23 {
        block_on(c.lookup("/m")).unwrap();
    }
    assert!(block_on(c.lookup("/missing")).is_err());
    let text = get(&b.metrics, "/metrics");

    let calls = series(
        &text,
        "kiln_fop_calls_total",
        &["layer=\"brick\"", "fop=\"lookup\""],
    );
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0].1, 24.0);
    let errors = series(
        &text,
        "kiln_fop_errors_total",
        &["layer=\"brick\"", "fop=\"lookup\""],
    );
    assert_eq!(errors[0].1, 1.0);
    let bytes = series(
        &text,
        "kiln_fop_bytes_total",
        &["layer=\"brick\"", "fop=\"write\""],
    );
    assert_eq!(bytes[0].1, 40960.0);

    // A proper cumulative histogram: non-decreasing buckets ending at +Inf == _count.
    let buckets = series(
        &text,
        "kiln_fop_latency_seconds_bucket",
        &["layer=\"brick\"", "fop=\"lookup\""],
    );
    assert!(buckets.len() > 5, "{text}");
    assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{buckets:?}");
    let (last_key, last) = buckets.last().unwrap();
    assert!(last_key.contains("le=\"+Inf\""), "{last_key}");
    assert_eq!(*last, 24.0);
    let count = series(&text, "kiln_fop_latency_seconds_count", &["fop=\"lookup\""]);
    assert_eq!(count[0].1, 24.0);
    let sum = series(&text, "kiln_fop_latency_seconds_sum", &["fop=\"lookup\""]);
    assert!(sum[0].1 > 0.0 && sum[0].1 < 24.0, "{sum:?}");
    let written = series(&text, "kiln_brick_written_bytes_total", &[]);
    assert!(
        text.contains("kiln_brick_written_bytes_total 40960"),
        "{written:?}"
    );
}

const ERRORS: &str = r#"
[[layer]]
name = "top"
type = "io-stats"

[[layer]]
name = "no-unlink"
type = "error-gen"
fops = ["unlink"]
error = "ENOSPC"

[[layer]]
name = "dispatch"
type = "dispatch"

[[layer]]
name = "posix"
type = "posix"
directory = "@BRICK@"
"#;

#[test]
fn error_gen_fails_only_the_chosen_fop() {
    let b = start(Some(ERRORS));
    let c = Client::connect(&b.addr).unwrap();
    let (fh, _) = block_on(c.create("/keep", libc::O_RDWR, 0o644)).unwrap();
    block_on(c.close(fh)).unwrap();
    let e = block_on(c.unlink("/keep")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    // The fop never reached posix: the file is still there, and other fops work.
    assert!(b.dir.path().join("brick/keep").exists());
    block_on(c.lookup("/keep")).unwrap();
    block_on(c.mkdir("/d", 0o755)).unwrap();
    block_on(c.rmdir("/d")).unwrap();
    // io-stats above it saw the failure.
    let text = get(&b.metrics, "/metrics");
    let errors = series(
        &text,
        "kiln_fop_errors_total",
        &["layer=\"top\"", "fop=\"unlink\""],
    );
    assert_eq!(errors[0].1, 1.0, "{text}");
}

#[test]
fn a_bad_volfile_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    for (text, why) in [
        (
            ERRORS.replace("error = \"ENOSPC\"", "error = \"ENOSPC\"\nerrror = 1"),
            "errror",
        ),
        (ERRORS.replace("\"ENOSPC\"", "\"EWHAT\""), "EWHAT"),
        (
            ERRORS.replace(
                "type = \"posix\"\ndirectory = \"@BRICK@\"",
                "type = \"protocol-client\"\nremote = \"x\"",
            ),
            "protocol-client",
        ),
        (
            ERRORS.replace(
                "directory = \"@BRICK@\"",
                "directory = \"/nonexistent/kiln\"",
            ),
            "/nonexistent/kiln",
        ),
    ] {
        let f = dir.path().join("bad.vol");
        std::fs::write(&f, text.replace("@BRICK@", dir.path().to_str().unwrap())).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_kilnd"))
            .arg("--volfile")
            .arg(&f)
            .args(["--listen", "tcp:127.0.0.1:0", "--metrics", "off"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "expected {why:?} in {err}");
    }
}
