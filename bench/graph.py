#!/usr/bin/env python3
"""What following a volume's graph costs the data path, measured in one run.

A mount, export or library client of a managed volume has the graph switch on top of its
stack (crates/client/src/graph.rs): every fop looks up the current graph, and every fop on an
open file checks which graph its handle is on. This runs `kiln bench` with and without
`--switch`, alternating which goes first each repetition: 4k random reads at iodepth 1 (p50)
and at iodepth 32 (IOPS), and 4k random writes at iodepth 1 (p50). Above 1 is better for the
switch.

Prints one JSON object per run; the last line is the summary. Usage:
    cargo build --release && python3 bench/graph.py [--reps 5] [--runtime 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILN = os.path.join(ROOT, "target", "release", "kiln")

JOBS = [
    ("randread_qd1", ["--rw", "randread", "--iodepth", "1"], "p50"),
    ("randread_qd32", ["--rw", "randread", "--iodepth", "32"], "iops"),
    ("randwrite_qd1", ["--rw", "randwrite", "--iodepth", "1"], "p50"),
]


def bench(runtime, args, switch):
    cmd = [KILN, "bench", "--bs", "4k", "--size", "256m", "--runtime", str(runtime), "--json",
           *args] + (["--switch"] if switch else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    return {"iops": r["iops"], "p50": r["lat_us"]["p50"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runtime", type=float, default=4.0)
    a = ap.parse_args()
    if not os.path.exists(KILN):
        sys.exit(f"{KILN} is missing: run cargo build --release first")
    got = {(j, s): [] for j, _, _ in JOBS for s in (False, True)}
    for rep in range(a.reps):
        for job, args, metric in JOBS:
            order = (False, True) if rep % 2 == 0 else (True, False)
            for switch in order:
                r = bench(a.runtime, args, switch)
                got[(job, switch)].append(r[metric])
                print(json.dumps({"rep": rep, "job": job, "switch": switch, metric: r[metric]}),
                      flush=True)
    med = statistics.median
    summary = {"summary": True, "reps": a.reps, "runtime_s": a.runtime}
    for job, _, metric in JOBS:
        plain, sw = med(got[(job, False)]), med(got[(job, True)])
        # p50: lower is better; IOPS: higher is better. Ratios are better-is-above-1.
        ratio = plain / sw if metric == "p50" else sw / plain
        summary[job] = {"metric": metric, "plain": plain, "switch": sw, "ratio": round(ratio, 3)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
