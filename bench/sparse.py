#!/usr/bin/env python3
"""A sparse image copied out through the NBD export, with block status and without.

One `kiln server` on a brick in /dev/shm, one image of --size-mib MiB holding --data-mib MiB
of random data in 16 pieces spread over it (the rest holes), exported read-only by
`kiln nbd` over a Unix socket. `nbdcopy` copies it to a file in /dev/shm two ways, in an
order that alternates from one repetition to the next:

  extents      nbdcopy as it is: asks the export for block status (base:allocation) and
               reads only the data
  no_extents   nbdcopy --no-extents: reads every byte, holes included (the baseline, and
               what any copy cost before the export had block status)

Every copy is checked against the brick's file (`cmp`). The export logs what each client
read; the report gives, per way, the medians of the copy time and of the MiB read through
the export, and the ratios

  read_vs_data          MiB read with block status / MiB of data   (target <= 1.1)
  time_no_extents_vs    copy time without / with block status

A table goes to stderr, one JSON object to stdout (and --out FILE). Needs nbdcopy
(apt-get install libnbd-bin when missing).

Usage: bench/sparse.py [--reps N] [--size-mib N] [--data-mib N] [--no-build] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402  (log, repo_root, BenchError, ensure_packages, emit)

WAYS = ["extents", "no_extents"]
PIECES = 16
READ = re.compile(r" read \d+ req ([\d.]+) MiB")
ATTACHED = re.compile(r"client attached to")
LEFT = re.compile(r"client (disconnected|closed the connection|dropped)")


def summaries(log: Path, seen: int) -> str:
    """What the export logged after offset `seen`, once every client that attached since has
    left (each logs its summary as it goes)."""
    deadline = time.monotonic() + 10
    while True:
        text = log.read_text()[seen:]
        if len(LEFT.findall(text)) >= len(ATTACHED.findall(text)) > 0:
            return text
        if time.monotonic() > deadline:
            raise c.BenchError(f"the export did not log every client leaving: {c.tail(text)}")
        time.sleep(0.01)


def start(cmd: list[str], log: Path, ready: str) -> subprocess.Popen:
    """Starts `cmd` with its output in `log`; waits for a line containing `ready`."""
    f = open(log, "w")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while ready not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise c.BenchError(f"{cmd[1]} did not start: {c.tail(log.read_text())}")
        time.sleep(0.02)
    return p


def make_image(path: Path, size: int, data: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        piece = data // PIECES
        for i in range(PIECES):
            f.seek(i * (size // PIECES))
            f.write(os.urandom(piece))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--data-mib", type=int, default=16)
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    c.ensure_packages({"nbdcopy": "libnbd-bin"})
    kiln = c.release_kiln(args.no_build)
    work = Path(tempfile.mkdtemp(prefix="kiln-sparse-bench-", dir="/dev/shm"))
    brick, sock, nbd = work / "brick", work / "brick.sock", work / "nbd.sock"
    brick.mkdir()
    image, out = brick / "disk.raw", work / "out.raw"
    make_image(image, args.size_mib << 20, args.data_mib << 20)
    procs: list[subprocess.Popen] = []
    runs: list[dict] = []
    try:
        procs.append(start([str(kiln), "server", "--brick", str(brick), "--listen",
                            f"unix:{sock}", "--metrics", "off"], work / "server.log",
                           "listening"))
        nbd_log = work / "nbd.log"
        procs.append(start([str(kiln), "nbd", f"unix:{sock}:/v/disk.raw", "--listen",
                            f"unix:{nbd}", "--read-only"], nbd_log, "exporting"))
        uri = f"nbd+unix:///disk.raw?socket={nbd}"
        for rep in range(args.reps):
            for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                out.unlink(missing_ok=True)
                seen = len(nbd_log.read_text())
                flags = ["--no-extents"] if way == "no_extents" else []
                t0 = time.monotonic()
                subprocess.run(["nbdcopy", *flags, uri, str(out)], check=True)
                secs = time.monotonic() - t0
                subprocess.run(["cmp", str(image), str(out)], check=True)
                mib = sum(float(m) for m in READ.findall(summaries(nbd_log, seen)))
                runs.append({"rep": rep, "way": way, "s": secs, "read_mib": mib})
                c.log(f"rep {rep} {way:10} {secs:7.3f} s  read {mib:8.1f} MiB")
    finally:
        for p in procs[::-1]:
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)

    def med(way: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["way"] == way)

    medians = {w: {"s": med(w, "s"), "read_mib": med(w, "read_mib")} for w in WAYS}
    ratios = [
        ("read_vs_data", medians["extents"]["read_mib"] / args.data_mib, "<=", 1.1),
        ("time_no_extents_vs", medians["no_extents"]["s"] / medians["extents"]["s"], "", None),
    ]
    print(f"\nmedians of {args.reps} reps; {args.size_mib} MiB image, {args.data_mib} MiB data",
          file=sys.stderr)
    for w, m in medians.items():
        print(f"{w:10} {m['s']:8.3f} s  read {m['read_mib']:8.1f} MiB", file=sys.stderr)
    out_ratios = []
    for name, v, op, target in ratios:
        ok = target is None or v <= target
        status = "info" if target is None else ("PASS" if ok else "FAIL")
        print(f"{name:20} {v:8.3f} {op} {target if target else '':4} {status}", file=sys.stderr)
        out_ratios.append({"name": name, "value": v, "op": op, "target": target,
                           "status": status})
    result = {"reps": args.reps, "size_mib": args.size_mib, "data_mib": args.data_mib,
              "medians": medians, "ratios": out_ratios, "runs": runs}
    return c.emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
