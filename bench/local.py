#!/usr/bin/env python3
"""Local short-circuit reads against the floor: fio reading the brick's file directly.

One `kiln server` on a brick in /dev/shm, reached over its Unix socket, and one 1 GiB file
(`kiln-bench.img`, laid out by the first `kiln bench`). Three ways to read it:

  fio      fio psync straight on the brick's file (the floor: one preadv per I/O)
  direct   kiln bench --short-circuit on  (reads through the brick's grant, preadv on its file)
  brick    kiln bench --short-circuit off (every read a request over the Unix socket)
  fuse     fio psync on a `kiln mount --mode vm-image` of the brick (FUSE passthrough: the
           kernel reads the brick's file itself)
  fuse_off the same mount with --passthrough off (every read through the mount process)

and two jobs, each for --runtime seconds:

  randread_4k_qd1     random 4 KiB reads one at a time   (p50 latency, us)
  seqread_128k_qd32   sequential 128 KiB reads, Kiln with 32 in flight, fio psync (MB/s)

Every repetition (--reps, default 5) runs the three ways for both jobs in an order that
rotates from one repetition to the next; the report gives medians and the ratios

  direct_vs_fio_qd1_p50     direct / fio 4k QD1 p50             (target <= 1.5)
  direct_vs_fio_seqread     direct / fio 128k MB/s              (target >= 0.8)
  fuse_vs_fio_seqread       passthrough mount / fio 128k MB/s   (target >= 0.8)
  brick_vs_direct_qd1_p50   what a request over the socket costs instead

A table goes to stderr, one JSON object to stdout (and --out FILE). Needs fio (apt-get
install fio when missing).

Usage: bench/local.py [--reps N] [--runtime S] [--no-build] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402  (log, repo_root, BenchError, tail, last_json_line)

WAYS = ["fio", "direct", "brick", "fuse", "fuse_off"]
JOBS = {
    "randread_4k_qd1": {"kiln": ["--rw", "randread", "--bs", "4k", "--iodepth", "1"],
                        "fio": ["--rw=randread", "--bs=4k"]},
    "seqread_128k_qd32": {"kiln": ["--rw", "read", "--bs", "128k", "--iodepth", "32"],
                          "fio": ["--rw=read", "--bs=128k"]},
}
FILE = "kiln-bench.img"


def start_server(kiln: Path, brick: Path, sock: Path) -> subprocess.Popen:
    p = subprocess.Popen([str(kiln), "server", "--brick", str(brick), "--listen",
                          f"unix:{sock}", "--metrics", "off"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("kilnd: listening on "):
        p.kill()
        raise c.BenchError(f"server did not start: {line!r}")
    return p


def run_kiln(kiln: Path, sock: Path, pid: int, way: str, job: str, args) -> dict:
    out = subprocess.run(
        [str(kiln), "bench", "--connect", f"unix:{sock}", "--server-pid", str(pid),
         "--size", "1g", "--file", FILE, "--runtime", str(args.runtime), "--json",
         "--short-circuit", "on" if way == "direct" else "off", *JOBS[job]["kiln"]],
        capture_output=True, text=True, timeout=args.runtime * 4 + 300)
    if out.returncode != 0:
        raise c.BenchError(f"{way} {job}: {c.tail(out.stderr)}")
    r = c.last_json_line(out.stdout)
    return {"mb_s": r["mb_s"], "p50_us": r["lat_us"]["p50"], "p99_us": r["lat_us"]["p99"]}


def mount(kiln: Path, sock: Path, mnt: Path, passthrough: bool) -> subprocess.Popen:
    mnt.mkdir(exist_ok=True)
    p = subprocess.Popen([str(kiln), "mount", f"unix:{sock}:/vol", str(mnt), "--mode",
                          "vm-image", "--metrics", "off", "--passthrough",
                          "on" if passthrough else "off"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if not line.startswith("kiln: mounted"):
        p.kill()
        raise c.BenchError(f"mount did not start: {line!r}")
    return p


def unmount(p: subprocess.Popen) -> None:
    p.terminate()
    p.wait(timeout=30)


def run_fio(path: Path, job: str, args) -> dict:
    out = subprocess.run(
        ["fio", "--name=floor", f"--filename={path}", "--ioengine=psync", "--readonly",
         "--size=1g", "--time_based", f"--runtime={args.runtime}", "--invalidate=0",
         "--output-format=json", *JOBS[job]["fio"]],
        capture_output=True, text=True, timeout=args.runtime * 4 + 120)
    if out.returncode != 0:
        raise c.BenchError(f"fio {job}: {c.tail(out.stderr)}")
    r = json.loads(out.stdout)["jobs"][0]["read"]
    pct = r["clat_ns"]["percentile"]
    return {"mb_s": r["bw_bytes"] / 1e6, "p50_us": pct["50.000000"] / 1e3,
            "p99_us": pct["99.000000"] / 1e3}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runtime", type=float, default=5.0)
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        c.log("installing fio")
        subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True,
                       stdout=subprocess.DEVNULL)
    kiln = c.release_kiln(args.no_build)
    work = Path(tempfile.mkdtemp(prefix="kiln-local-bench-", dir="/dev/shm"))
    brick, sock = work / "brick", work / "brick.sock"
    brick.mkdir()
    server = start_server(kiln, brick, sock)
    runs: list[dict] = []
    try:
        c.log("laying out the file")
        run_kiln(kiln, sock, server.pid, "brick", "randread_4k_qd1",
                 argparse.Namespace(runtime=0.5))
        for rep in range(args.reps):
            order = WAYS[rep % len(WAYS):] + WAYS[:rep % len(WAYS)]
            for job in JOBS:
                for way in order:
                    if way == "fio":
                        r = run_fio(brick / FILE, job, args)
                    elif way.startswith("fuse"):
                        m = mount(kiln, sock, work / way, way == "fuse")
                        try:
                            r = run_fio(work / way / FILE, job, args)
                        finally:
                            unmount(m)
                    else:
                        r = run_kiln(kiln, sock, server.pid, way, job, args)
                    r.update(rep=rep, job=job, way=way)
                    runs.append(r)
                    c.log(f"rep {rep} {job:18} {way:6} {r['mb_s']:9.1f} MB/s "
                          f"p50 {r['p50_us']:8.2f} us")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)

    def med(way: str, job: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["way"] == way and r["job"] == job)

    medians = {job: {way: {k: med(way, job, k) for k in ("mb_s", "p50_us", "p99_us")}
                     for way in WAYS} for job in JOBS}
    q1, sr = medians["randread_4k_qd1"], medians["seqread_128k_qd32"]
    ratios = [
        ("direct_vs_fio_qd1_p50", q1["direct"]["p50_us"] / q1["fio"]["p50_us"], "<=", 1.5),
        ("direct_vs_fio_seqread", sr["direct"]["mb_s"] / sr["fio"]["mb_s"], ">=", 0.8),
        ("fuse_vs_fio_seqread", sr["fuse"]["mb_s"] / sr["fio"]["mb_s"], ">=", 0.8),
        ("fuse_off_vs_fio_seqread", sr["fuse_off"]["mb_s"] / sr["fio"]["mb_s"], "", None),
        ("brick_vs_direct_qd1_p50", q1["brick"]["p50_us"] / q1["direct"]["p50_us"], "", None),
        ("direct_vs_brick_seqread", sr["direct"]["mb_s"] / sr["brick"]["mb_s"], "", None),
    ]
    print(f"\nmedians of {args.reps} reps, {args.runtime} s each", file=sys.stderr)
    print(f"{'job':18} {'way':6} {'MB/s':>9} {'p50 us':>9} {'p99 us':>9}", file=sys.stderr)
    for job, by_way in medians.items():
        for way, m in by_way.items():
            print(f"{job:18} {way:6} {m['mb_s']:9.1f} {m['p50_us']:9.2f} {m['p99_us']:9.2f}",
                  file=sys.stderr)
    out_ratios = []
    for name, v, op, target in ratios:
        ok = (target is None or (v <= target if op == "<=" else v >= target))
        status = "info" if target is None else ("PASS" if ok else "FAIL")
        print(f"{name:26} {v:7.3f} {op} {target if target else '':4} {status}", file=sys.stderr)
        out_ratios.append({"name": name, "value": v, "op": op, "target": target,
                           "status": status})
    result = {"reps": args.reps, "runtime_s": args.runtime, "medians": medians,
              "ratios": out_ratios, "runs": runs}
    return c.emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
