#!/usr/bin/env python3
"""What security costs on the data path: TLS and the shared-secret handshake vs plaintext.

Three server modes, each a fresh `kiln server` on the same brick (a tmpfs under /dev/shm):

  plain    no secret, no TLS
  secret   --secret-file (the default for volumes: HMAC challenge-response at connect only)
  tls      --tls DIR and --secret-file (mutual certificates from `kiln tls init/issue`)

and three jobs run by `kiln bench --connect` against each (1 GiB file, --runtime seconds):

  seqread_128k_qd32   sequential read, 128 KiB, 32 in flight   (MB/s)
  seqwrite_128k_qd32  sequential write, 128 KiB, 32 in flight  (MB/s)
  randread_4k_qd1     random 4 KiB reads one at a time         (p50 latency, us)

Every repetition (--reps, default 3) runs every mode for every job, in an order that rotates
from one repetition to the next; the report gives medians and the ratios

  tls_vs_plain_seqread      TLS / plaintext sequential read MB/s     (target >= 0.5)
  secret_vs_plain_seqread   secret / plaintext sequential read MB/s  (should be ~1)
  secret_vs_plain_qd1_p50   secret / plaintext 4k QD1 p50 latency    (should be ~1)

plus MB per CPU-second (client + server) for each, the noise-resistant view on 2 shared cores.
A table goes to stderr, one JSON object to stdout (and --out FILE).

Usage: bench/tls.py [--reps N] [--runtime S] [--size 1g] [--no-build] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402  (log, repo_root)

MODES = ["plain", "secret", "tls"]
JOBS = {
    "seqread_128k_qd32": ["--rw", "read", "--bs", "128k", "--iodepth", "32"],
    "seqwrite_128k_qd32": ["--rw", "write", "--bs", "128k", "--iodepth", "32"],
    "randread_4k_qd1": ["--rw", "randread", "--bs", "4k", "--iodepth", "1"],
}


def start_server(kiln: Path, brick: Path, mode: str, keys: Path) -> tuple[subprocess.Popen, str]:
    cmd = [str(kiln), "server", "--brick", str(brick), "--listen", "tcp:127.0.0.1:0",
           "--metrics", "off"]
    if mode in ("secret", "tls"):
        cmd += ["--secret-file", str(keys / "brick.secret")]
    if mode == "tls":
        cmd += ["--tls", str(keys / "brick")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    prefix = "kilnd: listening on "
    if not line.startswith(prefix):
        p.kill()
        raise c.BenchError(f"server did not start: {line!r}")
    return p, line[len(prefix):]


def run_one(kiln: Path, brick: Path, keys: Path, mode: str, job: str, args) -> dict:
    server, addr = start_server(kiln, brick, mode, keys)
    env = dict(os.environ)
    env.pop("KILN_TLS_DIR", None)
    env.pop("KILN_SECRET_FILE", None)
    if mode in ("secret", "tls"):
        env["KILN_SECRET_FILE"] = str(keys / "brick.secret")
    if mode == "tls":
        env["KILN_TLS_DIR"] = str(keys / "client")
    try:
        out = subprocess.run(
            [str(kiln), "bench", "--connect", addr, "--server-pid", str(server.pid),
             "--size", args.size, "--runtime", str(args.runtime), "--json", *JOBS[job]],
            env=env, capture_output=True, text=True, timeout=args.runtime * 4 + 120)
    finally:
        server.kill()
        server.wait()
    if out.returncode != 0:
        raise c.BenchError(f"{mode} {job}: {c.tail(out.stderr)}")
    r = c.last_json_line(out.stdout)
    cpu = r.get("cpu_s", {})
    return {
        "mode": mode, "job": job, "mb_s": r["mb_s"], "iops": r["iops"],
        "p50_us": r["lat_us"]["p50"], "p99_us": r["lat_us"]["p99"],
        "cpu_s": (cpu.get("client") or 0) + (cpu.get("server") or 0),
        "mb_per_cpu_s": r.get("mb_per_cpu_s"),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=float, default=8.0)
    ap.add_argument("--size", default="1g")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    kiln = c.release_kiln(args.no_build)
    work = Path(tempfile.mkdtemp(prefix="kiln-tls-bench-", dir="/dev/shm"))
    keys = work / "keys"
    brick = work / "brick"
    brick.mkdir()
    runs: list[dict] = []
    try:
        subprocess.run([str(kiln), "tls", "init", str(keys / "ca")], check=True,
                       stdout=subprocess.DEVNULL)
        for name, sans in (("brick", ["--san", "127.0.0.1"]), ("client", [])):
            subprocess.run([str(kiln), "tls", "issue", "--ca", str(keys / "ca"), "--out",
                            str(keys / name), name, *sans], check=True,
                           stdout=subprocess.DEVNULL)
        for rep in range(args.reps):
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for job in JOBS:
                for mode in order:
                    r = run_one(kiln, brick, keys, mode, job, args)
                    r["rep"] = rep
                    runs.append(r)
                    c.log(f"rep {rep} {job:20} {mode:7} {r['mb_s']:9.1f} MB/s "
                          f"p50 {r['p50_us']:8.1f} us  {r['mb_per_cpu_s'] or 0:8.1f} MB/cpu-s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(mode: str, job: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode and r["job"] == job)

    medians = {job: {mode: {k: med(mode, job, k) for k in ("mb_s", "p50_us", "p99_us",
                                                             "mb_per_cpu_s")}
                     for mode in MODES} for job in JOBS}
    sr = medians["seqread_128k_qd32"]
    q1 = medians["randread_4k_qd1"]
    ratios = {
        "tls_vs_plain_seqread": sr["tls"]["mb_s"] / sr["plain"]["mb_s"],
        "tls_vs_plain_seqread_per_cpu": sr["tls"]["mb_per_cpu_s"] / sr["plain"]["mb_per_cpu_s"],
        "tls_vs_plain_seqwrite": medians["seqwrite_128k_qd32"]["tls"]["mb_s"]
        / medians["seqwrite_128k_qd32"]["plain"]["mb_s"],
        "tls_vs_plain_qd1_p50": q1["tls"]["p50_us"] / q1["plain"]["p50_us"],
        "secret_vs_plain_seqread": sr["secret"]["mb_s"] / sr["plain"]["mb_s"],
        "secret_vs_plain_qd1_p50": q1["secret"]["p50_us"] / q1["plain"]["p50_us"],
    }
    print(f"{'job':20} {'mode':7} {'MB/s':>9} {'p50 us':>9} {'p99 us':>9} {'MB/cpu-s':>9}",
          file=sys.stderr)
    for job, by_mode in medians.items():
        for mode, m in by_mode.items():
            print(f"{job:20} {mode:7} {m['mb_s']:9.1f} {m['p50_us']:9.1f} {m['p99_us']:9.1f} "
                  f"{m['mb_per_cpu_s']:9.1f}", file=sys.stderr)
    for k, v in ratios.items():
        print(f"{k:32} {v:6.3f}", file=sys.stderr)
    result = {"reps": args.reps, "runtime_s": args.runtime, "medians": medians,
              "ratios": ratios, "runs": runs}
    return c.emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
