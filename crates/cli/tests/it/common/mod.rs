//! What the CLI tests share: the `kiln` command, a management kilnd, and a reaper for the
//! brick processes a state directory records.
#![allow(dead_code)] // each test file uses some of these

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test binary uses some of it
pub use kiln_testkit::wait_for;
use serde_json::Value;

pub mod fio;
pub mod fsx;
pub mod managed;

pub fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    // Only what each test passes decides which secret is used.
    c.env_remove("KILN_MGMT_SECRET_FILE")
        .env_remove("KILN_SECRET_FILE");
    c
}

/// A management kilnd whose stderr goes to a file, killed when dropped.
pub struct Kilnd {
    pub child: Child,
    pub addr: String,
    pub log: PathBuf,
    /// Its `/metrics` address (IP:PORT), when `extra` asked for one with `--metrics`.
    pub metrics: Option<String>,
}

impl Kilnd {
    pub fn start(state: &Path, extra: &[&str]) -> Kilnd {
        Kilnd::start_env(state, extra, &[])
    }

    /// [`Kilnd::start`] with `env` added to its environment.
    pub fn start_env(state: &Path, extra: &[&str], env: &[(&str, &str)]) -> Kilnd {
        Kilnd::start_at(state, "tcp:127.0.0.1:0", extra, env)
    }

    /// A kilnd whose management listens on `mgmt`.
    pub fn start_at(state: &Path, mgmt: &str, extra: &[&str], env: &[(&str, &str)]) -> Kilnd {
        let log = state.with_extension("log");
        let child = kiln()
            .envs(env.iter().copied())
            .args(["server", "--mgmt", mgmt])
            .args(if extra.contains(&"--metrics") {
                &[][..]
            } else {
                &["--metrics", "off"][..]
            })
            .arg("--state-dir")
            .arg(state)
            .args(extra)
            .env(
                "KILN_LOG",
                std::env::var("KILN_TEST_KILND_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn kiln server");
        let mut kd = Kilnd {
            child,
            addr: String::new(),
            log,
            metrics: None,
        };
        let mut out = BufReader::new(kd.child.stdout.take().unwrap());
        let mut line = String::new();
        while kd.addr.is_empty() {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "kilnd exited before announcing its management address: {}",
                kd.log_text()
            );
            if let Some(a) = line.trim().strip_prefix("kilnd: management on ") {
                kd.addr = a.to_owned();
            }
            if let Some(a) = line.trim().strip_prefix("kilnd: metrics on http://") {
                kd.metrics = Some(a.trim_end_matches("/metrics").to_owned());
            }
        }
        kd
    }

    /// Kills kilnd (not its bricks, which outlive it on purpose).
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until kilnd's log has a line with every one of `words`; returns the log.
    pub fn wait_log(&self, words: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let text = self.log_text();
            if text.lines().any(|l| words.iter().all(|w| l.contains(w))) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {words:?} in:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Kilnd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Kills every brick process the state directory records (they outlive kilnd on purpose).
pub struct BrickReaper(pub PathBuf);

impl Drop for BrickReaper {
    fn drop(&mut self) {
        for pid in recorded_pids(&self.0) {
            let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&*self.0.to_string_lossy()))
                .unwrap_or(false);
            if ours {
                // SAFETY: kill(2) with a pid and a signal number has no memory effects.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
    }
}

/// The brick pids a kilnd's state directory records (its copy of the pool's store).
pub fn recorded_pids(state: &Path) -> Vec<u64> {
    let Ok(t) = std::fs::read(state.join("pool/sm.json")) else {
        return Vec::new();
    };
    let Ok(sm) = serde_json::from_slice::<Value>(&t) else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for (k, v) in sm["kv"].as_object().into_iter().flatten() {
        if k.starts_with("vol/") {
            let bricks = v["value"]["bricks"].as_array().into_iter().flatten();
            pids.extend(bricks.filter_map(|b| b["pid"].as_u64()));
        }
    }
    pids
}

pub fn run(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut c = kiln();
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run kiln")
}

/// Runs `kiln ARGS --server ADDR --state-dir STATE` against a management kilnd and returns
/// stdout; panics with stderr on failure.
pub fn mgmt_ok(kd: &Kilnd, state: &Path, args: &[&str]) -> String {
    let mut a = args.to_vec();
    a.extend(["--server", &kd.addr, "--state-dir"]);
    a.push(state.to_str().unwrap());
    ok(&a)
}

/// Runs `kiln ARGS` and returns stdout; panics with stderr on failure.
pub fn ok(args: &[&str]) -> String {
    let out = run(args, &[]);
    assert!(
        out.status.success(),
        "kiln {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `kiln ARGS` (with `env`), expects failure, returns stderr.
pub fn fails_env(args: &[&str], env: &[(&str, &Path)]) -> String {
    let out = run(args, env);
    assert!(
        !out.status.success(),
        "kiln {args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).unwrap()
}

pub fn fails(args: &[&str]) -> String {
    fails_env(args, &[])
}

/// Kills a brick process (`SIGKILL`) and waits until it is gone or a zombie: until then it
/// may still hold its port, and kilnd would take it for running.
pub fn kill_brick_pid(pid: i32) {
    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_for("the killed brick to go", 10, || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true)
    });
}

/// The regular files under brick directory `dir` (its state directory left out), as sorted
/// relative paths.
pub fn brick_files(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == ".kiln" {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                walk(root, &p, out);
            } else {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// `kiln volume status VOL --json` against a management kilnd: the volume's entry.
pub fn status(addr: &str, sd: &str, vol: &str) -> serde_json::Value {
    let s = ok(&[
        "volume",
        "status",
        vol,
        "--server",
        addr,
        "--state-dir",
        sd,
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&s).unwrap();
    v["volumes"][0].clone()
}

/// Which bricks a volume's status (as [`status`] returns it) says are online, in order.
pub fn online(st: &serde_json::Value) -> Vec<bool> {
    st["bricks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["online"] == true)
        .collect()
}

/// `kiln server --metrics off ARGS` that must refuse to start; its stderr.
pub fn refused_kilnd(args: &[&std::ffi::OsStr]) -> String {
    let out = kiln()
        .args(["server", "--metrics", "off"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "kilnd started: {err}");
    err
}
