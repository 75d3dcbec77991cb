#!/usr/bin/env python3
"""What the layer stack and its observability cost, measured in one run.

1. 4k random reads at iodepth 1 with no io-stats at all (--bare), the default stacks (one
   io-stats point in the client, one in the brick) and io-stats at six points
   (--profile-points), alternating, several reps: median IOPS of each and the ratios to bare
   (target: the six points within 5%).
2. The same load with every 10th request traced: the waterfall's stage medians summed against
   the end-to-end median of the traced requests and against the bench's own p50 (target: 5%).

Prints one JSON object per line; the last is the summary. Usage:
    cargo build --release && python3 bench/layers.py [--reps 5] [--runtime 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILN = os.path.join(ROOT, "target", "release", "kiln")


def bench(runtime, *extra):
    cmd = [KILN, "bench", "--rw", "randread", "--bs", "4k", "--iodepth", "1", "--size", "256m",
           "--runtime", str(runtime), "--json", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runtime", type=float, default=5.0)
    a = ap.parse_args()
    if not os.path.exists(KILN):
        sys.exit(f"{KILN} is missing: run cargo build --release first")
    bare, plain, points = [], [], []
    for rep in range(a.reps):
        for name, extra, acc in (("bare", ["--bare"], bare), ("default", [], plain),
                                 ("six-points", ["--profile-points"], points)):
            r = bench(a.runtime, *extra)
            acc.append(r["iops"])
            print(json.dumps({"rep": rep, "stack": name, "iops": round(r["iops"]),
                              "p50_us": r["lat_us"]["p50"]}), flush=True)
    traced = []
    for rep in range(a.reps):
        r = bench(a.runtime, "--profile-points", "--trace-every", "10")
        w = r["waterfall"]
        traced.append((w["sum_p50_us"], w["end_to_end_p50_us"], r["lat_us"]["p50"]))
        print(json.dumps({"rep": rep, "traced": True, "sum_stage_p50_us": w["sum_p50_us"],
                          "traced_end_to_end_p50_us": w["end_to_end_p50_us"],
                          "bench_p50_us": r["lat_us"]["p50"], "samples": w["samples"]}), flush=True)
    med = statistics.median
    summary = {
        "summary": True,
        "iops_bare_median": round(med(bare)),
        "iops_default_median": round(med(plain)),
        "iops_six_points_median": round(med(points)),
        "default_vs_bare": round(med(plain) / med(bare), 4),
        "six_points_vs_bare": round(med(points) / med(bare), 4),
        "stage_sum_vs_traced_e2e_median": round(med([s / e for s, e, _ in traced]), 4),
        "stage_sum_vs_bench_p50_median": round(med([s / b for s, _, b in traced]), 4),
        "reps": a.reps,
        "runtime_s": a.runtime,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
