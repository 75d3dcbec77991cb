#!/usr/bin/env python3
"""A full rebuild's cost to clients: fio's p99 latency through a mount while a wiped brick is
rebuilt, against the same fio with all bricks members — alternating, in the same run.

Setup: a managed kilnd (release build, heal service every 0.2 s), a replica-3 volume whose
bricks are directories under --dir, mounted (vm-image mode); --files files of --file-mb MiB
each. Per repetition (--reps, default 3):

  idle     fio randrw 4 KiB, QD1, O_DIRECT, --runtime s on a 64 MiB file of the mount
  rebuild  brick 2 killed, wiped (.kiln too), `volume start force`; once the heal service
           shows the rebuild under way, the same fio; then the rebuild is waited out

and prints, per phase, fio's read and write completion-latency p99 (µs), and the ratios
rebuild/idle (medians over repetitions) — the target is <= 2 — with the rebuild rate the
heal service reported. A human table goes to stderr, JSON to stdout.

Usage: bench/rebuild.py [--reps 3] [--runtime 3] [--files 24] [--file-mb 16] [--no-build]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kcluster import Cluster, build, log

PORT = 24890


def rebuilds(c: Cluster) -> list:
    return (c.status().get("heal") or {}).get("rebuilds", [])


def wipe(c: Cluster, i: int) -> None:
    os.kill(c.status()["bricks"][i]["pid"], signal.SIGKILL)
    shutil.rmtree(c.bricks[i])
    c.bricks[i].mkdir()
    c.cli("volume", "start", "rb", "force")


def fio(mnt: Path, runtime: int) -> dict:
    out = subprocess.run(
        ["fio", "--name=lat", f"--filename={mnt / 'fio.img'}", "--size=64m", "--rw=randrw",
         "--bs=4k", "--iodepth=1", "--direct=1", "--ioengine=psync", "--time_based",
         f"--runtime={runtime}", "--output-format=json"], check=True, capture_output=True,
        text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    p99 = lambda d: job[d]["clat_ns"]["percentile"]["99.000000"] / 1000  # noqa: E731
    return {"read_p99_us": p99("read"), "write_p99_us": p99("write"),
            "iops": job["read"]["iops"] + job["write"]["iops"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--file-mb", type=int, default=16)
    ap.add_argument("--dir", default="/var/tmp/kiln-rebuild-bench")
    ap.add_argument("--no-build", action="store_true")
    a = ap.parse_args()
    build(a.no_build)
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    c = Cluster(base, PORT, "rb", 3, replica=3, kilnd=("--heal-interval", "0.2"))
    try:
        block = os.urandom(1 << 20)
        for i in range(a.files):
            with open(c.mnt / f"f{i}", "wb") as f:
                for _ in range(a.file_mb):
                    f.write(block)
        fio(c.mnt, 1)  # lays out the fio file
        runs = {"idle": [], "rebuild": []}
        rates = []
        for rep in range(a.reps):
            order = ["idle", "rebuild"] if rep % 2 == 0 else ["rebuild", "idle"]
            for phase in order:
                if phase == "idle":
                    runs["idle"].append(fio(c.mnt, a.runtime))
                    continue
                wipe(c, 2)
                deadline = time.time() + 30
                while not any(not r["done"] for r in rebuilds(c)):
                    assert time.time() < deadline, "the rebuild never started"
                    time.sleep(0.05)
                runs["rebuild"].append(fio(c.mnt, a.runtime))
                rs = [r for r in rebuilds(c) if not r["done"]]
                if rs:
                    rates.append(rs[0]["rate"])
                # Idle again: the rebuild done and what fio's writes left for heal healed.
                deadline = time.time() + 300
                while True:
                    st = c.status().get("heal") or {}
                    rb = st.get("rebuilds", [])
                    if all(r["done"] for r in rb) and st.get("backlog", 1) == 0:
                        break
                    assert time.time() < deadline, "the rebuild never finished"
                    time.sleep(0.1)
            log(f"rep {rep}: idle {runs['idle'][-1]}  rebuild {runs['rebuild'][-1]}")
        med = lambda phase, k: statistics.median(r[k] for r in runs[phase])  # noqa: E731
        result = {
            "idle": {k: med("idle", k) for k in runs["idle"][0]},
            "rebuild": {k: med("rebuild", k) for k in runs["rebuild"][0]},
            "read_p99_ratio": med("rebuild", "read_p99_us") / med("idle", "read_p99_us"),
            "write_p99_ratio": med("rebuild", "write_p99_us") / med("idle", "write_p99_us"),
            "rebuild_rate_mb_s": statistics.median(rates) / 1e6 if rates else None,
            "reps": a.reps,
            "runs": runs,
        }
        log(f"p99 rebuild/idle: read {result['read_p99_ratio']:.2f}, write "
            f"{result['write_p99_ratio']:.2f} (target <= 2); rebuild rate "
            f"{result['rebuild_rate_mb_s']} MB/s")
        print(json.dumps(result))
    finally:
        c.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
