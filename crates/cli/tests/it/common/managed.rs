//! A managed volume for the tests that run clients on one: a management kilnd, a volume of
//! its bricks, and `kiln mount` / `kiln nbd` processes over it.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{kiln, mgmt_ok, Kilnd};

/// A child process killed (and reaped) when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // Already waited for: its pid may be another process's now.
        if let Ok(Some(_)) = self.0.try_wait() {
            return;
        }
        // SAFETY: kill(2) with a pid and a signal number has no memory effects.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `cmd` and reads its stdout until a line starts with `ready` (returned); the rest
/// of its output is drained in the background.
pub fn spawn_until(mut cmd: Command, ready: &str) -> (Proc, String) {
    let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawn");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).expect("read");
        assert!(n > 0, "{ready:?} never came: the process exited");
        if line.starts_with(ready) {
            break;
        }
    }
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = out.read_to_end(&mut sink);
    });
    (Proc(child), line.trim().to_owned())
}

pub struct Vol {
    pub kd: Kilnd,
    pub state: PathBuf,
    pub name: String,
    pub secret: PathBuf,
}

impl Vol {
    pub fn new(tmp: &Path, name: &str, replica: usize, port_base: &str) -> Vol {
        Vol::with_kilnd_args(tmp, name, replica, &["--brick-port-base", port_base])
    }

    /// A volume of a kilnd started with `args`, bricks `b0`, `b1`, … beneath `tmp`.
    pub fn with_kilnd_args(tmp: &Path, name: &str, replica: usize, args: &[&str]) -> Vol {
        Vol::with_bricks(tmp, name, replica, replica, args)
    }

    /// A volume of `count` bricks, `replica` per set, of a kilnd started with `args`.
    pub fn with_bricks(tmp: &Path, name: &str, replica: usize, count: usize, args: &[&str]) -> Vol {
        Vol::created_with(tmp, name, replica, count, args, &[])
    }

    /// As [`Vol::with_bricks`], with `create` given `create_args` too.
    pub fn created_with(
        tmp: &Path,
        name: &str,
        replica: usize,
        count: usize,
        args: &[&str],
        create_args: &[&str],
    ) -> Vol {
        let state = tmp.join("state");
        let kd = Kilnd::start(&state, args);
        let mut args: Vec<String> = ["volume", "create", name].map(String::from).to_vec();
        args.extend(create_args.iter().map(|a| a.to_string()));
        if replica > 1 {
            args.extend(["replica".into(), replica.to_string()]);
        }
        for i in 0..count {
            args.push(format!("127.0.0.1:{}", tmp.join(format!("b{i}")).display()));
        }
        let v = Vol {
            secret: state.join(format!("vols/{name}/secret")),
            kd,
            state,
            name: name.into(),
        };
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        v.mgmt(&a);
        v.mgmt(&["volume", "start", name]);
        v
    }

    pub fn mgmt(&self, args: &[&str]) -> String {
        mgmt_ok(&self.kd, &self.state, args)
    }

    pub fn status(&self) -> Value {
        let s = self.mgmt(&["volume", "status", &self.name, "--json"]);
        let v: Value = serde_json::from_str(&s).unwrap();
        v["volumes"][0].clone()
    }

    /// The volume's rebalance as `rebalance status --json` shows it.
    pub fn rebalance_status(&self) -> Value {
        let s = self.mgmt(&["volume", "rebalance", &self.name, "status", "--json"]);
        serde_json::from_str(&s).unwrap()
    }

    /// Waits for the volume's rebalance to end; returns its last status.
    pub fn wait_rebalance(&self, secs: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let last = self.rebalance_status();
            if last["state"] != "running" {
                return last;
            }
            if Instant::now() > deadline {
                let log = self.kd.log_text();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "the rebalance did not end: {last}\nkilnd: {}",
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn all_online(&self) -> bool {
        let st = self.status();
        st["bricks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["online"] == true)
    }

    pub fn pid(&self, i: usize) -> i32 {
        self.status()["bricks"][i]["pid"].as_u64().unwrap() as i32
    }

    pub fn source(&self, path: &str) -> String {
        format!("{}:/{}{path}", self.kd.addr, self.name)
    }

    pub fn mount(&self, mnt: &Path) -> Proc {
        self.mount_env(mnt, &[("KILN_LOG", "warn")])
    }

    /// Mounts with `env` added (a log file: `KILN_TEST_STDERR`).
    pub fn mount_env(&self, mnt: &Path, env: &[(&str, &str)]) -> Proc {
        self.mount_with(mnt, &self.secret, env)
    }

    /// Mounts proving `key` (an identity's key file) instead of the volume's secret.
    pub fn mount_as(&self, mnt: &Path, key: &Path) -> Proc {
        self.mount_with(mnt, key, &[("KILN_LOG", "warn")])
    }

    fn mount_with(&self, mnt: &Path, key: &Path, env: &[(&str, &str)]) -> Proc {
        let mut c = kiln();
        c.args([
            "mount",
            &self.source(""),
            "--mode",
            "vm-image",
            "--secret-file",
        ])
        .arg(key)
        .arg(mnt);
        with_env(&mut c, env);
        spawn_until(c, "kiln: mounted").0
    }

    /// Exports `image`; returns the export and its URI.
    pub fn nbd(&self, image: &str, sock: &Path) -> (Proc, String) {
        self.nbd_env(image, sock, &[("KILN_LOG", "warn")])
    }

    /// Exports `image` with `env` added (see [`Vol::mount_env`]).
    pub fn nbd_env(&self, image: &str, sock: &Path, env: &[(&str, &str)]) -> (Proc, String) {
        let mut c = self.nbd_cmd(image, sock, &self.secret);
        with_env(&mut c, env);
        let (p, line) = spawn_until(c, "kiln nbd: exporting");
        let uri = line.rsplit(" at ").next().expect("the URI").to_owned();
        (p, uri)
    }
}

impl Vol {
    /// The `kiln nbd` command that exports `image` at `sock`, proving `key`.
    pub fn nbd_cmd(&self, image: &str, sock: &Path, key: &Path) -> Command {
        let mut c = kiln();
        c.args(["nbd", &self.source(image), "--secret-file"])
            .arg(key)
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()));
        c
    }
}

/// Adds `env` to `c`; `KILN_TEST_STDERR` names a file for its stderr instead.
fn with_env(c: &mut Command, env: &[(&str, &str)]) {
    for (k, v) in env {
        if *k == "KILN_TEST_STDERR" {
            c.stderr(std::fs::File::create(v).expect("create the log file"));
        } else {
            c.env(k, v);
        }
    }
}
