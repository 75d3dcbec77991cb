#!/usr/bin/env python3
"""Snapshots of a VM image on XFS bricks while fio writes to it, against the same fio alone.

Setup (needs root): an XFS file system with reflink on a loop device over a sparse file under
--dir (made and removed here), a managed kilnd (release build) with a replica-3 volume whose
bricks live on it, an image of --size-gib GiB filled through the mount, and `kiln nbd` on it.
fio (nbd engine, random 4 KiB writes, 16 in flight, time-based) runs against the export; per
repetition (--reps, default 3), in an order that alternates:

  snapshot  `kiln image snapshot` while fio runs: the times it reports (in all, with the
            flush before the barrier; and how long writes were held at the barrier), and
            fio's write completion-latency p99 over the run
  quiet     fio alone for the same time: its p99

and once at the end a clone of the last snapshot: bytes of the file system it took (statvfs,
three replicas). The report gives the medians and the ratio of fio's p99 with a snapshot
taken during the run to without. A table goes to stderr, one JSON object to stdout.

Usage: bench/snapshot.py [--reps 3] [--size-gib 4] [--runtime 4] [--no-build]
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402
from kcluster import KILN, Cluster, build  # noqa: E402

PORT = 24850


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fio(uri: str, runtime: int) -> dict:
    out = subprocess.run(
        ["fio", "--name=w", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite", "--bs=4k",
         "--iodepth=16", "--size=1g", "--time_based", f"--runtime={runtime}",
         "--output-format=json"], check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["write"]
    return {"iops": job["iops"], "p99_us": job["clat_ns"]["percentile"]["99.000000"] / 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-gib", type=int, default=4)
    ap.add_argument("--runtime", type=int, default=4)
    ap.add_argument("--dir", default="/var/tmp/kiln-snapshot-bench")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    c.ensure_packages({"mkfs.xfs": "xfsprogs", "fio": "fio", "qemu-io": "qemu-utils"})
    build(a.no_build)
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    backing = base / "xfs.img"
    with open(backing, "wb") as f:
        f.truncate((3 * a.size_gib + 4) << 30)
    dev = subprocess.run(["losetup", "-f", "--show", backing], check=True,
                         capture_output=True, text=True).stdout.strip()
    xfs = base / "xfs"
    xfs.mkdir()
    cl = export = None
    try:
        subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", dev], check=True)
        subprocess.run(["mount", dev, xfs], check=True)
        cl = Cluster(xfs, PORT, "snap", 3, replica=3)
        block = os.urandom(1 << 20)
        with open(cl.mnt / "disk.img", "wb") as f:
            for _ in range(a.size_gib << 10):
                f.write(block)
        # An image at rest: written back to the bricks' disk, as one a VM has run on for a while.
        subprocess.run(["sync", "-f", xfs / "b0"], check=True)
        image = f"127.0.0.1:{PORT}:/snap/disk.img"
        export = subprocess.Popen(
            [KILN, "nbd", image, "--listen", f"unix:{base / 'e.sock'}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=cl.env)
        uri = export.stdout.readline().rsplit(" at ", 1)[1].strip()
        runs: dict[str, list[dict]] = {"snapshot": [], "quiet": []}
        for rep in range(a.reps):
            order = ["snapshot", "quiet"] if rep % 2 == 0 else ["quiet", "snapshot"]
            for way in order:
                if way == "quiet":
                    runs["quiet"].append(fio(uri, a.runtime))
                    continue
                got: dict = {}
                t = threading.Thread(target=lambda: got.update(fio(uri, a.runtime)))
                t.start()
                time.sleep(a.runtime / 2)  # mid-run: the bench's schedule, not a sync point
                out = subprocess.run([KILN, "image", "snapshot", image, f"s{rep}"], env=cl.env,
                                     check=True, capture_output=True, text=True).stdout
                t.join()
                got["snapshot_ms"] = float(out.split(" taken in ")[1].split(" ms")[0])
                got["held_ms"] = float(out.split("writes held ")[1].split(" ms")[0])
                got["made_alike_bytes"] = int(out.split("makes ")[1].split(" ")[0]) \
                    if "makes " in out else 0
                runs["snapshot"].append(got)
            c.log(f"rep {rep}: snapshot {runs['snapshot'][-1]}  quiet {runs['quiet'][-1]}")
        before = free(xfs)
        subprocess.run([KILN, "image", "clone", f"{image}@s{a.reps - 1}", "clone.img"],
                       env=cl.env, check=True, capture_output=True)
        clone_bytes = max(0, before - free(xfs))
        med = lambda w, k: statistics.median(r[k] for r in runs[w])  # noqa: E731
        result = {
            "bench": "snapshot",
            "size_gib": a.size_gib,
            "snapshot_ms": med("snapshot", "snapshot_ms"),
            "writes_held_ms": med("snapshot", "held_ms"),
            "p99_us": {w: med(w, "p99_us") for w in runs},
            "iops": {w: med(w, "iops") for w in runs},
            "p99_with_snapshot_vs_quiet": med("snapshot", "p99_us") / med("quiet", "p99_us"),
            "clone_bytes_three_replicas": clone_bytes,
            "clone_vs_image": clone_bytes / (a.size_gib << 30),
            "reps": a.reps,
            "runs": runs,
        }
        c.log(f"snapshot of {a.size_gib} GiB under fio: {result['snapshot_ms']:.1f} ms "
              f"(median; writes held {result['writes_held_ms']:.1f} ms); fio p99 {result['p99_us']['snapshot']:.0f} us with a snapshot, "
              f"{result['p99_us']['quiet']:.0f} us without; clone took {clone_bytes} B")
        return c.emit(result, a.out)
    finally:
        if export:
            export.send_signal(signal.SIGTERM)
            export.wait()
        if cl:
            cl.close()
        subprocess.run(["umount", "-l", xfs])
        subprocess.run(["losetup", "-d", dev])
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
