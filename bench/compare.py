#!/usr/bin/env python3
"""Kiln vs GlusterFS vs the loopback network, measured side by side in one run.

For every repetition (--reps, default 3) this runs, in turn:

  net      iperf3, one TCP stream over 127.0.0.1 (the loopback bandwidth
           ceiling), and kiln-pingpong, a 1-byte round trip (the loopback
           latency floor): over TCP unpinned, TCP with both threads on one
           CPU, TCP with the two threads on two CPUs, and a Unix socket;
  jobs     each fio-style job below, once on Kiln and once on GlusterFS, the
           order of the two flipping from one repetition to the next:

             seqread_128k_qd32    sequential read,  128 KiB blocks, queue depth 32
             randread_4k_qd1      random read,        4 KiB blocks, queue depth 1
             randread_4k_qd32     random read,        4 KiB blocks, queue depth 32
             seqwrite_128k_qd32   sequential write, 128 KiB blocks, queue depth 32

           on a 1 GiB file for --runtime seconds (default 10). Kiln's
           seqread runs over both TCP and a Unix socket, the rest over TCP.

It then reports, for every metric, the median over the repetitions, and the
ratios Kiln is held to (each compared with its target, PASS or FAIL):

  seqread_tcp_vs_iperf3          Kiln seqread MB/s (tcp) / iperf3 MB/s        >= 0.8
  seqread_vs_gluster             Kiln seqread MB/s / GlusterFS's              >= 1.6
  seqread_mb_per_cpu_vs_gluster  Kiln seqread MB per CPU-second / GlusterFS's >= 2
  seqread_unix_vs_tcp            Kiln seqread MB/s unix / tcp                 > 1
  randread4k_qd1_p50_minus_pingpong
                                 Kiln 4k QD1 p50 - TCP ping-pong p50 (us)     <= 10
                                 (the unpinned ping-pong; --pingpong-floor)
  randread4k_qd32_iops_vs_gluster
                                 Kiln 4k QD32 IOPS / GlusterFS's              >= 4
  seqwrite_vs_gluster            Kiln seqwrite MB/s / GlusterFS's             >= 1.6

and four that every repetition must meet, each run against its own repetition's baseline:

  seqread_tcp_vs_iperf3_every_run   worst run's Kiln tcp / iperf3                 >= 0.8
  seqread_tcp_spread                Kiln tcp runs' largest distance from median   <= 0.15
  seqread_unix_vs_iperf3_every_run  worst run's Kiln unix / iperf3                >= 1.0
  randread4k_qd1_minus_pingpong_every_run
                                    worst run's 4k QD1 p50 - ping-pong p50 (us)   <= 10

The other ratios are ratios of medians. MB = 10^6 bytes. A human table goes to stderr,
one JSON object to stdout (and to --out FILE).

How each side is measured:

  Kiln       target/release/kiln bench --rw RW --bs BS --iodepth QD --size 1g
             --runtime T --transport tcp|unix --brick DIR --json
             which starts its own kilnd on DIR (a tmpfs this script mounts at
             /tmp/kiln-bench-tmpfs) and prints one JSON line with MB/s, IOPS,
             latency percentiles and client/server CPU seconds.
  GlusterFS  the volume "dist" (one brick on tmpfs) of
             ../shared/bench/gluster.sh, driven by fio through libgfapi
             (gfapi_async; the synchronous gfapi engine for 4k QD1, because
             the async engine's completion path adds ~40 us at QD1). The
             file is laid out by one write pass first, so reads read real
             data. Server CPU is the brick process's utime+stime delta from
             /proc/PID/stat over the run. Client CPU is, by default, the
             whole fio process (getrusage of the reaped child: all of gfapi's
             threads): fio's own usr_cpu/sys_cpu come from
             getrusage(RUSAGE_THREAD) under --thread and so see only the job
             thread, about 1/6 of the client's CPU. Both are in the JSON
             (client_proc_cpu_s, client_fio_cpu_s); --gluster-client-cpu
             picks the one used. Each fio gfapi run also spends ~8 s of
             wall time in gfapi start-up and tear-down, outside the
             measurement but not outside the clock on the wall.

Set-up and clean-up: apt-get installs fio and iperf3 when missing; gluster.sh
up installs and starts GlusterFS, and gluster.sh down stops it at the end,
but only if this script brought it up and --keep-gluster was not given. The
iperf3 server and the Kiln tmpfs are always removed at the end, also on
Ctrl-C. Needs root (or sudo) for apt-get and mount.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KILN_TMPFS = Path("/tmp/kiln-bench-tmpfs")
KILN_TMPFS_SIZE = "4g"
GLUSTER_VOLUME = "dist"
GLUSTER_FILE = "bench.img"

# name, human label, fio/kiln rw, block size, queue depth, Kiln transports,
# fio engine for GlusterFS, and the fio data direction it reports under.
JOBS = [
    {
        "name": "seqread_128k_qd32",
        "label": "seqread 128k QD32",
        "rw": "read",
        "bs": "128k",
        "iodepth": 32,
        "kiln_transports": ["tcp", "unix"],
        "gluster_engine": "gfapi_async",
        "dir": "read",
    },
    {
        "name": "randread_4k_qd1",
        "label": "randread 4k QD1",
        "rw": "randread",
        "bs": "4k",
        "iodepth": 1,
        "kiln_transports": ["tcp"],
        "gluster_engine": "gfapi",
        "dir": "read",
    },
    {
        "name": "randread_4k_qd32",
        "label": "randread 4k QD32",
        "rw": "randread",
        "bs": "4k",
        "iodepth": 32,
        "kiln_transports": ["tcp"],
        "gluster_engine": "gfapi_async",
        "dir": "read",
    },
    {
        "name": "seqwrite_128k_qd32",
        "label": "seqwrite 128k QD32",
        "rw": "write",
        "bs": "128k",
        "iodepth": 32,
        "kiln_transports": ["tcp"],
        "gluster_engine": "gfapi_async",
        "dir": "write",
    },
]

METRICS = ["mb_s", "iops", "p50_us", "p99_us", "p999_us", "mean_us",
           "cpu_client_s", "cpu_server_s", "mb_per_cpu_s"]


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


# ----------------------------------------------------------------- processes

def privileged() -> list[str]:
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo"):
        return ["sudo"]
    raise BenchError("needs root (or sudo) for apt-get and mount")


def run_group(cmd: list[str], timeout: float, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run cmd in its own process group; kill the whole group on timeout or
    interrupt, and once cmd has exited, so that nothing it started (kilnd)
    outlives it. Output goes to files, not pipes: a leftover child holding
    a pipe open would otherwise keep us waiting for EOF."""
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL,
                                text=True, cwd=cwd, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        out_f.seek(0)
        err_f.seek(0)
        return proc.returncode, out_f.read(), err_f.read()


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def proc_cpu_s(pid: int) -> float | None:
    """utime+stime of a process (all its threads) from /proc/PID/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def last_json_line(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise BenchError("no JSON line in output")


def first_json_object(text: str) -> dict:
    """fio (and libgfapi) may print warnings before the JSON document."""
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
            return obj
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    raise BenchError("no JSON object in output")


def tail(text: str, lines: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


# --------------------------------------------------------------------- setup

def ensure_packages(binaries: dict[str, str]) -> None:
    """binaries: command -> Debian package providing it."""
    missing = sorted({pkg for cmd, pkg in binaries.items() if not shutil.which(cmd)})
    if not missing:
        return
    log(f"installing {' '.join(missing)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sudo = privileged()
    subprocess.run(sudo + ["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", *missing], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    still = [cmd for cmd in binaries if not shutil.which(cmd)]
    if still:
        raise BenchError(f"still missing after apt-get: {' '.join(still)}")


def emit(result: dict, out: str | None) -> int:
    """Prints a bench script's result as one JSON line on stdout (and to `out`); exit 0."""
    text = json.dumps(result)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


def repo_root() -> Path:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here,
                             capture_output=True, text=True, check=True).stdout.strip()
        return Path(out)
    except (OSError, subprocess.CalledProcessError):
        return here.parent


def release_kiln(no_build: bool) -> Path:
    """The release `kiln` binary of this checkout, built first unless `no_build`."""
    root = repo_root()
    if not no_build:
        log("cargo build --release -p kiln-cli")
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "kiln-cli"], cwd=root,
                       check=True)
    return root / "target" / "release" / "kiln"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    want = f"0100007F:{port:04X}"
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(ln.split()[1] == want and ln.split()[3] == "0A" for ln in lines)


class GlusterRef:
    """The GlusterFS reference through ../shared/bench/gluster.sh (shared by the bench scripts)."""

    def __init__(self, root: Path):
        self.gluster_sh = (root / ".." / "shared" / "bench" / "gluster.sh").resolve()
        self.gluster_work = Path(os.environ.get("GLUSTER_WORK", "/tmp/kiln-gluster"))

    def glusterd_alive(self) -> bool:
        try:
            pid = int((self.gluster_work / "glusterd.pid").read_text().strip())
        except (OSError, ValueError):
            return False
        return Path(f"/proc/{pid}").exists()

    def gluster(self, *args: str, timeout: float = 600) -> str:
        res = subprocess.run([str(self.gluster_sh), *args], capture_output=True, text=True,
                             timeout=timeout)
        if res.returncode != 0:
            raise BenchError(f"gluster.sh {' '.join(args)} failed ({res.returncode}): "
                             f"{tail(res.stderr or res.stdout)}")
        return res.stdout


class Bench(GlusterRef):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.root = repo_root()
        GlusterRef.__init__(self, self.root)
        self.kiln_bin = args.kiln_bin or self.root / "target" / "release" / "kiln"
        self.pingpong_bin = self.root / "target" / "release" / "kiln-pingpong"
        self.only = set(args.only)
        self.iperf_server: subprocess.Popen | None = None
        self.iperf_port = 0
        self.mounted_tmpfs = False
        self.started_gluster = False
        self.brick_pids: list[int] = []
        self.runs: list[dict] = []

    # ------------------------------------------------------------- set-up

    def setup(self) -> None:
        need = {}
        if "gluster" in self.only:
            need["fio"] = "fio"
            if not self.gluster_sh.is_file():
                raise BenchError(f"{self.gluster_sh} not found (the shared/ dir beside the repo)")
        if "net" in self.only:
            need["iperf3"] = "iperf3"
        ensure_packages(need)
        self.build()
        if "kiln" in self.only:
            self.mount_tmpfs()
        if "gluster" in self.only:
            self.gluster_up()
        if "net" in self.only:
            self.start_iperf_server()

    def build(self) -> None:
        if self.args.no_build:
            log("skipping cargo build (--no-build)")
        elif "kiln" in self.only:
            log("cargo build --release --workspace")
            subprocess.run(["cargo", "build", "--release", "--workspace"], cwd=self.root, check=True)
        elif "net" in self.only:
            log("cargo build --release -p kiln-pingpong")
            subprocess.run(["cargo", "build", "--release", "-p", "kiln-pingpong"], cwd=self.root,
                           check=True)
        for part, binary in (("kiln", self.kiln_bin), ("net", self.pingpong_bin)):
            if part in self.only and not binary.is_file():
                raise BenchError(f"{binary} is missing (build failed or --no-build)")

    def mount_tmpfs(self) -> None:
        KILN_TMPFS.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mountpoint", "-q", str(KILN_TMPFS)]).returncode != 0:
            subprocess.run(privileged() + ["mount", "-t", "tmpfs", "-o", f"size={KILN_TMPFS_SIZE}",
                                           "kiln-bench", str(KILN_TMPFS)], check=True)
            self.mounted_tmpfs = True
            log(f"mounted tmpfs ({KILN_TMPFS_SIZE}) on {KILN_TMPFS}")
        else:
            log(f"{KILN_TMPFS} is already a mount point; using it and leaving it mounted")
        (KILN_TMPFS / "brick").mkdir(exist_ok=True)

    def gluster_up(self) -> None:
        was_up = self.glusterd_alive()
        log("gluster.sh up" + (" (glusterd already running)" if was_up else ""))
        out = self.gluster("up")
        log(out.strip())
        self.started_gluster = not was_up
        pids = [ln.strip() for ln in self.gluster("pids", GLUSTER_VOLUME).splitlines()]
        # first line is glusterd, the rest are the volume's brick processes
        self.brick_pids = [int(p) for p in pids[1:] if p.isdigit()]
        if not self.brick_pids:
            raise BenchError(f"no brick PID for volume {GLUSTER_VOLUME}")
        log(f"brick PIDs of {GLUSTER_VOLUME}: {self.brick_pids}")
        self.gluster_layout()

    def gluster_layout(self) -> None:
        log(f"laying out {GLUSTER_FILE} ({self.args.size}) on GlusterFS with one write pass")
        res = self.fio_gluster(["--name=layout", "--rw=write", "--bs=1m", "--iodepth=8",
                                f"--size={self.args.size}"], "gfapi_async")
        if res["rc"] != 0:
            raise BenchError(f"GlusterFS layout failed: {res['err']}")
        brick_file = self.gluster_work / "bricks" / GLUSTER_VOLUME / GLUSTER_FILE
        if brick_file.exists():
            log(f"brick file {brick_file}: {brick_file.stat().st_size} bytes, "
                f"{brick_file.stat().st_blocks * 512} allocated")

    def start_iperf_server(self) -> None:
        self.iperf_port = free_port()
        self.iperf_server = subprocess.Popen(
            ["iperf3", "-s", "-B", "127.0.0.1", "-p", str(self.iperf_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(100):
            if listening(self.iperf_port):
                break
            if self.iperf_server.poll() is not None:
                raise BenchError("iperf3 -s exited at start")
            time.sleep(0.05)
        else:
            raise BenchError("iperf3 -s is not listening")
        log(f"iperf3 server on 127.0.0.1:{self.iperf_port} (pid {self.iperf_server.pid})")

    # ------------------------------------------------------------ clean-up

    def cleanup(self) -> None:
        if self.iperf_server is not None and self.iperf_server.poll() is None:
            self.iperf_server.terminate()
            try:
                self.iperf_server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.iperf_server.kill()
                self.iperf_server.wait()
            log("stopped iperf3 server")
        if self.mounted_tmpfs:
            sudo = privileged()
            if subprocess.run(sudo + ["umount", str(KILN_TMPFS)]).returncode != 0:
                log(f"umount {KILN_TMPFS} failed; detaching it lazily")
                subprocess.run(sudo + ["umount", "-l", str(KILN_TMPFS)])
            try:
                KILN_TMPFS.rmdir()
            except OSError:
                pass
            log(f"unmounted {KILN_TMPFS}")
        if self.started_gluster and not self.args.keep_gluster:
            log("gluster.sh down")
            try:
                self.gluster("down", timeout=300)
            except (BenchError, subprocess.TimeoutExpired) as e:
                log(f"gluster.sh down: {e}")
        elif self.started_gluster:
            log("leaving GlusterFS up (--keep-gluster); stop it with gluster.sh down")

    # ---------------------------------------------------------- measuring

    def run_kiln(self, job: dict, transport: str) -> dict:
        cmd = [str(self.kiln_bin), "bench", "--rw", job["rw"], "--bs", job["bs"],
               "--iodepth", str(job["iodepth"]), "--size", self.args.size,
               "--runtime", str(self.args.runtime), "--transport", transport,
               "--brick", str(KILN_TMPFS / "brick"), "--json",
               # The socket itself: short-circuit reads (which skip it) are bench/local.py's.
               "--short-circuit", "off"]
        before = children_cpu_s()
        rc, out, err = run_group(cmd, timeout=self.args.runtime * 3 + 180, cwd=self.root)
        proc_cpu = children_cpu_s() - before
        if rc != 0:
            raise BenchError(f"kiln bench exited {rc}: {tail(err or out)}")
        raw = last_json_line(out)
        lat = raw.get("lat_us", {})
        cpu = raw.get("cpu_s", {})
        return {
            "mb_s": raw.get("mb_s"),
            "iops": raw.get("iops"),
            "p50_us": lat.get("p50"),
            "p99_us": lat.get("p99"),
            "p999_us": lat.get("p999"),
            "mean_us": lat.get("mean"),
            "cpu_client_s": cpu.get("client"),
            "cpu_server_s": cpu.get("server"),
            "mb_per_cpu_s": raw.get("mb_per_cpu_s"),
            "proc_cpu_s": round(proc_cpu, 3),
            "raw": raw,
        }

    def fio_gluster(self, fio_args: list[str], engine: str) -> dict:
        cmd = [str(self.gluster_sh), "fio", GLUSTER_VOLUME, f"--filename={GLUSTER_FILE}",
               "--thread", "--output-format=json", *fio_args]
        if engine != "gfapi_async":
            cmd.append(f"--ioengine={engine}")   # gluster.sh puts gfapi_async first
        brick_before = [proc_cpu_s(p) for p in self.brick_pids]
        children_before = children_cpu_s()
        t0 = time.monotonic()
        rc, out, err = run_group(cmd, timeout=self.args.runtime * 3 + 300)
        wall = time.monotonic() - t0
        client_proc = children_cpu_s() - children_before
        brick_after = [proc_cpu_s(p) for p in self.brick_pids]
        brick = None
        if self.brick_pids and None not in brick_before and None not in brick_after:
            brick = sum(b - a for a, b in zip(brick_before, brick_after))
        return {"rc": rc, "out": out, "err": tail(err or out), "wall_s": wall,
                "client_proc_cpu_s": client_proc, "brick_cpu_s": brick}

    def run_gluster(self, job: dict) -> dict:
        args = ["--name=j", f"--rw={job['rw']}", f"--bs={job['bs']}",
                f"--iodepth={job['iodepth']}", f"--size={self.args.size}",
                f"--runtime={self.args.runtime}", "--time_based",
                "--lat_percentiles=1", "--percentile_list=50:99:99.9"]
        res = self.fio_gluster(args, job["gluster_engine"])
        if res["rc"] != 0:
            raise BenchError(f"fio exited {res['rc']}: {res['err']}")
        doc = first_json_object(res["out"])
        fjob = doc["jobs"][0]
        if fjob.get("error"):
            raise BenchError(f"fio job error {fjob['error']}: {res['err']}")
        sec = fjob[job["dir"]]
        runtime_s = (sec.get("runtime") or fjob.get("job_runtime") or 0) / 1000.0
        lat = sec.get("lat_ns", {})
        pct = lat.get("percentile") or sec.get("clat_ns", {}).get("percentile") or {}

        def pct_us(key: str) -> float | None:
            v = pct.get(key)
            return None if v is None else v / 1000.0

        job_runtime_s = (fjob.get("job_runtime") or sec.get("runtime") or 0) / 1000.0
        cpu_fio = (fjob["usr_cpu"] + fjob["sys_cpu"]) / 100.0 * job_runtime_s
        client = cpu_fio if self.args.gluster_client_cpu == "fio" else res["client_proc_cpu_s"]
        server = res["brick_cpu_s"]
        mb = sec["io_bytes"] / 1e6
        total_cpu = client + (server or 0.0)
        return {
            "mb_s": sec["bw_bytes"] / 1e6,
            "iops": sec["iops"],
            "p50_us": pct_us("50.000000"),
            "p99_us": pct_us("99.000000"),
            "p999_us": pct_us("99.900000"),
            "mean_us": lat.get("mean", 0.0) / 1000.0,
            "cpu_client_s": round(client, 3),
            "cpu_server_s": None if server is None else round(server, 3),
            "mb_per_cpu_s": mb / total_cpu if total_cpu > 0 else None,
            "client_fio_cpu_s": round(cpu_fio, 3),
            "client_proc_cpu_s": round(res["client_proc_cpu_s"], 3),
            "runtime_s": runtime_s,
            "ioengine": job["gluster_engine"],
            "fio_version": doc.get("fio version"),
        }

    def run_iperf3(self) -> dict:
        cmd = ["iperf3", "-c", "127.0.0.1", "-p", str(self.iperf_port),
               "-t", str(self.args.iperf_time), "-J"]
        rc, out, err = run_group(cmd, timeout=self.args.iperf_time + 60)
        doc = first_json_object(out) if out.strip() else {}
        if rc != 0 or "error" in doc:
            raise BenchError(f"iperf3 exited {rc}: {doc.get('error') or tail(err or out)}")
        end = doc["end"]
        cpu = end.get("cpu_utilization_percent", {})
        return {
            "mb_s": end["sum_received"]["bits_per_second"] / 8 / 1e6,
            "sender_mb_s": end["sum_sent"]["bits_per_second"] / 8 / 1e6,
            "retransmits": end["sum_sent"].get("retransmits"),
            "cpu_sender_pct": cpu.get("host_total"),
            "cpu_receiver_pct": cpu.get("remote_total"),
        }

    def run_pingpong(self, unix: bool, cpus: tuple[int, int] | None) -> dict:
        cmd = [str(self.pingpong_bin), "--iterations", str(self.args.pingpong_iterations)]
        if unix:
            cmd.append("--unix")
        if cpus is not None:
            cmd += ["--cpus", f"{cpus[0]},{cpus[1]}"]
        rc, out, err = run_group(cmd, timeout=300)
        if rc != 0:
            raise BenchError(f"kiln-pingpong exited {rc}: {tail(err or out)}")
        raw = last_json_line(out)
        return {k: raw[k] for k in ("p50_us", "p99_us", "p999_us", "mean_us")}

    def record(self, rep: int, job: str, system: str, fn, *fn_args) -> None:
        log(f"rep {rep + 1}/{self.args.reps}: {job} on {system}")
        entry = {"rep": rep + 1, "job": job, "system": system}
        try:
            entry["ok"] = True
            entry.update(fn(*fn_args))
            summary = ", ".join(f"{k}={v:.1f}" for k, v in entry.items()
                                if k in ("mb_s", "iops", "p50_us") and isinstance(v, (int, float)))
            log(f"  {summary}")
        except (BenchError, KeyError, ValueError, TypeError, subprocess.TimeoutExpired) as e:
            entry["ok"] = False
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"  FAILED: {entry['error']}")
        self.runs.append(entry)

    def measure(self) -> None:
        for rep in range(self.args.reps):
            if "net" in self.only:
                self.record(rep, "net", "iperf3", self.run_iperf3)
                self.record(rep, "net", "pingpong_tcp", self.run_pingpong, False, None)
                self.record(rep, "net", "pingpong_tcp_same", self.run_pingpong, False, (0, 0))
                if (os.cpu_count() or 1) >= 2:
                    self.record(rep, "net", "pingpong_tcp_split", self.run_pingpong, False,
                                (0, 1))
                self.record(rep, "net", "pingpong_unix", self.run_pingpong, True, None)
            for job in JOBS:
                sides = []
                if "kiln" in self.only:
                    sides += [(f"kiln_{t}", self.run_kiln, (job, t)) for t in job["kiln_transports"]]
                if "gluster" in self.only:
                    sides.append(("gluster", self.run_gluster, (job,)))
                if rep % 2 == 1:
                    sides.reverse()   # alternate who goes first
                for system, fn, fn_args in sides:
                    self.record(rep, job["name"], system, fn, *fn_args)


# ------------------------------------------------------------------- summary

def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("ok") and isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict]) -> dict:
    med: dict[str, dict[str, dict]] = {}
    for job, system in sorted({(r["job"], r["system"]) for r in runs}):
        group = [r for r in runs if r["job"] == job and r["system"] == system]
        keys = [k for k in METRICS + ["sender_mb_s", "retransmits", "cpu_sender_pct",
                                      "cpu_receiver_pct", "client_fio_cpu_s",
                                      "client_proc_cpu_s", "proc_cpu_s"]
                if any(k in r for r in group)]
        entry = {k: median_of(group, k) for k in keys}
        entry["n_ok"] = sum(1 for r in group if r.get("ok"))
        entry["n"] = len(group)
        med.setdefault(job, {})[system] = entry
    return med


def get(med: dict, job: str, system: str, key: str) -> float | None:
    return med.get(job, {}).get(system, {}).get(key)


def ratios(med: dict, floor: str) -> list[dict]:
    def div(a, b):
        return None if a is None or b in (None, 0) else a / b

    def sub(a, b):
        return None if a is None or b is None else a - b

    sr, rr1, rr32, sw = (j["name"] for j in JOBS)
    pingpong = {"unpinned": "pingpong_tcp", "same": "pingpong_tcp_same",
                "split": "pingpong_tcp_split"}[floor]
    rows = [
        ("seqread_tcp_vs_iperf3", "Kiln seqread tcp MB/s / iperf3 MB/s",
         div(get(med, sr, "kiln_tcp", "mb_s"), get(med, "net", "iperf3", "mb_s")), ">=", 0.8),
        ("seqread_vs_gluster", "Kiln seqread MB/s / GlusterFS",
         div(get(med, sr, "kiln_tcp", "mb_s"), get(med, sr, "gluster", "mb_s")), ">=", 1.6),
        ("seqread_mb_per_cpu_vs_gluster", "Kiln seqread MB/CPU-s / GlusterFS",
         div(get(med, sr, "kiln_tcp", "mb_per_cpu_s"), get(med, sr, "gluster", "mb_per_cpu_s")),
         ">=", 2.0),
        ("seqread_unix_vs_tcp", "Kiln seqread MB/s unix / tcp",
         div(get(med, sr, "kiln_unix", "mb_s"), get(med, sr, "kiln_tcp", "mb_s")), ">", 1.0),
        ("randread4k_qd1_p50_minus_pingpong", f"Kiln 4k QD1 p50 - {floor} ping-pong p50 (us)",
         sub(get(med, rr1, "kiln_tcp", "p50_us"), get(med, "net", pingpong, "p50_us")),
         "<=", 10.0),
        ("randread4k_qd32_iops_vs_gluster", "Kiln 4k QD32 IOPS / GlusterFS",
         div(get(med, rr32, "kiln_tcp", "iops"), get(med, rr32, "gluster", "iops")), ">=", 4.0),
        ("seqwrite_vs_gluster", "Kiln seqwrite MB/s / GlusterFS",
         div(get(med, sw, "kiln_tcp", "mb_s"), get(med, sw, "gluster", "mb_s")), ">=", 1.6),
    ]
    out = []
    for name, desc, value, op, target in rows:
        if value is None:
            status = "n/a"
        elif op is None:
            status = "info"
        elif ((op == ">=" and value >= target) or (op == "<=" and value <= target)
              or (op == ">" and value > target)):
            status = "PASS"
        else:
            status = "FAIL"
        out.append({"name": name, "what": desc, "value": value, "op": op, "target": target,
                    "status": status})
    return out


def per_run(runs: list[dict], floor: str) -> list[dict]:
    """The issue-22 checks that hold for every repetition, not only for the medians: each
    run's ratio to the same repetition's baseline, and the spread of the runs."""
    sr, rr1 = JOBS[0]["name"], JOBS[1]["name"]
    pingpong = {"unpinned": "pingpong_tcp", "same": "pingpong_tcp_same",
                "split": "pingpong_tcp_split"}[floor]

    def by_rep(job: str, system: str, key: str) -> dict[int, float]:
        return {r["rep"]: r[key] for r in runs if r.get("ok") and r["job"] == job
                and r["system"] == system and isinstance(r.get(key), (int, float))}

    iperf = by_rep("net", "iperf3", "mb_s")
    tcp, unix = by_rep(sr, "kiln_tcp", "mb_s"), by_rep(sr, "kiln_unix", "mb_s")
    qd1, pp = by_rep(rr1, "kiln_tcp", "p50_us"), by_rep("net", pingpong, "p50_us")

    def worst(a: dict, b: dict, f, pick) -> float | None:
        vals = [f(a[k], b[k]) for k in a if k in b and b[k] not in (0, None)]
        return pick(vals) if vals else None

    spread = None
    if tcp:
        m = statistics.median(tcp.values())
        spread = max(abs(v - m) / m for v in tcp.values())
    rows = [
        ("seqread_tcp_vs_iperf3_every_run", "Kiln seqread tcp / iperf3, worst run",
         worst(tcp, iperf, lambda a, b: a / b, min), ">=", 0.8),
        ("seqread_tcp_spread", "Kiln seqread tcp, largest distance from the median",
         spread, "<=", 0.15),
        ("seqread_unix_vs_iperf3_every_run", "Kiln seqread unix / iperf3, worst run",
         worst(unix, iperf, lambda a, b: a / b, min), ">=", 1.0),
        ("randread4k_qd1_minus_pingpong_every_run",
         f"Kiln 4k QD1 p50 - {floor} ping-pong p50 (us), worst run",
         worst(qd1, pp, lambda a, b: a - b, max), "<=", 10.0),
    ]
    return [{"name": n, "what": d, "value": v, "op": op, "target": t,
             "status": "n/a" if v is None else
             ("PASS" if (v >= t if op == ">=" else v <= t) else "FAIL")}
            for n, d, v, op, t in rows]


def fmt(v, width: int, prec: int = 1) -> str:
    if v is None:
        return "-".rjust(width)
    return f"{v:{width}.{prec}f}"


def print_table(med: dict, rats: list[dict], args: argparse.Namespace) -> None:
    w = sys.stderr.write
    w(f"\nmedians of {args.reps} interleaved rep(s), runtime {args.runtime}s, size {args.size}"
      f" (MB = 10^6 B, latency in us, CPU in s)\n\n")
    head = (f"{'job':<20} {'system':<14} {'MB/s':>9} {'IOPS':>10} {'p50':>8} {'p99':>8} "
            f"{'p99.9':>8} {'mean':>8} {'cpu cli':>8} {'cpu srv':>8} {'MB/cpu-s':>9} {'ok':>5}\n")
    w(head)
    w("-" * (len(head) - 1) + "\n")
    labels = {j["name"]: j["label"] for j in JOBS}
    for job in [j["name"] for j in JOBS]:
        for system, m in sorted(med.get(job, {}).items()):
            w(f"{labels[job]:<20} {system:<14} {fmt(m.get('mb_s'), 9)} {fmt(m.get('iops'), 10, 0)} "
              f"{fmt(m.get('p50_us'), 8)} {fmt(m.get('p99_us'), 8)} {fmt(m.get('p999_us'), 8)} "
              f"{fmt(m.get('mean_us'), 8)} {fmt(m.get('cpu_client_s'), 8, 2)} "
              f"{fmt(m.get('cpu_server_s'), 8, 2)} {fmt(m.get('mb_per_cpu_s'), 9)} "
              f"{m['n_ok']:>2}/{m['n']:<2}\n")
    net = med.get("net", {})
    if net:
        w("\n")
        if "iperf3" in net:
            m = net["iperf3"]
            w(f"iperf3 1 stream      {fmt(m.get('mb_s'), 9)} MB/s   "
              f"(sender cpu {fmt(m.get('cpu_sender_pct'), 5)}%, receiver cpu "
              f"{fmt(m.get('cpu_receiver_pct'), 5)}%)  {m['n_ok']}/{m['n']} ok\n")
        for name in ("pingpong_tcp", "pingpong_tcp_same", "pingpong_tcp_split",
                     "pingpong_unix"):
            if name in net:
                m = net[name]
                w(f"{name:<20} p50 {fmt(m.get('p50_us'), 7)}  p99 {fmt(m.get('p99_us'), 7)}  "
                  f"p99.9 {fmt(m.get('p999_us'), 7)}  mean {fmt(m.get('mean_us'), 7)} us  "
                  f"{m['n_ok']}/{m['n']} ok\n")
    w("\n")
    for r in rats:
        target = "" if r["op"] is None else f"{r['op']} {r['target']:g}"
        w(f"{r['what']:<48} {fmt(r['value'], 8, 2)}  {target:<8} {r['status']}\n")
    w("\n")


# ---------------------------------------------------------------------- main

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/compare.sh", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="repetitions, interleaved (default 3)")
    p.add_argument("--runtime", type=int, default=10, help="seconds per job run (default 10)")
    p.add_argument("--size", default="1g", help="file size for every job (default 1g)")
    p.add_argument("--only", action="append", default=None,
                   help="run only these parts: kiln, gluster, net; comma-separated or repeated "
                        "(default all)")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    p.add_argument("--keep-gluster", action="store_true",
                   help="leave GlusterFS running at the end even if this script started it")
    p.add_argument("--no-build", action="store_true", help="skip cargo build")
    p.add_argument("--kiln-bin", type=Path,
                   help="the kiln binary to run (default target/release/kiln)")
    p.add_argument("--iperf-time", type=int, default=5, help="iperf3 -t seconds (default 5)")
    p.add_argument("--pingpong-iterations", type=int, default=20000,
                   help="kiln-pingpong --iterations (default 20000)")
    p.add_argument("--gluster-client-cpu", choices=["fio", "process"], default="process",
                   help="GlusterFS client CPU: 'process' = the whole fio process incl. gfapi's "
                        "own threads (and ~0.1 s of start-up), 'fio' = the fio job's "
                        "usr_cpu+sys_cpu, which is the job thread only (default process)")
    p.add_argument("--pingpong-floor", choices=["unpinned", "same", "split"], default="unpinned",
                   help="which TCP ping-pong p50 the 4k QD1 read is compared with: unpinned "
                        "(the scheduler places the two threads), same (one CPU), split (two "
                        "CPUs) (default unpinned)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any target FAILs")
    args = p.parse_args(argv)
    parts = set()
    for item in args.only or ["kiln,gluster,net"]:
        for part in item.split(","):
            part = part.strip()
            if part not in ("kiln", "gluster", "net"):
                p.error(f"--only: unknown part {part!r} (kiln, gluster, net)")
            parts.add(part)
    args.only = sorted(parts)
    if args.reps < 1 or args.runtime < 1:
        p.error("--reps and --runtime must be at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    bench = Bench(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        bench.setup()
        bench.measure()
    except BenchError as e:
        log(f"error: {e}")
        return 2
    except subprocess.CalledProcessError as e:
        log(f"error: {e}")
        return 2
    finally:
        bench.cleanup()

    med = summarize(bench.runs)
    rats = ratios(med, args.pingpong_floor) + per_run(bench.runs, args.pingpong_floor)
    print_table(med, rats, args)
    result = {
        "started": started,
        "config": {"reps": args.reps, "runtime_s": args.runtime, "size": args.size,
                   "only": args.only, "iperf_time_s": args.iperf_time,
                   "pingpong_iterations": args.pingpong_iterations,
                   "gluster_client_cpu": args.gluster_client_cpu,
                   "pingpong_floor": args.pingpong_floor,
                   "jobs": [{k: j[k] for k in ("name", "rw", "bs", "iodepth", "kiln_transports",
                                               "gluster_engine")} for j in JOBS]},
        "medians": med,
        "ratios": rats,
        "runs": [{k: v for k, v in r.items()} for r in bench.runs],
    }
    text = json.dumps(result, sort_keys=False)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out}")
    failed_runs = [r for r in bench.runs if not r.get("ok")]
    if failed_runs:
        log(f"{len(failed_runs)} run(s) failed")
        return 1
    if args.strict and any(r["status"] == "FAIL" for r in rats):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
