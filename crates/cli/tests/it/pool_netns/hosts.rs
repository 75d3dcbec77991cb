//! Hosts in network namespaces for the pool tests: each a kilnd of its own with a TLS
//! identity, on one bridge, driven with `kiln` as an operator would; a fourth host for
//! clients.

// Shared by two test binaries; each uses a part.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use super::common::{kiln, recorded_pids, wait_for};
use kiln_testkit::net::ip;
use serde_json::Value;

/// Namespaces `h0`…: host `i` at 10.78.0.(i+1) on one bridge (in its own namespace). Removed
/// with everything this test started in them when dropped.
pub struct Hosts {
    prefix: String,
    n: usize,
    pub tmp: PathBuf,
    kilnds: Vec<Option<Child>>,
    /// The kilnds' heal interval (`--heal-interval`, seconds; 0: none).
    pub heal_interval: u32,
}

impl Hosts {
    /// [`Hosts::setup`] for a test: None (having said why) when this machine cannot run it —
    /// not root, or no network namespaces; fio must be there (`scripts/test.sh` installs it).
    pub fn for_test(n: usize, tmp: &Path) -> Option<Hosts> {
        if !kiln_testkit::is_root() {
            println!("skipping: network namespaces need root");
            return None;
        }
        assert!(
            Command::new("fio").arg("--version").output().is_ok(),
            "fio is needed (scripts/test.sh installs it)"
        );
        Hosts::setup(n, tmp)
            .map_err(|e| println!("skipping: cannot set up network namespaces: {e}"))
            .ok()
    }

    pub fn setup(n: usize, tmp: &Path) -> std::io::Result<Hosts> {
        // Named after this process and a count, so that pools set up at once (tests in one
        // process, or in several) never share a namespace or interface name.
        static SETUPS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
        let nth = SETUPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 26;
        let prefix = format!("kp{}{}", std::process::id(), char::from(b'a' + nth));
        let h = Hosts {
            prefix: prefix.clone(),
            n,
            tmp: tmp.to_owned(),
            kilnds: (0..n).map(|_| None).collect(),
            heal_interval: 0,
        };
        let sw = h.ns_name("sw");
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let ns = h.ns(i);
            let (vh, vs) = (format!("{prefix}h{i}"), format!("{prefix}s{i}"));
            ip(&["netns", "add", &ns])?;
            ip(&["link", "add", &vh, "type", "veth", "peer", "name", &vs])?;
            ip(&["link", "set", &vh, "netns", &ns])?;
            ip(&["link", "set", &vs, "netns", &sw])?;
            ip(&["-n", &sw, "link", "set", &vs, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", h.ip(i)),
                "dev",
                &vh,
            ])?;
            ip(&["-n", &ns, "link", "set", &vh, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }

    pub fn ns_name(&self, what: &str) -> String {
        format!("{}-{what}", self.prefix)
    }

    pub fn ns(&self, i: usize) -> String {
        self.ns_name(&format!("h{i}"))
    }

    pub fn ip(&self, i: usize) -> String {
        format!("10.78.0.{}", i + 1)
    }

    pub fn mgmt(&self, i: usize) -> String {
        format!("tcp:{}:24007", self.ip(i))
    }

    pub fn state(&self, i: usize) -> PathBuf {
        self.tmp.join(format!("state{i}"))
    }

    /// Host `i`'s TLS identity (its kilnd serves and dials with it).
    pub fn tls(&self, i: usize) -> PathBuf {
        self.tmp.join(format!("tls{i}"))
    }

    /// The operator's and the mount's identity.
    pub fn client_tls(&self) -> PathBuf {
        self.tmp.join("tls-client")
    }

    /// A CA, an identity per host naming its address, and one for clients.
    pub fn issue_identities(&self) {
        let ca = self.tmp.join("ca");
        let run = |args: &[&str]| {
            let out = kiln().args(args).output().unwrap();
            assert!(
                out.status.success(),
                "kiln {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ca = ca.to_str().unwrap();
        run(&["tls", "init", ca]);
        let issue = |out: PathBuf, name: &str, san: &[&str]| {
            let out = out.to_str().unwrap().to_owned();
            let mut args = vec!["tls", "issue", "--ca", ca, "--out", &out, name];
            for s in san {
                args.extend(["--san", s]);
            }
            run(&args);
        };
        for i in 0..self.n {
            issue(self.tls(i), &format!("host{i}"), &[&self.ip(i)]);
        }
        issue(self.client_tls(), "operator", &[]);
    }

    /// Host `i`'s link up or down (a partition).
    pub fn link(&self, i: usize, up: bool) {
        let dev = format!("{}h{i}", self.prefix);
        let how = if up { "up" } else { "down" };
        ip(&["-n", &self.ns(i), "link", "set", &dev, how]).unwrap();
    }

    /// Starts host `i`'s kilnd and waits until its management port answers.
    pub fn start(&mut self, i: usize) {
        let log = self.tmp.join(format!("kilnd{i}.log"));
        let mut child =
            kiln_testkit::net::command_in(Some(&self.ns(i)), env!("CARGO_BIN_EXE_kiln"))
                .args(["server", "--mgmt", &self.mgmt(i), "--metrics", "off"])
                .args([
                    "--heal-interval",
                    &self.heal_interval.to_string(),
                    "--state-dir",
                ])
                .arg(self.state(i))
                .arg("--tls")
                .arg(self.tls(i))
                .env("KILN_LOG", "info")
                // A start cut short by a leader kill leaves bricks of a volume still "created":
                // their host's kilnd stops them once they are this old.
                .env("KILN_ORPHAN_GRACE_MS", "3000")
                .stdout(Stdio::piped())
                .stderr(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&log)
                        .unwrap(),
                )
                .spawn()
                .expect("spawn kiln server");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            let n = out.read_line(&mut line).unwrap();
            assert!(n > 0, "kilnd {i} exited early: {}", self.log(i));
            if line.starts_with("kilnd: management on") {
                break;
            }
        }
        self.kilnds[i] = Some(child);
    }

    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.tmp.join(format!("kilnd{i}.log"))).unwrap_or_default()
    }

    /// SIGKILL (`hard`) or SIGTERM to host `i`'s kilnd (its bricks live on, by design).
    pub fn stop(&mut self, i: usize, hard: bool) {
        if let Some(mut c) = self.kilnds[i].take() {
            if hard {
                let _ = c.kill();
            } else {
                // SAFETY: kill(2) with a pid and a signal number has no memory effects.
                unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            }
            let _ = c.wait();
        }
    }

    pub fn up(&self) -> Vec<usize> {
        (0..self.n).filter(|&i| self.kilnds[i].is_some()).collect()
    }

    /// `kiln ARGS --server HOST_i --json` from inside host `i`.
    pub fn kiln_at(&self, i: usize, args: &[&str]) -> Output {
        self.kiln_cmd(i, args).output().expect("run kiln")
    }

    /// The command [`Hosts::kiln_at`] runs, to be spawned and waited for later.
    pub fn kiln_cmd(&self, i: usize, args: &[&str]) -> Command {
        let secret = self.state(0).join("mgmt.secret");
        let mut c = kiln_testkit::net::command_in(Some(&self.ns(i)), env!("CARGO_BIN_EXE_kiln"));
        c.args(args)
            .args(["--server", &self.mgmt(i), "--json", "--mgmt-secret-file"])
            .arg(secret)
            .env("KILN_TLS_DIR", self.client_tls())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// [`Hosts::kiln_at`] that must succeed; its JSON.
    pub fn ok(&self, i: usize, args: &[&str]) -> Value {
        let out = self.kiln_at(i, args);
        assert!(
            out.status.success(),
            "kiln {args:?} at host {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("JSON reply")
    }

    pub fn pool(&self, i: usize) -> Value {
        self.ok(i, &["pool", "list"])
    }

    pub fn leader(&self, i: usize) -> Option<usize> {
        let p = self.pool(i);
        let id = p["leader"].as_u64()?;
        let m = p["members"].as_array()?.iter().find(|m| m["id"] == id)?;
        let addr = m["addr"].as_str()?;
        (0..self.n).find(|&h| addr == format!("{}:24007", self.ip(h)))
    }

    /// Waits until every running member names the same running leader; returns it.
    pub fn settled_leader(&self, secs: u64) -> usize {
        let mut found = None;
        wait_for(
            "the running members to agree on a running leader",
            secs,
            || {
                let seen: Vec<Option<usize>> = self.up().iter().map(|&i| self.leader(i)).collect();
                found =
                    seen[0].filter(|l| self.up().contains(l) && seen.iter().all(|s| *s == seen[0]));
                found.is_some()
            },
        );
        found.unwrap()
    }

    /// Waits until the running members have applied the same version; returns it.
    pub fn agreed_version(&self, secs: u64) -> u64 {
        let mut v = 0;
        wait_for(
            "the running members to apply the same version",
            secs,
            || {
                let vs: Vec<u64> = self
                    .up()
                    .iter()
                    .map(|&i| self.pool(i)["version"].as_u64().unwrap())
                    .collect();
                v = vs[0];
                vs.iter().all(|x| *x == v)
            },
        );
        v
    }

    pub fn info(&self, i: usize) -> Value {
        self.ok(i, &["volume", "info"])
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..self.n {
            self.stop(i, true);
            for pid in recorded_pids(&self.state(i)) {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&cmd).contains(&*self.tmp.to_string_lossy()) {
                    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
            }
        }
        for i in 0..self.n {
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["netns", "del", &self.ns_name("sw")]);
    }
}

impl Hosts {
    /// Mounts volume `vol` at `mnt` from the client host (the last one, in no pool) as a
    /// trusted host of its own (`auth add client --root`), in `vm-image` mode.
    pub fn mount_at_client(&self, vol: &str, mnt: &Path) -> super::common::managed::Proc {
        std::fs::create_dir_all(mnt).unwrap();
        let key = self.tmp.join(format!("client-{vol}.key"));
        let k = key.to_str().unwrap();
        let args = [
            "auth",
            "add",
            "client",
            "--volume",
            vol,
            "--root",
            "--key-file",
            k,
        ];
        self.ok(0, &args);
        let mut c = kiln();
        c.args([
            "mount",
            &format!("{}:/{vol}", self.mgmt(0)),
            "--mode",
            "vm-image",
        ])
        .arg(mnt)
        .env("KILN_SECRET_FILE", &key)
        .env("KILN_TLS_DIR", self.client_tls())
        .env(
            "KILN_LOG",
            "warn,kiln_client::graph=debug,kiln_client::protocol=info",
        );
        // The mount's network is the client host's. Only the network: `ip netns exec` would
        // give it a mount namespace of its own too, where the test (and fio) could not see
        // the mount.
        let mut mount = Command::new("nsenter");
        mount
            .arg(format!("--net=/run/netns/{}", self.ns(self.n - 1)))
            .arg(c.get_program());
        mount.args(c.get_args());
        for (k, v) in c.get_envs() {
            match v {
                Some(v) => mount.env(k, v),
                None => mount.env_remove(k),
            };
        }
        let log = std::fs::File::create(self.mount_log(vol)).unwrap();
        mount.stderr(log);
        super::common::managed::spawn_until(mount, "kiln: mounted").0
    }

    /// The log of [`Hosts::mount_at_client`]'s mount of `vol`.
    pub fn mount_log(&self, vol: &str) -> PathBuf {
        self.tmp.join(format!("mount-{vol}.log"))
    }

    /// How many lines of the mount's log of `vol` say `what` about the brick on host `i`.
    pub fn mount_says(&self, vol: &str, what: &str, i: usize) -> usize {
        let brick = format!("{}:", self.ip(i));
        std::fs::read_to_string(self.mount_log(vol))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(what) && l.contains(&brick))
            .count()
    }
}

impl Hosts {
    /// The first three hosts form a pool (one management secret, TLS identities of their
    /// own) and start a replica-3 volume `vol` with a brick on each (`TMP/brickI`).
    pub fn form_pool(&mut self, vol: &str) {
        self.issue_identities();
        self.start(0);
        for i in [1, 2] {
            std::fs::create_dir_all(self.state(i)).unwrap();
            let secret = self.state(0).join("mgmt.secret");
            std::fs::copy(secret, self.state(i).join("mgmt.secret")).unwrap();
            self.start(i);
        }
        for i in [1, 2] {
            self.ok(0, &["peer", "probe", &self.ip(i)]);
        }
        let bricks: Vec<String> = (0..3)
            .map(|i| {
                format!(
                    "{}:{}",
                    self.ip(i),
                    self.tmp.join(format!("brick{i}")).display()
                )
            })
            .collect();
        let mut create = vec!["volume", "create", vol, "replica", "3"];
        create.extend(bricks.iter().map(String::as_str));
        self.ok(0, &create);
        self.ok(0, &["volume", "start", vol]);
        self.agreed_version(30);
    }
}
