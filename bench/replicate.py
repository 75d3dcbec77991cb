#!/usr/bin/env python3
"""Replica-3 volumes: Kiln vs a GlusterFS 1x3 volume, and Kiln replica-3 reads vs one brick.

For every repetition (--reps, default 3) this runs, in an order that flips from one
repetition to the next:

  kiln_rep3_write    kiln bench --replica 3 --rw write --bs 128k --iodepth 32 --transport unix
                     (three brick processes with the replica stack, bricks on a tmpfs,
                     reached over their Unix sockets: what a volume's client on the bricks'
                     host uses, see README "Volumes")
  kiln_rep3_write_tcp  the same over loopback TCP (what a client on another host pays, as
                     far as one machine can show it)
  gluster_rep3_write fio --ioengine=gfapi_async --rw=write --bs=128k --iodepth=32 on the
                     rep3 volume of ../shared/bench/gluster.sh (1x3, bricks on a tmpfs)
  kiln_rep3_read     kiln bench --replica 3 --rw read --bs 128k --iodepth 32 --transport unix
  kiln_single_read   kiln bench --rw read --bs 128k --iodepth 32 --transport unix (one brick,
                     default stack)

each on a --size file (default 1g) for --runtime seconds (default 10). It prints the medians
and the ratios the replicate work is held to:

  rep3_write_vs_gluster      Kiln rep3 write MB/s / GlusterFS rep3 write MB/s   >= 2.5
  rep3_write_p99_vs_gluster  Kiln rep3 write p99 / GlusterFS rep3 write p99     <= 0.1
  rep3_write_tcp_vs_gluster  the same over TCP (reported, no target)
  rep3_read_vs_single        Kiln rep3 read MB/s / Kiln single-brick read MB/s  >= 0.9

A human table goes to stderr, one JSON object to stdout (and to --out FILE). The machine is
shared and noisy: compare ratios of medians, not single numbers.

Usage: bench/replicate.py [--reps N] [--runtime S] [--size 1g] [--no-build] [--keep-gluster]
       [--only kiln]   (skip GlusterFS)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402  (shared helpers: GlusterRef, run_group, log, …)

TMPFS = Path("/tmp/kiln-rep-bench")
TMPFS_SIZE = "8g"
GLUSTER_VOLUME = "rep3"
GLUSTER_FILE = "rep-bench.img"


class RepBench(c.GlusterRef):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.root = c.repo_root()
        c.GlusterRef.__init__(self, self.root)
        self.kiln = self.root / "target" / "release" / "kiln"
        self.mounted = False
        self.started_gluster = False
        self.brick_pids: list[int] = []

    def setup(self) -> None:
        if not self.args.no_build:
            c.log("cargo build --release -p kiln-cli")
            subprocess.run(["cargo", "build", "--release", "-p", "kiln-cli"], cwd=self.root,
                           check=True)
        if not self.kiln.is_file():
            raise c.BenchError(f"{self.kiln} is missing")
        TMPFS.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mountpoint", "-q", str(TMPFS)]).returncode != 0:
            subprocess.run(c.privileged() + ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}",
                                             "kiln-rep-bench", str(TMPFS)], check=True)
            self.mounted = True
        # Lay the files out first (a short read job writes them), as GlusterFS's is: the
        # timed writes then overwrite, on both systems.
        for replica in (3, 1):
            c.log(f"laying out the Kiln file (replica {replica})")
            self.kiln_bench("read", replica, -1, runtime=1)
        if "gluster" in self.args.only:
            c.ensure_packages({"fio": "fio"})
            was_up = self.glusterd_alive()
            c.log(self.gluster("up").strip())
            self.started_gluster = not was_up
            pids = [ln.strip() for ln in self.gluster("pids", GLUSTER_VOLUME).splitlines()]
            self.brick_pids = [int(p) for p in pids[1:] if p.isdigit()]
            c.log(f"laying out {GLUSTER_FILE} on {GLUSTER_VOLUME}")
            self.fio_gluster(["--name=layout", "--rw=write", "--bs=1m", "--iodepth=8",
                              f"--size={self.args.size}"])

    def cleanup(self) -> None:
        if self.mounted:
            subprocess.run(c.privileged() + ["umount", "-l", str(TMPFS)])
            shutil.rmtree(TMPFS, ignore_errors=True)
        if self.started_gluster and not self.args.keep_gluster:
            try:
                self.gluster("down", timeout=300)
            except (c.BenchError, subprocess.TimeoutExpired) as e:
                c.log(f"gluster.sh down: {e}")

    def fio_gluster(self, fio_args: list[str]) -> dict:
        cmd = [str(self.gluster_sh), "fio", GLUSTER_VOLUME, f"--filename={GLUSTER_FILE}",
               "--thread", "--output-format=json", *fio_args]
        rc, out, err = c.run_group(cmd, timeout=self.args.runtime * 3 + 300)
        if rc != 0:
            raise c.BenchError(f"fio exited {rc}: {c.tail(err or out)}")
        return c.first_json_object(out)

    def gluster_write(self) -> dict:
        doc = self.fio_gluster(["--name=w", "--rw=write", "--bs=128k", "--iodepth=32",
                                f"--size={self.args.size}", f"--runtime={self.args.runtime}",
                                "--time_based", "--lat_percentiles=1",
                                "--percentile_list=50:99:99.9"])
        sec = doc["jobs"][0]["write"]
        pct = sec.get("lat_ns", {}).get("percentile") or sec.get("clat_ns", {}).get("percentile")
        return {"mb_s": sec["bw_bytes"] / 1e6,
                "p50_us": pct["50.000000"] / 1e3, "p99_us": pct["99.000000"] / 1e3}

    def kiln_bench(self, rw: str, replica: int, rep: int, runtime: float | None = None,
                   transport: str = "unix") -> dict:
        brick = TMPFS / f"{'rep' if replica > 1 else 'single'}"
        cmd = [str(self.kiln), "bench", "--rw", rw, "--bs", "128k", "--iodepth", "32",
               "--size", self.args.size, "--runtime", str(runtime or self.args.runtime),
               "--brick", str(brick), "--transport", transport, "--json"]
        if replica > 1:
            cmd += ["--replica", str(replica)]
        rc, out, err = c.run_group(cmd, timeout=self.args.runtime * 3 + 300, cwd=self.root)
        if rc != 0:
            raise c.BenchError(f"kiln bench exited {rc}: {c.tail(err or out)}")
        doc = c.last_json_line(out)
        return {"mb_s": doc["mb_s"], "p50_us": doc["lat_us"]["p50"],
                "p99_us": doc["lat_us"]["p99"], "cpu_client_s": doc["cpu_s"]["client"],
                "cpu_server_s": doc["cpu_s"]["server"],
                "bytes_copied": doc["bytes_copied"]}

    def run(self) -> dict:
        jobs = {
            "kiln_rep3_write": lambda r: self.kiln_bench("write", 3, r),
            "kiln_rep3_write_tcp": lambda r: self.kiln_bench("write", 3, r, transport="tcp"),
            "kiln_rep3_read": lambda r: self.kiln_bench("read", 3, r),
            "kiln_single_read": lambda r: self.kiln_bench("read", 1, r),
        }
        if "gluster" in self.args.only:
            jobs["gluster_rep3_write"] = lambda r: self.gluster_write()
        runs: dict[str, list[dict]] = {k: [] for k in jobs}
        for rep in range(self.args.reps):
            order = list(jobs) if rep % 2 == 0 else list(reversed(jobs))
            for name in order:
                res = jobs[name](rep)
                c.log(f"rep {rep} {name}: {res['mb_s']:.1f} MB/s p50 {res['p50_us']:.0f} us "
                      f"p99 {res['p99_us']:.0f} us")
                runs[name].append(res)
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("mb_s", "p50_us", "p99_us")}
               for k, v in runs.items() if v}
        ratios = []

        def ratio(name, num, den, target, better):
            if num is None or den is None or den == 0:
                return
            v = num / den
            ok = v >= target if better == ">=" else v <= target
            ratios.append({"name": name, "value": round(v, 3), "target": f"{better} {target}",
                           "pass": ok})

        g = med.get("gluster_rep3_write")
        k = med["kiln_rep3_write"]
        if g:
            ratio("rep3_write_vs_gluster", k["mb_s"], g["mb_s"], 2.5, ">=")
            ratio("rep3_write_p99_vs_gluster", k["p99_us"], g["p99_us"], 0.1, "<=")
            kt = med["kiln_rep3_write_tcp"]
            ratios.append({"name": "rep3_write_tcp_vs_gluster",
                           "value": round(kt["mb_s"] / g["mb_s"], 3), "target": "none",
                           "pass": True})
        ratio("rep3_read_vs_single", med["kiln_rep3_read"]["mb_s"],
              med["kiln_single_read"]["mb_s"], 0.9, ">=")
        return {"reps": self.args.reps, "runtime_s": self.args.runtime, "size": self.args.size,
                "runs": runs, "medians": med, "ratios": ratios}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--runtime", type=float, default=10)
    p.add_argument("--size", default="1g")
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--keep-gluster", action="store_true")
    p.add_argument("--only", nargs="+", default=["kiln", "gluster"], choices=["kiln", "gluster"])
    p.add_argument("--out")
    args = p.parse_args(argv)
    b = RepBench(args)
    try:
        b.setup()
        t0 = time.monotonic()
        result = b.run()
        result["wall_s"] = round(time.monotonic() - t0, 1)
    finally:
        b.cleanup()
    for name, m in result["medians"].items():
        print(f"{name:<20} {m['mb_s']:>9.1f} MB/s  p50 {m['p50_us']:>9.0f} us  "
              f"p99 {m['p99_us']:>9.0f} us", file=sys.stderr)
    for r in result["ratios"]:
        print(f"{r['name']:<28} {r['value']:>7.3f}  target {r['target']:<7} "
              f"{'PASS' if r['pass'] else 'FAIL'}", file=sys.stderr)
    return c.emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
