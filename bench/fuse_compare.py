#!/usr/bin/env python3
"""Kiln's FUSE mount vs GlusterFS's FUSE mount, and vs Kiln's native API, in one run.

For every repetition (--reps, default 3) this runs two jobs, each on three
systems, back to back (the order of the systems reverses every repetition):

  seqread_128k_qd32  fio --ioengine=libaio --direct=1 --rw=read --bs=128k
                     --iodepth=32 --size=1g --runtime=T --time_based
                     on bench.img through
                       kiln_fuse     kiln mount --mode vm-image
                       gluster_fuse  the GlusterFS FUSE mount of volume dist
                     and, natively,
                       kiln_native   kiln bench --connect ... --rw read --bs 128k
                                     --iodepth 32 --size 1g --file bench.img
  read_1m_qd1        one 1 MiB O_DIRECT preadv of 256 x 4 KiB iovecs at a time
                     (bench/preadv256.c, built with cc into a temp dir):
                     --preadv-calls timed calls (default 2000, after 20 warm-up
                     calls) at pseudo-random 1 MiB-aligned offsets, through
                       kiln_fuse, gluster_fuse
                     and, natively, the same 1 MiB reads one at a time for T s:
                       kiln_native   kiln bench ... --rw read --bs 1m --iodepth 1

It reports, per job and system, the median over the repetitions of MB/s,
IOPS, latency (p50/p99/mean, us), CPU seconds and MB per CPU-second, and these
ratios of medians:

  fuse_seqread_vs_gluster     Kiln FUSE seqread MB/s / GlusterFS FUSE       >= 2
                              (>= 2.5 with --kiln-transport tcp)
  fuse_seqread_cpu_vs_gluster Kiln FUSE seqread MB/CPU-s / GlusterFS FUSE   (info)
  preadv256_p50_vs_gluster    GlusterFS preadv256 p50 / Kiln FUSE p50       >= 2
  preadv256_mean_vs_gluster   GlusterFS preadv256 mean / Kiln FUSE mean     (info)
  preadv256_cpu_vs_gluster    Kiln FUSE preadv256 MB/CPU-s / GlusterFS      (info)
  fuse_tax_seqread            Kiln FUSE seqread MB/s / Kiln native MB/s     (info)
  fuse_tax_seqread_cpu        Kiln FUSE seqread MB/CPU-s / native MB/CPU-s  (info)
  fuse_tax_1m_qd1_us          Kiln FUSE preadv256 p50 - native 1m QD1 p50   (info)
  fuse_tax_1m_qd1             Kiln FUSE preadv256 p50 / native 1m QD1 p50   (info)

(For reference, GlusterFS FUSE took 674 us per preadv256 call on this kind of
machine when this script was written.)

CPU seconds are utime+stime deltas from /proc/PID/stat over each run, of:
  kiln_fuse     the kiln mount process (daemon) + the kiln server (server)
  gluster_fuse  the glusterfs FUSE client process (daemon) + the brick
                process(es) of volume dist (server); glusterd is not counted
  kiln_native   kiln bench's own client CPU (daemon column) + the kiln server,
                both as reported by kiln bench itself
MB/CPU-s is MB moved / (daemon + server) CPU seconds; the application's own
CPU (fio, preadv256; in kernel mode it includes the FUSE request path) is kept
in the JSON as app_cpu_s. MB = 10^6 bytes.

Set-up: apt-get installs fio, gcc and fuse3 when missing; cargo build
--release -p kiln-cli (skip with --no-build); a tmpfs (size + 2 GiB) on
/tmp/kiln-fuse-bench/tmpfs holds Kiln's brick; kiln server listens on
tcp:127.0.0.1 (a free port) and a Unix socket; kiln mount unix:SOCK:/vol (or, with
--kiln-transport tcp, 127.0.0.1:PORT:/vol) on
/tmp/kiln-fuse-bench/kiln --mode vm-image; ../shared/bench/gluster.sh up, then
gluster.sh mount dist /tmp/kiln-fuse-bench/gluster. bench.img is laid out on
both mounts by one sequential pass of dd if=/dev/urandom oflag=direct bs=1M.

Clean-up (also on Ctrl-C and SIGTERM): SIGTERM to kiln mount (it unmounts),
stop the kiln server, unmount the tmpfs and the GlusterFS mount, and run
gluster.sh down only if this script brought GlusterFS up and --keep-gluster
was not given. Needs root (or sudo) for apt-get and mount.

A human table goes to stderr, one JSON object to stdout (and to --out FILE):
config, medians (job -> system -> metric), ratios, runs. Exit status 1 if any
run failed (with --strict also if a target FAILs), 2 if set-up failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.dont_write_bytecode = True   # no bench/__pycache__ from importing compare.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (  # noqa: E402  (bench/compare.py: shared helpers)
    BenchError,
    GlusterRef,
    ensure_packages,
    first_json_object,
    fmt,
    last_json_line,
    privileged,
    proc_cpu_s,
    repo_root,
    run_group,
    tail,
)

WORK = Path("/tmp/kiln-fuse-bench")
TMPFS = WORK / "tmpfs"
KILN_MNT = WORK / "kiln"
GLUSTER_MNT = WORK / "gluster"
GLUSTER_VOLUME = "dist"
FILE = "bench.img"
GLUSTER_PREADV_REFERENCE_US = 674.0

SEQREAD = "seqread_128k_qd32"
READ1M = "read_1m_qd1"
JOBS = {SEQREAD: "seqread 128k QD32", READ1M: "1 MiB QD1 (preadv256)"}
SYSTEMS = ["kiln_fuse", "gluster_fuse", "kiln_native"]
METRICS = ["mb_s", "iops", "p50_us", "p99_us", "mean_us", "cpu_daemon_s", "cpu_server_s",
           "cpu_s", "mb_per_cpu_s", "app_cpu_s"]


def log(msg: str) -> None:
    print(f"[fuse_compare] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kmgt]?)i?b?", text.strip().lower())
    if not m:
        raise ValueError(f"bad size {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2)]


def is_mountpoint(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        v = proc_cpu_s(pid)
        if v is None:
            raise BenchError(f"process {pid} is gone")
        total += v
    return total


def wait_for_line(proc: subprocess.Popen, log_path: Path, pattern: str, what: str,
                  timeout: float = 30) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        m = re.search(pattern, text)
        if m:
            return m
        if proc.poll() is not None:
            raise BenchError(f"{what} exited {proc.returncode}: {tail(text)}")
        time.sleep(0.05)
    raise BenchError(f"{what} not ready after {timeout:.0f} s: {tail(log_path.read_text())}")


def stop_process(proc: subprocess.Popen | None, what: str, grace: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log(f"{what} (pid {proc.pid}) ignored SIGTERM for {grace:.0f} s; killing it")
        proc.kill()
        proc.wait()


def unmount(path: Path, what: str) -> None:
    if not is_mountpoint(path):
        return
    sudo = privileged()
    if subprocess.run(sudo + ["umount", str(path)], stderr=subprocess.DEVNULL).returncode != 0:
        log(f"umount {path} failed; detaching it lazily")
        subprocess.run(sudo + ["umount", "-l", str(path)])
    log(f"unmounted {what} ({path})")


class FuseBench(GlusterRef):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.root = repo_root()
        GlusterRef.__init__(self, self.root)
        self.kiln_bin = args.kiln_bin or self.root / "target" / "release" / "kiln"
        self.size = parse_size(args.size)
        self.tmp = Path(tempfile.mkdtemp(prefix="kiln-fuse-compare-"))
        self.preadv_bin = self.tmp / "preadv256"
        self.mounted_tmpfs = False
        self.server: subprocess.Popen | None = None
        self.mount: subprocess.Popen | None = None
        self.port = 0
        self.started_gluster = False
        self.mounted_gluster = False
        self.brick_pids: list[int] = []
        self.gluster_fuse_pid = 0
        self.runs: list[dict] = []
        self.layout: dict[str, dict] = {}

    # ------------------------------------------------------------- set-up

    def setup(self) -> None:
        if not self.gluster_sh.is_file():
            raise BenchError(f"{self.gluster_sh} not found (the shared/ dir beside the repo)")
        ensure_packages({"fio": "fio", "cc": "gcc", "fusermount3": "fuse3"})
        self.build()
        WORK.mkdir(parents=True, exist_ok=True)
        self.kiln_up()
        self.gluster_mount()
        for system, mnt in (("kiln_fuse", KILN_MNT), ("gluster_fuse", GLUSTER_MNT)):
            self.lay_out(system, mnt / FILE)

    def build(self) -> None:
        if self.args.no_build:
            log("skipping cargo build (--no-build)")
        else:
            log("cargo build --release -p kiln-cli")
            subprocess.run(["cargo", "build", "--release", "-p", "kiln-cli"], cwd=self.root,
                           check=True, stdout=sys.stderr)
        if not Path(self.kiln_bin).is_file():
            raise BenchError(f"{self.kiln_bin} is missing (build failed or --no-build)")
        src = Path(__file__).resolve().parent / "preadv256.c"
        res = subprocess.run(["cc", "-O2", "-Wall", "-o", str(self.preadv_bin), str(src)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise BenchError(f"cc {src} failed: {tail(res.stderr)}")
        log(f"built {self.preadv_bin}")

    def kiln_up(self) -> None:
        TMPFS.mkdir(parents=True, exist_ok=True)
        if is_mountpoint(TMPFS):
            log(f"{TMPFS} is already a mount point; using it and leaving it mounted")
        else:
            tmpfs_size = (self.size >> 20) + 2048
            subprocess.run(privileged() + ["mount", "-t", "tmpfs", "-o", f"size={tmpfs_size}m",
                                           "kiln-fuse-bench", str(TMPFS)], check=True)
            self.mounted_tmpfs = True
            log(f"mounted a {tmpfs_size} MiB tmpfs on {TMPFS}")
        brick = TMPFS / "brick"
        brick.mkdir(exist_ok=True)

        server_log = self.tmp / "kiln-server.log"
        with open(server_log, "w") as f:
            self.server = subprocess.Popen(
                [str(self.kiln_bin), "server", "--brick", str(brick),
                 "--listen", "tcp:127.0.0.1:0", "--listen", f"unix:{self.tmp / 'kilnd.sock'}"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        m = wait_for_line(self.server, server_log, r"kilnd: listening on tcp:127\.0\.0\.1:(\d+)",
                          "kiln server")
        self.port = int(m.group(1))
        log(f"kiln server (pid {self.server.pid}) on tcp:127.0.0.1:{self.port}, brick {brick}")

        KILN_MNT.mkdir(parents=True, exist_ok=True)
        if is_mountpoint(KILN_MNT):
            raise BenchError(f"{KILN_MNT} is already a mount point (left over?); unmount it")
        mount_log = self.tmp / "kiln-mount.log"
        # A brick on the same host is mounted through its Unix socket by default (--kiln-transport).
        self.kiln_addr = (f"unix:{self.tmp / 'kilnd.sock'}" if self.args.kiln_transport == "unix"
                          else f"tcp:127.0.0.1:{self.port}")
        source = f"{self.kiln_addr}:/vol"
        with open(mount_log, "w") as f:
            self.mount = subprocess.Popen(
                [str(self.kiln_bin), "mount", source, str(KILN_MNT), "--mode", "vm-image"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        wait_for_line(self.mount, mount_log, r"kiln: mounted", "kiln mount")
        if not is_mountpoint(KILN_MNT):
            raise BenchError(f"kiln mount said it mounted, but {KILN_MNT} is not a mount point")
        log(f"kiln mount (pid {self.mount.pid}) {source} on {KILN_MNT} (vm-image)")

    def gluster_mount(self) -> None:
        was_up = self.glusterd_alive()
        log("gluster.sh up" + (" (glusterd already running)" if was_up else ""))
        self.started_gluster = not was_up
        out = self.gluster("up")
        log(out.strip())
        pids = [ln.strip() for ln in self.gluster("pids", GLUSTER_VOLUME).splitlines()]
        # first line is glusterd, the rest are the volume's brick processes
        self.brick_pids = [int(p) for p in pids[1:] if p.isdigit()]
        if not self.brick_pids:
            raise BenchError(f"no brick PID for volume {GLUSTER_VOLUME}")
        GLUSTER_MNT.mkdir(parents=True, exist_ok=True)
        if is_mountpoint(GLUSTER_MNT):
            log(f"{GLUSTER_MNT} is already a mount point; using it and leaving it mounted")
        else:
            self.gluster("mount", GLUSTER_VOLUME, str(GLUSTER_MNT), timeout=120)
            self.mounted_gluster = True
        self.gluster_fuse_pid = self.find_gluster_fuse_pid()
        log(f"GlusterFS {GLUSTER_VOLUME} on {GLUSTER_MNT}: FUSE client pid "
            f"{self.gluster_fuse_pid}, brick pid(s) {self.brick_pids}")

    @staticmethod
    def find_gluster_fuse_pid() -> int:
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (argv and os.path.basename(argv[0]) == b"glusterfs"
                    and str(GLUSTER_MNT).encode() in argv):
                found.append(int(d.name))
        if len(found) != 1:
            raise BenchError(f"expected one glusterfs process serving {GLUSTER_MNT}, "
                             f"found {found}")
        return found[0]

    def lay_out(self, system: str, path: Path) -> None:
        count = self.size >> 20
        log(f"laying out {path} ({count} MiB) with dd if=/dev/urandom bs=1M oflag=direct")
        t0 = time.monotonic()
        res = subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={count}",
                              "oflag=direct", "conv=fsync", "status=none"],
                             capture_output=True, text=True)
        wall = time.monotonic() - t0
        if res.returncode != 0:
            raise BenchError(f"layout of {path} failed: {tail(res.stderr)}")
        got = path.stat().st_size
        if got != count << 20:
            raise BenchError(f"{path} is {got} bytes after layout, not {count << 20}")
        self.layout[system] = {"bytes": got, "wall_s": round(wall, 3),
                               "mb_s": round(got / 1e6 / wall, 1)}
        log(f"  {got / 1e6 / wall:.0f} MB/s (urandom included)")

    # ------------------------------------------------------------ clean-up

    def cleanup(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.mount is not None:
            stop_process(self.mount, "kiln mount")
            unmount(KILN_MNT, "the Kiln FUSE mount")
            log("stopped kiln mount")
        if self.server is not None:
            stop_process(self.server, "kiln server", grace=5)
            log("stopped kiln server")
        if self.mounted_tmpfs:
            unmount(TMPFS, "the tmpfs")
        if self.mounted_gluster:
            unmount(GLUSTER_MNT, "the GlusterFS FUSE mount")
        if self.started_gluster and not self.args.keep_gluster:
            log("gluster.sh down")
            try:
                self.gluster("down", timeout=300)
            except (BenchError, subprocess.TimeoutExpired) as e:
                log(f"gluster.sh down: {e}")
        elif self.started_gluster:
            log("leaving GlusterFS up (--keep-gluster); stop it with gluster.sh down")
        for d in (KILN_MNT, GLUSTER_MNT, TMPFS, WORK):
            try:
                if not is_mountpoint(d):
                    d.rmdir()
            except OSError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---------------------------------------------------------- measuring

    def pids(self, system: str) -> tuple[list[int], list[int]]:
        if system == "kiln_fuse":
            return [self.mount.pid], [self.server.pid]
        return [self.gluster_fuse_pid], list(self.brick_pids)

    def measured(self, system: str, cmd: list[str], timeout: float) -> tuple[str, dict]:
        daemon, server = self.pids(system)
        d0, s0 = cpu_of(daemon), cpu_of(server)
        rc, out, err = run_group(cmd, timeout=timeout)
        d1, s1 = cpu_of(daemon), cpu_of(server)
        if rc != 0:
            raise BenchError(f"{os.path.basename(cmd[0])} exited {rc}: {tail(err or out)}")
        return out, {"cpu_daemon_s": round(d1 - d0, 3), "cpu_server_s": round(s1 - s0, 3)}

    @staticmethod
    def with_efficiency(rec: dict, mb: float) -> dict:
        cpu = rec["cpu_daemon_s"] + rec["cpu_server_s"]
        rec["cpu_s"] = round(cpu, 3)
        rec["mb_per_cpu_s"] = mb / cpu if cpu > 0 else None
        return rec

    def run_fio(self, system: str) -> dict:
        mnt = KILN_MNT if system == "kiln_fuse" else GLUSTER_MNT
        cmd = ["fio", "--name=seqread", f"--filename={mnt / FILE}", "--ioengine=libaio",
               "--direct=1", "--rw=read", "--bs=128k", "--iodepth=32", f"--size={self.size}",
               f"--runtime={self.args.runtime}", "--time_based", "--lat_percentiles=1",
               "--percentile_list=50:99:99.9", "--output-format=json"]
        out, rec = self.measured(system, cmd, timeout=self.args.runtime * 3 + 120)
        job = first_json_object(out)["jobs"][0]
        if job.get("error"):
            raise BenchError(f"fio job error {job['error']}")
        rd = job["read"]
        lat = rd.get("lat_ns", {})
        pct = lat.get("percentile") or rd.get("clat_ns", {}).get("percentile") or {}
        runtime_s = (job.get("job_runtime") or rd.get("runtime") or 0) / 1000.0
        rec.update({
            "mb_s": rd["bw_bytes"] / 1e6,
            "iops": rd["iops"],
            "p50_us": pct.get("50.000000", 0) / 1e3,
            "p99_us": pct.get("99.000000", 0) / 1e3,
            "p999_us": pct.get("99.900000", 0) / 1e3,
            "mean_us": lat.get("mean", 0.0) / 1e3,
            "app_cpu_s": round((job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s, 3),
            "bytes": rd["io_bytes"],
            "runtime_s": runtime_s,
        })
        return self.with_efficiency(rec, rd["io_bytes"] / 1e6)

    def run_preadv(self, system: str) -> dict:
        mnt = KILN_MNT if system == "kiln_fuse" else GLUSTER_MNT
        cmd = [str(self.preadv_bin), str(mnt / FILE), str(self.args.preadv_calls), "20"]
        out, rec = self.measured(system, cmd, timeout=600)
        raw = last_json_line(out)
        timed_bytes = raw["calls"] << 20
        rec.update({
            "mb_s": timed_bytes / 1e6 / raw["wall_s"],
            "iops": raw["calls"] / raw["wall_s"],
            "p50_us": raw["p50_us"],
            "p99_us": raw["p99_us"],
            "mean_us": raw["mean_us"],
            "app_cpu_s": raw["cpu_s"],
            "raw": raw,
        })
        # the CPU deltas cover the warm-up calls too, so count their bytes as well
        return self.with_efficiency(rec, raw["bytes"] / 1e6)

    def run_native(self, bs: str, iodepth: int) -> dict:
        cmd = [str(self.kiln_bin), "bench", "--connect", self.kiln_addr,
               "--server-pid", str(self.server.pid), "--rw", "read", "--bs", bs,
               "--iodepth", str(iodepth), "--size", str(self.size), "--file", FILE,
               "--runtime", str(self.args.runtime), "--json"]
        rc, out, err = run_group(cmd, timeout=self.args.runtime * 3 + 120)
        if rc != 0:
            raise BenchError(f"kiln bench exited {rc}: {tail(err or out)}")
        raw = last_json_line(out)
        lat, cpu = raw.get("lat_us", {}), raw.get("cpu_s", {})
        rec = {
            "mb_s": raw.get("mb_s"),
            "iops": raw.get("iops"),
            "p50_us": lat.get("p50"),
            "p99_us": lat.get("p99"),
            "p999_us": lat.get("p999"),
            "mean_us": lat.get("mean"),
            "cpu_daemon_s": cpu.get("client"),
            "cpu_server_s": cpu.get("server") or 0.0,
            "raw": raw,
        }
        return self.with_efficiency(rec, raw.get("bytes", 0) / 1e6)

    def record(self, rep: int, job: str, system: str, fn, *fn_args) -> None:
        log(f"rep {rep + 1}/{self.args.reps}: {JOBS[job]} on {system}")
        entry = {"rep": rep + 1, "job": job, "system": system}
        try:
            entry.update(fn(*fn_args))
            entry["ok"] = True
            log(f"  {entry['mb_s']:.1f} MB/s, {entry['iops']:.0f} IOPS, p50 "
                f"{entry['p50_us']:.1f} us, mean {entry['mean_us']:.1f} us, CPU "
                f"{entry['cpu_daemon_s']:.2f}+{entry['cpu_server_s']:.2f} s")
        except (BenchError, KeyError, ValueError, TypeError, subprocess.TimeoutExpired) as e:
            entry["ok"] = False
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"  FAILED: {entry['error']}")
        self.runs.append(entry)

    def measure(self) -> None:
        for rep in range(self.args.reps):
            plan = [
                (SEQREAD, "kiln_fuse", self.run_fio, ("kiln_fuse",)),
                (SEQREAD, "gluster_fuse", self.run_fio, ("gluster_fuse",)),
                (SEQREAD, "kiln_native", self.run_native, ("128k", 32)),
                (READ1M, "kiln_fuse", self.run_preadv, ("kiln_fuse",)),
                (READ1M, "gluster_fuse", self.run_preadv, ("gluster_fuse",)),
                (READ1M, "kiln_native", self.run_native, ("1m", 1)),
            ]
            for job in JOBS:
                sides = [p for p in plan if p[0] == job]
                if rep % 2 == 1:
                    sides.reverse()   # alternate who goes first
                for _, system, fn, fn_args in sides:
                    self.record(rep, job, system, fn, *fn_args)


# ------------------------------------------------------------------- summary

def summarize(runs: list[dict]) -> dict:
    med: dict[str, dict[str, dict]] = {}
    for job in JOBS:
        for system in SYSTEMS:
            group = [r for r in runs if r["job"] == job and r["system"] == system]
            if not group:
                continue
            entry = {}
            for k in METRICS:
                vals = [r[k] for r in group if r.get("ok") and isinstance(r.get(k), (int, float))]
                entry[k] = statistics.median(vals) if vals else None
            entry["n_ok"] = sum(1 for r in group if r.get("ok"))
            entry["n"] = len(group)
            med.setdefault(job, {})[system] = entry
    return med


def ratios(med: dict, seq_target: float = 2.0) -> list[dict]:
    def g(job, system, key):
        return med.get(job, {}).get(system, {}).get(key)

    def div(a, b):
        return None if a is None or b in (None, 0) else a / b

    def sub(a, b):
        return None if a is None or b is None else a - b

    rows = [
        ("fuse_seqread_vs_gluster", "Kiln FUSE seqread MB/s / GlusterFS FUSE",
         div(g(SEQREAD, "kiln_fuse", "mb_s"), g(SEQREAD, "gluster_fuse", "mb_s")), ">=", seq_target),
        ("fuse_seqread_cpu_vs_gluster", "Kiln FUSE seqread MB/CPU-s / GlusterFS FUSE",
         div(g(SEQREAD, "kiln_fuse", "mb_per_cpu_s"), g(SEQREAD, "gluster_fuse", "mb_per_cpu_s")),
         None, None),
        ("preadv256_p50_vs_gluster", "GlusterFS preadv256 p50 / Kiln FUSE p50",
         div(g(READ1M, "gluster_fuse", "p50_us"), g(READ1M, "kiln_fuse", "p50_us")), ">=", 2.0),
        ("preadv256_mean_vs_gluster", "GlusterFS preadv256 mean / Kiln FUSE mean",
         div(g(READ1M, "gluster_fuse", "mean_us"), g(READ1M, "kiln_fuse", "mean_us")),
         None, None),
        ("preadv256_cpu_vs_gluster", "Kiln FUSE preadv256 MB/CPU-s / GlusterFS",
         div(g(READ1M, "kiln_fuse", "mb_per_cpu_s"), g(READ1M, "gluster_fuse", "mb_per_cpu_s")),
         None, None),
        ("fuse_tax_seqread", "Kiln FUSE seqread MB/s / Kiln native",
         div(g(SEQREAD, "kiln_fuse", "mb_s"), g(SEQREAD, "kiln_native", "mb_s")), None, None),
        ("fuse_tax_seqread_cpu", "Kiln FUSE seqread MB/CPU-s / Kiln native",
         div(g(SEQREAD, "kiln_fuse", "mb_per_cpu_s"), g(SEQREAD, "kiln_native", "mb_per_cpu_s")),
         None, None),
        ("fuse_tax_1m_qd1_us", "Kiln FUSE preadv256 p50 - native 1m QD1 p50 (us)",
         sub(g(READ1M, "kiln_fuse", "p50_us"), g(READ1M, "kiln_native", "p50_us")), None, None),
        ("fuse_tax_1m_qd1", "Kiln FUSE preadv256 p50 / native 1m QD1 p50",
         div(g(READ1M, "kiln_fuse", "p50_us"), g(READ1M, "kiln_native", "p50_us")), None, None),
    ]
    out = []
    for name, what, value, op, target in rows:
        if value is None:
            status = "n/a"
        elif op is None:
            status = "info"
        elif value >= target:
            status = "PASS"
        else:
            status = "FAIL"
        out.append({"name": name, "what": what, "value": value, "op": op, "target": target,
                    "status": status})
    return out


def print_table(med: dict, rats: list[dict], args: argparse.Namespace) -> None:
    w = sys.stderr.write
    w(f"\nmedians of {args.reps} interleaved rep(s), runtime {args.runtime}s, size {args.size},"
      f" preadv256 {args.preadv_calls} calls (MB = 10^6 B, latency in us, CPU in s)\n"
      f"cpu dmn = FUSE daemon (kiln_native: kiln bench's client); cpu srv = brick server; "
      f"MB/cpu-s = MB / (dmn + srv)\n\n")
    head = (f"{'job':<22} {'system':<13} {'MB/s':>8} {'IOPS':>8} {'p50':>8} {'p99':>8} "
            f"{'mean':>8} {'cpu dmn':>8} {'cpu srv':>8} {'MB/cpu-s':>9} {'ok':>5}\n")
    w(head)
    w("-" * (len(head) - 1) + "\n")
    for job, label in JOBS.items():
        for system in SYSTEMS:
            m = med.get(job, {}).get(system)
            if m is None:
                continue
            w(f"{label:<22} {system:<13} {fmt(m['mb_s'], 8)} {fmt(m['iops'], 8, 0)} "
              f"{fmt(m['p50_us'], 8)} {fmt(m['p99_us'], 8)} {fmt(m['mean_us'], 8)} "
              f"{fmt(m['cpu_daemon_s'], 8, 2)} {fmt(m['cpu_server_s'], 8, 2)} "
              f"{fmt(m['mb_per_cpu_s'], 9)} {m['n_ok']:>2}/{m['n']:<2}\n")
    w("\n")
    for r in rats:
        target = "" if r["op"] is None else f"{r['op']} {r['target']:g}"
        w(f"{r['what']:<50} {fmt(r['value'], 8, 2)}  {target:<6} {r['status']}\n")
    g = med.get(READ1M, {}).get("gluster_fuse", {}).get("p50_us")
    w(f"{'GlusterFS preadv256 p50 (reference: 674 us)':<50} {fmt(g, 8, 1)}\n\n")


# ---------------------------------------------------------------------- main

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/fuse_compare.sh", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="repetitions, interleaved (default 3)")
    p.add_argument("--runtime", type=int, default=10,
                   help="seconds per fio / kiln bench run (default 10)")
    p.add_argument("--size", default="1g", help="size of bench.img, a multiple of 1 MiB "
                                               "(default 1g)")
    p.add_argument("--preadv-calls", type=int, default=2000,
                   help="timed preadv256 calls per run (default 2000, plus 20 warm-up)")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    p.add_argument("--keep-gluster", action="store_true",
                   help="leave GlusterFS running at the end even if this script started it")
    p.add_argument("--no-build", action="store_true", help="skip cargo build")
    p.add_argument("--kiln-bin", type=Path,
                   help="the kiln binary to run (default target/release/kiln)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any target FAILs")
    p.add_argument("--kiln-transport", choices=["unix", "tcp"], default="unix",
                   help="how kiln mount and kiln bench reach the local brick (default unix: a "
                        "brick on the same host is mounted through its Unix socket; tcp for the "
                        "loopback-TCP figure)")
    args = p.parse_args(argv)
    if args.reps < 1 or args.runtime < 1 or args.preadv_calls < 1:
        p.error("--reps, --runtime and --preadv-calls must be at least 1")
    try:
        size = parse_size(args.size)
    except ValueError as e:
        p.error(str(e))
    if size < (1 << 20) or size % (1 << 20):
        p.error("--size must be a positive multiple of 1 MiB")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    bench = FuseBench(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        bench.setup()
        bench.measure()
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except (BenchError, subprocess.CalledProcessError, OSError) as e:
        log(f"error: {e}")
        return 2
    finally:
        bench.cleanup()

    med = summarize(bench.runs)
    # Over TCP the mount's reads go by splice, one copy: the bar is higher (issue 22).
    rats = ratios(med, 2.5 if args.kiln_transport == "tcp" else 2.0)
    print_table(med, rats, args)
    result = {
        "started": started,
        "config": {"reps": args.reps, "runtime_s": args.runtime, "size": args.size,
                   "preadv_calls": args.preadv_calls, "kiln_mode": "vm-image",
                   "gluster_volume": GLUSTER_VOLUME,
                   "gluster_preadv_reference_us": GLUSTER_PREADV_REFERENCE_US,
                   "layout": bench.layout},
        "medians": med,
        "ratios": rats,
        "runs": bench.runs,
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out}")
    failed = [r for r in bench.runs if not r.get("ok")]
    if failed:
        log(f"{len(failed)} run(s) failed")
        return 1
    if args.strict and any(r["status"] == "FAIL" for r in rats):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
