#!/usr/bin/env python3
"""Snapshots of a VM image on XFS bricks while fio writes to it, against the same fio alone.

Setup (needs root): an XFS file system with reflink on a loop device over a sparse file under
--dir (made and removed here), a managed kilnd (release build) with a replica-3 volume whose
bricks live on it, an image of --size-gib GiB filled through the mount, and `kiln nbd` on it.
fio (nbd engine, random 4 KiB writes, 16 in flight, time-based) runs against the export; per
repetition (--reps, default 3), in an order that alternates, with the bricks' flush-behind
on (`kiln volume set snap flush-behind 8M`) and off (0, the default), each run from an image
written whole and at rest (written back to disk), so that every run starts from an image in
few extents (random writes after a snapshot leave it in tens of thousands, and a reflink's
time grows with them). The loop device does direct I/O to its backing file, so
the XFS file system's write-back reaches the disk as on a real device:

  snapshot  `kiln image snapshot` while fio runs: the times it reports (in all, with the
            flush before the barrier; and how long writes were held at the barrier), the
            command's wall time, and fio's IOPS and write completion-latency p99; then, once
            fio is done, the three replicas' copies of the snapshot are compared byte for byte
            (`cmp`) until they agree (heal makes alike what the snapshot marked): how many
            comparisons and seconds (comparisons included) that took, or the bench fails
  quiet     fio alone for the same time: its IOPS and p99

Each snapshot is removed after its run (while it shares the image's blocks, every write to
the image copies a block first, and runs after it would pay for that). Once at the end, a
snapshot of the image at rest and a clone of it: bytes of the file system it took (statvfs,
three replicas). The report gives the medians, the snapshot time without flush-behind over
the time with it, and fio's IOPS with flush-behind over without (what it costs writers). A
table goes to stderr, one JSON object to stdout.

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
from kcluster import KILN, Cluster, build, xfs_loop  # noqa: E402

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


def agree(copies: list[Path], limit: float = 120.0) -> tuple[int, float]:
    """How many byte-for-byte comparisons (`cmp` of the first copy with the others, reading
    all of each) it took until the snapshot's copies on the three replicas were the same
    (heal makes alike what the snapshot marked), and the seconds from the end of the fio run
    until then, comparisons included; fails the bench if they still differ after `limit` s."""
    t0 = time.monotonic()
    passes = 0
    while True:
        passes += 1
        same = all(subprocess.run(["cmp", "-s", copies[0], c]).returncode == 0
                   for c in copies[1:])
        if same:
            return passes, time.monotonic() - t0
        if time.monotonic() - t0 > limit:
            raise SystemExit(f"the snapshot's copies still differ after {limit:.0f} s: {copies}")
        time.sleep(0.5)  # heal's next pass: a poll, not a sync point


def extents(path: Path) -> int:
    """How many extents the file has (FIEMAP, by filefrag): what a reflink walks."""
    out = subprocess.run(["filefrag", path], check=True, capture_output=True, text=True).stdout
    return int(out.rsplit(": ", 1)[1].split()[0])


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
    cl = None
    export = None
    try:
        with xfs_loop(base, (3 * a.size_gib + 4) << 30) as xfs:
            try:
                cl = Cluster(xfs, PORT, "snap", 3, replica=3)
                image = f"127.0.0.1:{PORT}:/snap/disk.img"
                block = os.urandom(1 << 20)

                def fresh_image() -> str:
                    """A new image, written whole through the mount and then at rest (written back
                    to the bricks' disk, as one a VM has run on for a while), exported by a new `kiln
                    nbd`; its URI. Every run gets one: random writes after a snapshot leave the
                    image in tens of thousands of extents, and a reflink's time grows with them."""
                    nonlocal export
                    if export:
                        export.send_signal(signal.SIGTERM)
                        export.wait()
                    (cl.mnt / "disk.img").unlink(missing_ok=True)
                    with open(cl.mnt / "disk.img", "wb") as f:
                        for _ in range(a.size_gib << 10):
                            f.write(block)
                    subprocess.run(["sync"], check=True)
                    export = subprocess.Popen(
                        [KILN, "nbd", image, "--listen", f"unix:{base / 'e.sock'}"],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=cl.env)
                    return export.stdout.readline().rsplit(" at ", 1)[1].strip()

                # Per repetition, in alternating order, with the bricks' flush-behind on (8M) and off
                # (the default): fio with a snapshot taken mid-run, and fio alone, each on a fresh
                # image.
                ways = [(fb, kind) for fb in ("on", "off") for kind in ("snapshot", "quiet")]
                runs: dict[str, list[dict]] = {f"{fb} {kind}": [] for fb, kind in ways}
                for rep in range(a.reps):
                    for fb, kind in (ways if rep % 2 == 0 else ways[::-1]):
                        cl.cli("volume", "set", "snap", "flush-behind", "8M" if fb == "on" else "0")
                        uri = fresh_image()
                        if kind == "quiet":
                            runs[f"{fb} quiet"].append(fio(uri, a.runtime))
                            continue
                        got: dict = {}
                        t = threading.Thread(target=lambda: got.update(fio(uri, a.runtime)))
                        t.start()
                        time.sleep(a.runtime / 2)  # mid-run: the bench's schedule, not a sync point
                        got["extents"] = extents(xfs / "b0" / "disk.img")
                        name = f"s{rep}{fb}"
                        t0 = time.monotonic()
                        out = subprocess.run([KILN, "image", "snapshot", image, name], env=cl.env,
                                             check=True, capture_output=True, text=True).stdout
                        got["command_ms"] = (time.monotonic() - t0) * 1e3
                        t.join()
                        got["compare_passes"], got["copies_agree_after_s"] = agree(
                            [xfs / f"b{i}" / f".disk.img@{name}" for i in range(3)])
                        got["snapshot_ms"] = float(out.split(" taken in ")[1].split(" ms")[0])
                        got["held_ms"] = float(out.split("writes held ")[1].split(" ms")[0])
                        got["made_alike_bytes"] = int(out.split("makes ")[1].split(" ")[0]) \
                            if "makes " in out else 0
                        runs[f"{fb} snapshot"].append(got)
                        # Gone before the next run: while a snapshot shares the image's blocks, every
                        # write to the image copies its block first (and its write-back costs more).
                        subprocess.run([KILN, "image", "rm", f"{image}@{name}"], env=cl.env,
                                       check=True, capture_output=True)
                    c.log(f"rep {rep}: " + "  ".join(f"{w}: {runs[w][-1]}" for w in runs))
                subprocess.run([KILN, "image", "snapshot", image, "last"], env=cl.env, check=True,
                               capture_output=True)
                before = free(xfs)
                subprocess.run([KILN, "image", "clone", f"{image}@last", "clone.img"],
                               env=cl.env, check=True, capture_output=True)
                clone_bytes = max(0, before - free(xfs))
                med = lambda w, k: statistics.median(r[k] for r in runs[w])  # noqa: E731
                result = {
                    "bench": "snapshot",
                    "size_gib": a.size_gib,
                    "snapshot_ms": {fb: med(f"{fb} snapshot", "snapshot_ms") for fb in ("on", "off")},
                    "command_ms": {fb: med(f"{fb} snapshot", "command_ms") for fb in ("on", "off")},
                    "writes_held_ms": {fb: med(f"{fb} snapshot", "held_ms") for fb in ("on", "off")},
                    "fio_p99_us": {w: med(w, "p99_us") for w in runs},
                    "fio_iops": {w: med(w, "iops") for w in runs},
                    "snapshot_off_vs_on": med("off snapshot", "snapshot_ms")
                    / med("on snapshot", "snapshot_ms"),
                    "quiet_iops_on_vs_off": med("on quiet", "iops") / med("off quiet", "iops"),
                    "clone_bytes_three_replicas": clone_bytes,
                    "clone_vs_image": clone_bytes / (a.size_gib << 30),
                    "reps": a.reps,
                    "runs": runs,
                }
                c.log(f"snapshot of {a.size_gib} GiB under fio, medians: flush-behind on "
                      f"{result['snapshot_ms']['on']:.1f} ms (writes held "
                      f"{result['writes_held_ms']['on']:.1f} ms), off {result['snapshot_ms']['off']:.1f} ms; "
                      f"fio alone {result['fio_iops']['on quiet']:.0f} IOPS on, "
                      f"{result['fio_iops']['off quiet']:.0f} off; clone took {clone_bytes} B")
                return c.emit(result, a.out)
            finally:
                if export:
                    export.send_signal(signal.SIGTERM)
                    export.wait()
                if cl:
                    cl.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
