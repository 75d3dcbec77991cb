#!/usr/bin/env python3
"""The stat path of the FUSE mount, two builds side by side: is a GETATTR slower (or faster)?

For each build (OLD and NEW, alternating which goes first each repetition): a fresh
`kiln server` on a brick in /dev/shm, `kiln mount --mode general --attr-timeout 0` (so every
stat reaches the mount as a GETATTR, answered by a lookup on the brick), 1,000 files, then
--stats `os.stat` calls round-robin over them, timed. Reports the median microseconds per stat
of each build over --reps repetitions and OLD/NEW (above 1: NEW is faster), one JSON object
per run and a summary last.

Build the old one apart, e.g.:
    git worktree add /tmp/kiln-old REV
    (cd /tmp/kiln-old && CARGO_TARGET_DIR=/tmp/kiln-old-target cargo build --release --bin kiln)
    cargo build --release --bin kiln
    python3 bench/getattr.py --old /tmp/kiln-old-target/release/kiln [--reps 5]
Needs root (FUSE mounts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuse_compare import stop_process, unmount, wait_for_line  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def one_run(kiln: str, stats: int) -> float:
    """Microseconds per stat through a fresh server and mount of `kiln`."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, \
            tempfile.TemporaryDirectory() as tmp:
        brick, mnt, tmpd = Path(shm) / "brick", Path(tmp) / "mnt", Path(tmp)
        brick.mkdir()
        mnt.mkdir()
        sock = tmpd / "kilnd.sock"
        server = mount = None
        try:
            with open(tmpd / "server.log", "w") as f:
                server = subprocess.Popen(
                    [kiln, "server", "--brick", str(brick), "--listen", f"unix:{sock}"],
                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True)
            wait_for_line(server, tmpd / "server.log", r"kilnd: listening on unix:", "server")
            with open(tmpd / "mount.log", "w") as f:
                mount = subprocess.Popen(
                    [kiln, "mount", f"unix:{sock}:/vol", str(mnt), "--mode", "general",
                     "--attr-timeout", "0", "--metrics", "off"],
                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True)
            wait_for_line(mount, tmpd / "mount.log", r"kiln: mounted", "mount")
            names = [mnt / f"f{i}" for i in range(1000)]
            for p in names:
                p.write_bytes(b"x")
            for p in names:  # warm: every name known to the mount
                os.stat(p)
            t0 = time.perf_counter()
            for i in range(stats):
                os.stat(names[i % 1000])
            return (time.perf_counter() - t0) / stats * 1e6
        finally:
            stop_process(mount, "mount")
            unmount(mnt, "the mount")
            stop_process(server, "server")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the old kiln binary")
    ap.add_argument("--new", default=str(ROOT / "target/release/kiln"), help="the new one")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stats", type=int, default=50_000, help="stat calls per run")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("getattr.py needs root (FUSE mounts)", file=sys.stderr)
        return 2
    seen: dict[str, list[float]] = {"old": [], "new": []}
    for rep in range(a.reps):
        order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
        for side in order:
            us = one_run(getattr(a, side), a.stats)
            seen[side].append(us)
            print(json.dumps({"rep": rep, "build": side, "us_per_stat": round(us, 2)}),
                  flush=True)
    old, new = statistics.median(seen["old"]), statistics.median(seen["new"])
    print(json.dumps({"summary": {"old_us_per_stat": round(old, 2),
                                  "new_us_per_stat": round(new, 2),
                                  "old_over_new": round(old / new, 3),
                                  "reps": a.reps, "stats": a.stats}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
