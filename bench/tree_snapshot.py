#!/usr/bin/env python3
"""A directory tree's snapshot on XFS bricks, against a local reflink copy of the same tree.

Setup (needs root): an XFS file system with reflink on a loop device under --dir (made and
removed here), a managed kilnd (release build) with a replica-3 volume whose bricks live on
it, and a tree copied into the mount (`cp -a` of --tree, default /usr/include: some thousands
of files). Per repetition (--reps, default 3), in an order that alternates:

  kiln      `kiln image snapshot VOL/tree NAME --json` (every file copied at one instant on
            three replicas, then moved into the snapshot's tree): the command's wall time,
            and how long writers would have been held at the barriers; then `kiln image rm`
  local     `cp -a --reflink=always` of one brick's copy of the tree to a new directory on
            the same XFS: what one host pays to reflink the same files (one replica, no
            barrier), then `rm -rf`

and once a clone of a snapshot (`kiln image clone`): its wall time and the bytes it took
(statvfs). The report gives medians and kiln over local. A table goes to stderr, one JSON
object to stdout.

Usage: bench/tree_snapshot.py [--reps 3] [--tree /usr/include] [--no-build]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402
from kcluster import KILN, Cluster, build, xfs_loop  # noqa: E402

PORT = 24870


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tree", default="/usr/include")
    ap.add_argument("--dir", default="/var/tmp/kiln-tree-snapshot-bench")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    c.ensure_packages({"mkfs.xfs": "xfsprogs"})
    build(a.no_build)
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        with xfs_loop(base, 8 << 30) as xfs:
            cl = Cluster(xfs, PORT, "trees", 3, replica=3)
            try:
                return run(a, cl, xfs)
            finally:
                cl.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(a: argparse.Namespace, cl: Cluster, xfs: Path) -> int:
    subprocess.run(["cp", "-a", a.tree, cl.mnt / "tree"], check=True)
    files = sum(len(f) for _, _, f in os.walk(cl.mnt / "tree"))
    src = f"127.0.0.1:{PORT}:/trees/tree"
    runs: dict[str, list[dict]] = {"kiln": [], "local": []}
    for rep in range(a.reps):
        for way in ("kiln", "local") if rep % 2 == 0 else ("local", "kiln"):
            t0 = time.monotonic()
            if way == "kiln":
                out = subprocess.run([KILN, "image", "snapshot", src, f"r{rep}", "--json"],
                                     env=cl.env, check=True, capture_output=True,
                                     text=True).stdout
                wall = (time.monotonic() - t0) * 1e3
                r = json.loads(out)
                runs[way].append({"ms": wall, "held_ms": r["writes_held_ms"],
                                  "files": r["files"], "steps_ms": r["steps_ms"]})
                subprocess.run([KILN, "image", "rm", f"{src}@r{rep}"], env=cl.env, check=True,
                               capture_output=True)
            else:
                subprocess.run(["cp", "-a", "--reflink=always", xfs / "b0" / "tree",
                                xfs / "local"], check=True)
                runs[way].append({"ms": (time.monotonic() - t0) * 1e3})
                shutil.rmtree(xfs / "local")
        c.log(f"rep {rep}: kiln {runs['kiln'][-1]}  local {runs['local'][-1]}")
    subprocess.run([KILN, "image", "snapshot", src, "last"], env=cl.env, check=True,
                   capture_output=True)
    before = free(xfs)
    t0 = time.monotonic()
    subprocess.run([KILN, "image", "clone", f"{src}@last", "clone"], env=cl.env, check=True,
                   capture_output=True)
    clone_ms = (time.monotonic() - t0) * 1e3
    clone_bytes = max(0, before - free(xfs))
    med = lambda w, k: statistics.median(r[k] for r in runs[w])  # noqa: E731
    result = {
        "bench": "tree_snapshot",
        "tree": a.tree,
        "files": files,
        "snapshot_ms": med("kiln", "ms"),
        "writes_held_ms": med("kiln", "held_ms"),
        "local_reflink_copy_ms": med("local", "ms"),
        "kiln_vs_local": med("kiln", "ms") / med("local", "ms"),
        "clone_ms": clone_ms,
        "clone_bytes_three_replicas": clone_bytes,
        "reps": a.reps,
        "runs": runs,
    }
    c.log(f"tree of {files} files: snapshot {result['snapshot_ms']:.0f} ms (writes held "
          f"{result['writes_held_ms']:.0f} ms) on 3 replicas, local cp --reflink "
          f"{result['local_reflink_copy_ms']:.0f} ms on one; clone {clone_ms:.0f} ms, "
          f"{clone_bytes} B")
    return c.emit(result, a.out)


if __name__ == "__main__":
    sys.exit(main())
