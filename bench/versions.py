#!/usr/bin/env python3
"""Two builds of kiln, side by side on the same jobs: is the data path slower (or faster)?

Runs `kiln bench` (which starts its own brick servers from the same binary) for five jobs —
4k random read at iodepth 1 (p50 latency), 4k random read at iodepth 32 (IOPS), 128k
sequential read at iodepth 32 (MB/s), and over a replica-3 volume 4k random write at iodepth
1 (p50 latency) and 128k sequential write at iodepth 32 (MB/s) — with the OLD and the NEW binary, alternating which goes
first each repetition, and prints one JSON object per run and a summary last: the medians of
each side and NEW/OLD ratios (for latency, OLD/NEW, so above 1 is better either way).

Build the old one apart, e.g.:
    git worktree add /tmp/kiln-old REV
    (cd /tmp/kiln-old && CARGO_TARGET_DIR=/tmp/kiln-old-target cargo build --release --bin kiln)
    cargo build --release --bin kiln
    python3 bench/versions.py --old /tmp/kiln-old-target/release/kiln [--reps 5] [--runtime 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOBS = [
    # name, bench arguments, what to take from the JSON, higher is better
    ("randread 4k qd1 p50 us", ["--rw", "randread", "--bs", "4k", "--iodepth", "1"],
     lambda r: r["lat_us"]["p50"], False),
    ("randread 4k qd32 IOPS", ["--rw", "randread", "--bs", "4k", "--iodepth", "32"],
     lambda r: r["iops"], True),
    ("read 128k qd32 MB/s", ["--rw", "read", "--bs", "128k", "--iodepth", "32"],
     lambda r: r["mb_s"], True),
    # The replicated write path: three bricks with the replica stack, every write to all.
    ("replica-3 randwrite 4k qd1 p50 us",
     ["--replica", "3", "--rw", "randwrite", "--bs", "4k", "--iodepth", "1"],
     lambda r: r["lat_us"]["p50"], False),
    ("replica-3 write 128k qd32 MB/s",
     ["--replica", "3", "--rw", "write", "--bs", "128k", "--iodepth", "32"],
     lambda r: r["mb_s"], True),
]


def run(kiln, args, runtime):
    cmd = [kiln, "bench", *args, "--size", "256m", "--runtime", str(runtime), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the baseline kiln binary")
    ap.add_argument("--new", default=os.path.join(ROOT, "target", "release", "kiln"),
                    help="the kiln binary under test (default: this tree's release build)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runtime", type=float, default=5.0)
    a = ap.parse_args()
    for p in (a.old, a.new):
        if not os.access(p, os.X_OK):
            sys.exit(f"{p} is not an executable kiln: build it first (see --help)")
    got = {(j[0], side): [] for j in JOBS for side in ("old", "new")}
    for rep in range(a.reps):
        order = [("old", a.old), ("new", a.new)]
        if rep % 2:
            order.reverse()
        for name, args, take, _ in JOBS:
            for side, kiln in order:
                r = run(kiln, args, a.runtime)
                v = take(r)
                got[(name, side)].append(v)
                print(json.dumps({"rep": rep, "job": name, "side": side, "value": v,
                                  "cpu_s": r.get("cpu_s")}), flush=True)
    summary = {}
    for name, _, _, higher in JOBS:
        old = statistics.median(got[(name, "old")])
        new = statistics.median(got[(name, "new")])
        ratio = new / old if higher else old / new
        summary[name] = {"old": round(old, 2), "new": round(new, 2), "better_ratio": round(ratio, 3)}
    print(json.dumps({"summary": summary, "reps": a.reps, "runtime_s": a.runtime,
                      "old": a.old, "new": a.new}))


if __name__ == "__main__":
    main()
