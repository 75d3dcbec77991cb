#!/usr/bin/env python3
"""Rebalance: how fast it moves data against dd between the same directories, and how well its
ETA predicts the finish — in one run.

Setup: a managed kilnd (release build), a one-brick volume under --dir, mounted; through the
mount --files small files (1-8 KiB, in 100 directories) and --images sparse images of
--image-gib GiB each with --data-mib MiB of data in 16 pieces, named so that the two-set layout
places them on the new set (all of them move). Then:

  dd       each image copied from the brick to a scratch file beside the second brick's
           directory (dd bs=1M conv=sparse): the bricks' raw copy rate, in apparent bytes/s
  grow     `add-brick` a second brick, `rebalance start --rate 0` (no pace);
           `rebalance status` every 0.5 s until it completes

Prints the rebalance's rate (apparent bytes copied / elapsed, holes included, as it reports
them) and its ratio to dd's (target >= 0.5), and the ETA's error at 25/50/75 % of the run:
|t + eta(t) - T| / T, where T is the real finish (target <= 0.2). A human table goes to stderr,
JSON to stdout.

With --latency RATE (MiB/s; 0: no limit) it measures instead what the rebalance costs
clients: fio 4 KiB random reads at QD1 (O_DIRECT) on a file of the mount that does not move,
for --runtime s before the rebalance (idle) and while it runs at that pace; it prints both p99s
and their ratio (target <= 2).

Usage: bench/rebalance.py [--files 10000] [--images 4] [--image-gib 4] [--data-mib 64]
                          [--latency RATE] [--runtime 5]
                          [--dir /var/tmp/kiln-rebalance-bench] [--no-build]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kcluster import Cluster, build, log, name_hash

PORT = 24930
VOL = "rbal"


def on_second_of_two(name: str) -> bool:
    return name_hash(name) >= 1 << 31


def populate(mnt: Path, files: int, images: list[str], gib: int, data_mib: int) -> int:
    rnd = random.Random(7)
    for d in range(100):
        (mnt / f"d{d}").mkdir()
    for i in range(files):
        (mnt / f"d{i % 100}" / f"f{i}").write_bytes(os.urandom(rnd.randint(1, 8) << 10))
    piece = (data_mib << 20) // 16
    for name in images:
        with open(mnt / name, "wb") as f:
            f.truncate(gib << 30)
            for k in range(16):
                f.seek(k * ((gib << 30) // 16))
                f.write(os.urandom(piece))
    return sum(p.stat().st_size for p in mnt.rglob("*") if p.is_file())


def dd_rate(src_dir: Path, scratch: Path, images: list[str]) -> float:
    """Apparent bytes per second dd copies the images between the brick directories."""
    scratch.mkdir(exist_ok=True)
    total, t0 = 0, time.monotonic()
    for name in images:
        src = src_dir / name
        subprocess.run(["dd", f"if={src}", f"of={scratch / name}", "bs=1M", "conv=sparse",
                        "status=none"], check=True)
        total += src.stat().st_size
    subprocess.run(["sync"], check=True)
    rate = total / (time.monotonic() - t0)
    shutil.rmtree(scratch)
    return rate


def fio_p99(path: Path, runtime: int) -> float:
    out = subprocess.run(
        ["fio", "--name=lat", f"--filename={path}", "--size=64m", "--rw=randread", "--bs=4k",
         "--iodepth=1", "--direct=1", "--ioengine=psync", "--time_based",
         f"--runtime={runtime}", "--output-format=json"], check=True, capture_output=True,
        text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read"]["clat_ns"]["percentile"]["99.000000"] / 1000


def latency(c: Cluster, rate: int, runtime: int) -> dict:
    # A file that stays where it is: on the first set under both layouts.
    name = next(f"still{n}.img" for n in range(1000) if not on_second_of_two(f"still{n}.img"))
    with open(c.mnt / name, "wb") as f:
        f.write(os.urandom(64 << 20))
    idle = fio_p99(c.mnt / name, runtime)
    c.cli("volume", "add-brick", VOL, f"127.0.0.1:{c.base / 'b1'}")
    c.cli("volume", "rebalance", VOL, "start", "--rate", rate)
    busy = fio_p99(c.mnt / name, runtime)
    st = c.rebalance_status()
    still = st["state"] == "running"
    c.cli("volume", "rebalance", VOL, "stop") if still else None
    return {"rate_limit_mib_s": rate, "idle_p99_us": round(idle, 1),
            "rebalance_p99_us": round(busy, 1), "ratio": round(busy / idle, 2),
            "rebalance_ran_all_along": still,
            "rebalance_mib_s": round(st["rate_bps"] / 2**20, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--image-gib", type=int, default=4)
    ap.add_argument("--data-mib", type=int, default=64)
    ap.add_argument("--latency", type=int, default=None, metavar="RATE")
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp/kiln-rebalance-bench")
    ap.add_argument("--no-build", action="store_true")
    a = ap.parse_args()
    build(a.no_build)
    base = Path(a.dir)
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    images = []
    n = 0
    while len(images) < a.images:
        if on_second_of_two(f"image{n}.raw"):
            images.append(f"image{n}.raw")
        n += 1
    c = Cluster(base, PORT, VOL, 1, mode="general")
    try:
        log(f"populating: {a.files} small files, {a.images} x {a.image_gib} GiB images")
        apparent = populate(c.mnt, a.files, images, a.image_gib, a.data_mib)
        if a.latency is not None:
            out = latency(c, a.latency, a.runtime)
            log(json.dumps(out, indent=1))
            print(json.dumps(out))
            return 0
        dd = dd_rate(c.bricks[0], base / "scratch", images)
        log(f"dd: {dd / 2**20:.0f} MiB/s (apparent)")
        c.cli("volume", "add-brick", VOL, f"127.0.0.1:{c.base / 'b1'}")
        c.cli("volume", "rebalance", VOL, "start", "--rate", "0")
        t0 = time.monotonic()
        samples = []
        while True:
            st = c.rebalance_status()
            t = time.monotonic() - t0
            if st["state"] != "running":
                break
            samples.append((t, st.get("eta_s"), st["bytes_moved"], st["files_moved"]))
            time.sleep(0.5)
        T = time.monotonic() - t0
        rate = st["bytes_moved"] / T
        errs = {}
        for frac in (0.25, 0.5, 0.75):
            near = [s for s in samples if s[1] is not None and s[0] >= frac * T]
            if near:
                t, eta = near[0][0], near[0][1]
                errs[f"eta_err_at_{int(frac * 100)}pct"] = round(abs(t + eta - T) / T, 3)
        out = {"files_total": st["files_total"], "files_moved": st["files_moved"],
               "bytes_moved": st["bytes_moved"], "apparent_bytes": apparent,
               "state": st["state"], "failed": st["failed"], "elapsed_s": round(T, 2),
               "rate_mib_s": round(rate / 2**20, 1), "dd_mib_s": round(dd / 2**20, 1),
               "rate_vs_dd": round(rate / dd, 3), **errs}
        log(json.dumps(out, indent=1))
        print(json.dumps(out))
    finally:
        c.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
