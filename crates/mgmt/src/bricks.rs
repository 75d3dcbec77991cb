//! Brick processes: spawned, adopted after a restart, supervised and stopped.

use crate::def::{is_local, parse_sockaddr, VolState, VolumeDef};
use crate::manager::{Manager, Procs};
use crate::peers::CONNECT_TIMEOUT;
use crate::request::Request;
use crate::response::Ack;
use crate::store::write_atomic;
use crate::volfiles::brick_volfile;
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
    /// Called once at startup, before the management port answers.
    pub fn restore(&self) {
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        let mut moved = Vec::new();
        for mut def in self.load_all() {
            if def.state != VolState::Started {
                continue;
            }
            let mut changed = false;
            let mut ports_changed = Vec::new();
            for i in 0..def.bricks.len() {
                if !def.bricks[i].ip().is_ok_and(is_local) {
                    continue;
                }
                match self.ensure_brick(&mut procs, &def, i) {
                    Ok((port, pid)) => {
                        let b = &mut def.bricks[i];
                        changed |= b.port != Some(port) || b.pid != Some(pid) || !b.settled;
                        if b.port != Some(port) {
                            ports_changed.push(i);
                        }
                        b.ran(port, pid);
                    }
                    Err(e) => tracing::warn!(
                        "volume {}: brick {} did not start: {e}",
                        def.name,
                        def.bricks[i].spec()
                    ),
                }
            }
            if changed {
                if let Err(e) = self.save(&def) {
                    tracing::warn!("volume {}: {e}", def.name);
                }
            }
            tracing::info!("volume {}: restored", def.name);
            if !ports_changed.is_empty() {
                moved.push((def, ports_changed));
            }
        }
        drop(procs);
        // Bricks that came back on another port: the authority and the other peers must
        // hand out the new port in volfiles.
        for (def, bricks) in moved {
            let r = match &def.authority {
                None => {
                    let w = self.sync_all(&def);
                    if w.is_empty() {
                        Ok(())
                    } else {
                        Err(w.join("; "))
                    }
                }
                Some(auth) => parse_sockaddr(auth).and_then(|a| {
                    bricks.iter().try_for_each(|&i| {
                        let b = &def.bricks[i];
                        let req = Request::BrickReport {
                            name: def.name.clone(),
                            id: def.id.clone(),
                            index: i,
                            port: b.port,
                            pid: b.pid,
                        };
                        self.call_peer::<Ack>(a, &req).map(|_| ())
                    })
                }),
            };
            if let Err(e) = r {
                tracing::warn!("volume {}: new brick ports not passed on: {e}", def.name);
            }
        }
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

    /// Makes brick `i` of `def` run on this host; returns its port and pid.
    pub(crate) fn ensure_brick(
        &self,
        procs: &mut Procs,
        def: &VolumeDef,
        i: usize,
    ) -> Result<(u16, u32), String> {
        let b = &def.bricks[i];
        let ip = b.ip()?;
        let vf_path = self.brick_volfile_path(&def.name, i);
        if let (Some(port), Some(pid)) = (b.port, b.pid) {
            if self.pid_runs_brick(procs, pid, &vf_path) && port_answers(SocketAddr::new(ip, port))
            {
                return Ok((port, pid));
            }
        }
        fs::create_dir_all(&b.dir)
            .map_err(|e| format!("cannot create brick directory {}: {e}", b.dir.display()))?;
        let vf = brick_volfile(def, i, &b.dir);
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
        let mut last = String::new();
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
                Ok(pid) => {
                    tracing::info!(
                        "volume {}: brick {} runs as pid {pid} on port {port}",
                        def.name,
                        b.spec()
                    );
                    return Ok((port, pid));
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

    /// Spawns a brick and waits until it listens. On failure: the message and whether another
    /// port may help.
    pub(crate) fn spawn_brick(
        &self,
        procs: &mut Procs,
        def: &VolumeDef,
        i: usize,
        ip: IpAddr,
        port: u16,
        log_path: &Path,
    ) -> Result<u32, (String, bool)> {
        let vf_path = self.brick_volfile_path(&def.name, i);
        let fail = |e: String| (e, false);
        let log = fs::File::create(log_path)
            .map_err(|e| fail(format!("cannot create {}: {e}", log_path.display())))?;
        let log2 = log
            .try_clone()
            .map_err(|e| fail(format!("{}: {e}", log_path.display())))?;
        let listen = format!("tcp:{}", SocketAddr::new(ip, port));
        let mut cmd = Command::new(&self.exe[0]);
        cmd.args(&self.exe[1..])
            .arg("--volfile")
            .arg(&vf_path)
            .args(["--listen", &listen, "--metrics", "off", "--secret-file"])
            .arg(self.secret_path(&def.name));
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
            .map_err(|e| fail(format!("cannot run {:?}: {e}", self.exe[0])))?;
        let pid = child.id();
        let deadline = Instant::now() + BRICK_START_TIMEOUT;
        loop {
            let text = fs::read_to_string(log_path).unwrap_or_default();
            if text.contains("kilnd: listening on") {
                procs.children.insert(pid, child);
                return Ok(pid);
            }
            if let Ok(Some(status)) = child.try_wait() {
                let tail: String = text.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                let retry = text.contains("in use");
                return Err((
                    format!("brick exited ({status}) on {listen}: {tail}"),
                    retry,
                ));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err((format!("brick did not listen on {listen} in time"), false));
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
pub(crate) fn free_port(ip: IpAddr, taken: &BTreeSet<u16>, first: u16) -> Result<u16, String> {
    (first..=u16::MAX)
        .find(|p| !taken.contains(p) && port_free(ip, *p))
        .ok_or_else(|| format!("no free port on {ip} from {first}"))
}

pub(crate) fn lock_port(m: &Mutex<u16>) -> std::sync::MutexGuard<'_, u16> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
