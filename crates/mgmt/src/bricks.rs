//! Brick processes: spawned, adopted after a restart, supervised and stopped.

use crate::def::{is_local, VolState, VolumeDef};
use crate::manager::{Manager, Procs};
use crate::peers::CONNECT_TIMEOUT;
use crate::response::BrickStarted;
use crate::store::write_atomic;
use crate::volfiles::brick_volfile;
use kiln_proto::error::Context as _;
use kiln_proto::sync::MutexExt as _;
use kiln_proto::Error;
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a brick may take to bind its port after being spawned.
const BRICK_START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a brick may take to exit after SIGTERM before it gets SIGKILL.
const BRICK_STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// The command that runs a brick: this executable, as `kilnd` or as `kiln server`.
pub fn brick_command() -> io::Result<Vec<OsString>> {
    let exe = std::env::current_exe()?;
    // A binary rebuilt while running shows as "PATH (deleted)"; the new file is what we want.
    let s = exe.to_string_lossy();
    let exe = match s.strip_suffix(" (deleted)") {
        Some(p) => PathBuf::from(p),
        None => exe,
    };
    let is_kiln = exe.file_name().is_some_and(|n| n == "kiln");
    let mut cmd = vec![exe.into_os_string()];
    if is_kiln {
        cmd.push("server".into());
    }
    Ok(cmd)
}

impl Manager {
    /// Restarts the local bricks of every started volume (adopting those still running).
    /// Called once at startup, while the management port answers the pool (volume commands
    /// wait for it).
    pub fn restore(&self) {
        let mut procs = self.procs.locked();
        match self.import_local() {
            Ok(0) => {}
            Ok(n) => tracing::info!("{n} volume(s) moved into the pool's store"),
            Err(e) => tracing::warn!(
                "volumes kept in {} not moved into the pool's store: {e}",
                self.state.display()
            ),
        }
        for def in self.load_all() {
            if def.state != VolState::Started {
                continue;
            }
            let mut ran = Vec::new();
            for i in 0..def.bricks.len() {
                if def.bricks[i].removed || !def.bricks[i].ip().is_ok_and(is_local) {
                    continue;
                }
                match self.ensure_brick(&mut procs, &def, i) {
                    Ok(r) => {
                        let b = &def.bricks[i];
                        if BrickStarted::of(b) != Some(r) || !b.settled {
                            ran.push((i, r));
                        }
                    }
                    Err(e) => tracing::warn!(
                        volume = %def.name,
                        "brick {} did not start: {e}",
                        def.bricks[i].spec()
                    ),
                }
            }
            // Where the bricks run now goes to the pool's store (clients' volfiles name the
            // ports), whichever member made the volume's last change.
            if !ran.is_empty() {
                if let Err(e) = self.update(&def.name, |d| {
                    for (i, r) in &ran {
                        if let Some(b) = d.bricks.get_mut(*i) {
                            r.record_in(b);
                        }
                    }
                }) {
                    tracing::warn!(
                        volume = %def.name,
                        "where its bricks run now is not recorded: {e}"
                    );
                }
            }
            tracing::info!(volume = %def.name, "restored");
        }
    }

    /// Changes the definition of `name` by `f` in the pool's store, made only if nothing else
    /// changed it meanwhile (read again and retried otherwise).
    pub(crate) fn update(&self, name: &str, f: impl Fn(&mut VolumeDef)) -> Result<(), Error> {
        for _ in 0..8 {
            let (mut def, version) = self.load_versioned(name)?;
            f(&mut def);
            let cmd = crate::pool::Cmd::Put {
                key: crate::store::vol_key(name),
                value: serde_json::to_value(&def).expect("a definition serialises"),
                expect: Some(version),
            };
            match self.pool()?.write(cmd)?.outcome {
                crate::pool::Outcome::Done { .. } => return Ok(()),
                crate::pool::Outcome::Conflict { .. } => {
                    // Not applied here yet, perhaps: wait for this member's copy to move on.
                    self.pool()?.wait_applied(Duration::from_secs(2));
                }
            }
        }
        Err(Error::conflict(format!(
            "volume {name} kept changing: not updated"
        )))
    }

    /// Authority side: a peer restarted one of its bricks on another port.
    pub(crate) fn pid_runs_brick(&self, procs: &mut Procs, pid: u32, volfile: &Path) -> bool {
        if let Some(c) = procs.children.get_mut(&pid) {
            if !matches!(c.try_wait(), Ok(None)) {
                procs.children.remove(&pid);
                return false;
            }
            return true;
        }
        // Not our child (adopted after a restart): check what it runs, and that it is not a
        // zombie waiting for some other parent.
        let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
            return false;
        };
        let want = volfile.as_os_str().as_encoded_bytes();
        let runs = cmdline.split(|b| *b == 0).any(|a| a == want);
        let zombie = fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        runs && !zombie
    }

    /// Makes brick `i` of `def` run on this host; returns where it runs.
    pub(crate) fn ensure_brick(
        &self,
        procs: &mut Procs,
        def: &VolumeDef,
        i: usize,
    ) -> Result<BrickStarted, Error> {
        let b = &def.bricks[i];
        let ip = b.ip()?;
        let vf_path = self.brick_volfile_path(&def.name, i);
        if let Some(r) = BrickStarted::of(b) {
            if self.pid_runs_brick(procs, r.pid, &vf_path)
                && port_answers(SocketAddr::new(ip, r.port))
            {
                return Ok(r);
            }
        }
        // Checked again here, on the brick's own host: the kilnd that took the definition
        // cannot see this host's state directory or symlinks.
        crate::def::check_not_state(&b.spec(), &crate::def::real_path(&b.dir), &self.state)?;
        fs::create_dir_all(&b.dir)
            .with_context(|| format!("cannot create brick directory {}", b.dir.display()))?;
        let vf = brick_volfile(def, i, &b.dir)?;
        let bricks_dir = self.vol_dir(&def.name).join("bricks");
        write_atomic(
            &bricks_dir,
            &format!("{i}.toml"),
            vf.to_toml().as_bytes(),
            0o644,
        )?;
        // Ports of every brick this kilnd knows on this address are taken, even if down.
        let mut taken: BTreeSet<u16> = self
            .load_all()
            .iter()
            .flat_map(|d| {
                d.bricks
                    .iter()
                    .enumerate()
                    .filter(|(j, x)| !(d.name == def.name && *j == i) && x.ip().ok() == Some(ip))
                    .filter_map(|(_, x)| x.port)
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut preferred = b.port;
        let log_path = bricks_dir.join(format!("{i}.log"));
        let mut last = Error::failed("no port to start the brick on");
        for _ in 0..16 {
            let port = match preferred
                .take()
                .filter(|p| !taken.contains(p) && port_free(ip, *p))
            {
                Some(p) => p,
                None => free_port(ip, &taken, *lock_port(&self.first_brick_port))?,
            };
            taken.insert(port);
            match self.spawn_brick(procs, def, i, ip, port, &log_path) {
                Ok((pid, metrics)) => {
                    tracing::info!(
                        volume = %def.name,
                        "brick {} runs as pid {pid} on port {port}",
                        b.spec()
                    );
                    return Ok(BrickStarted { port, pid, metrics });
                }
                Err((e, retry)) => {
                    last = e;
                    if !retry {
                        break;
                    }
                }
            }
        }
        Err(last)
    }

    /// Spawns a brick and waits until it listens; returns its pid and metrics port. On
    /// failure: the message and whether another port may help.
    pub(crate) fn spawn_brick(
        &self,
        procs: &mut Procs,
        def: &VolumeDef,
        i: usize,
        ip: IpAddr,
        port: u16,
        log_path: &Path,
    ) -> Result<(u32, Option<u16>), (Error, bool)> {
        let vf_path = self.brick_volfile_path(&def.name, i);
        let fail = |e: Error| (e, false);
        // The brick reads who may connect, besides the volume's secret, at its start.
        self.write_identities(def).map_err(fail)?;
        // Appended to: what a brick logged before a restart is what one looks for after it.
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .map_err(|e| {
                fail(Error::io(
                    format_args!("cannot open {}", log_path.display()),
                    &e,
                ))
            })?;
        // Only what this run writes tells whether it is listening.
        let start = log.metadata().map_or(0, |m| m.len() as usize);
        let log2 = log
            .try_clone()
            .map_err(|e| fail(Error::io(log_path.display(), &e)))?;
        let listen = format!("tcp:{}", SocketAddr::new(ip, port));
        let mut cmd = Command::new(&self.exe[0]);
        cmd.args(&self.exe[1..])
            .arg("--volfile")
            .arg(&vf_path)
            // On loopback, like every Kiln process's /metrics: the endpoint has no
            // authentication (its profile routes change io-stats intervals), so it is not
            // offered to the network; a scraper on the host reads it, or relays it.
            .args(["--listen", &listen, "--metrics", "127.0.0.1:0"])
            .arg("--identities")
            .arg(self.vol_dir(&def.name).join("identities.json"));
        if def.shared_secret != Some(false) {
            cmd.arg("--secret-file").arg(self.secret_path(&def.name));
        }
        if let Some(sock) = self.brick_socket(&def.name, i) {
            // Clients on this host reach the brick here: no TCP stack on the way (a third
            // less CPU per byte for replica-3 writes on one host, bench/replicate.py).
            let _ = fs::create_dir_all(sock.parent().expect("in the run directory"));
            cmd.arg("--listen").arg(format!("unix:{}", sock.display()));
        }
        for c in &def.allow {
            cmd.arg("--allow").arg(c);
        }
        cmd.stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            // Its own process group: a signal to kilnd's group (Ctrl-C) leaves bricks alone.
            .process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| fail(Error::io(format_args!("cannot run {:?}", self.exe[0]), &e)))?;
        let pid = child.id();
        let deadline = Instant::now() + BRICK_START_TIMEOUT;
        loop {
            let all = fs::read(log_path).unwrap_or_default();
            let text = String::from_utf8_lossy(all.get(start..).unwrap_or_default());
            // It prints where its /metrics are right after it listens.
            if text.contains("kilnd: listening on") && text.contains("kilnd: metrics on") {
                procs.children.insert(pid, child);
                return Ok((pid, metrics_port(&text)));
            }
            if let Ok(Some(status)) = child.try_wait() {
                let tail: String = text.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                let retry = text.contains("in use");
                return Err((
                    Error::failed(format!("brick exited ({status}) on {listen}: {tail}")),
                    retry,
                ));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err((
                    Error::unavailable(format!("brick did not listen on {listen} in time")),
                    false,
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops brick `i` of `def` if it runs here: SIGTERM, then SIGKILL after a grace period.
    pub(crate) fn stop_brick(&self, procs: &mut Procs, def: &VolumeDef, i: usize) {
        let Some(pid) = def.bricks[i].pid else { return };
        let vf_path = self.brick_volfile_path(&def.name, i);
        if let Some(mut c) = procs.children.remove(&pid) {
            signal(pid, rustix::process::Signal::TERM);
            let deadline = Instant::now() + BRICK_STOP_TIMEOUT;
            while matches!(c.try_wait(), Ok(None)) {
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            return;
        }
        if !self.pid_runs_brick(procs, pid, &vf_path) {
            return;
        }
        signal(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + BRICK_STOP_TIMEOUT;
        while self.pid_runs_brick(procs, pid, &vf_path) {
            if Instant::now() > deadline {
                signal(pid, rustix::process::Signal::KILL);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

pub(crate) fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

pub(crate) fn port_answers(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).is_ok()
}

pub(crate) fn port_free(ip: IpAddr, port: u16) -> bool {
    TcpListener::bind((ip, port)).is_ok()
}

/// The first free port from `first` not in `taken`.
pub(crate) fn free_port(ip: IpAddr, taken: &BTreeSet<u16>, first: u16) -> Result<u16, Error> {
    (first..=u16::MAX)
        .find(|p| !taken.contains(p) && port_free(ip, *p))
        .ok_or_else(|| Error::unavailable(format!("no free port on {ip} from {first}")))
}

pub(crate) fn lock_port(m: &Mutex<u16>) -> std::sync::MutexGuard<'_, u16> {
    m.locked()
}

/// The port of a brick's `/metrics` endpoint, from what it printed once it listened
/// (`kilnd: metrics on http://ADDR/metrics`).
fn metrics_port(log: &str) -> Option<u16> {
    log.lines()
        .rev()
        .find_map(|l| l.strip_prefix("kilnd: metrics on http://"))
        .and_then(|a| a.strip_suffix("/metrics"))
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .map(|a| a.port())
}
