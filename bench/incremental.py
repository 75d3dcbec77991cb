#!/usr/bin/env python3
"""An incremental backup of a VM image through `kiln nbd --bitmap`, against a full copy.

Setup: a managed kilnd (release build), a replica-3 volume whose bricks are directories under
--dir, mounted; an image of --size-mib MiB of random data written through the mount, and a
full backup of it. Per repetition (--reps, default 3), a dirty record is started (`kiln image
dirty start`), --changed-mib MiB are written through the export at 16 random places
(qemu-io), and the backup is brought up to date two ways, in an order that alternates:

  incremental  a libnbd client asks the export for block status of qemu:dirty-bitmap:NAME and
               copies only the dirty ranges into the previous backup
  full         nbdcopy of the whole image (the baseline: what a backup costs without records)

Each backup is checked against the image (cmp). The export logs what each client read; the
report gives the medians of the time and of the MiB read through the export, and the ratios

  read_vs_changed     MiB the incremental backup read / MiB changed   (target <= 1.1)
  time_full_vs_incr   full copy time / incremental copy time

A table goes to stderr, one JSON object to stdout (and --out FILE). Needs nbdcopy, qemu-io and
libnbd's Python module (installed with apt-get when missing).

Usage: bench/incremental.py [--reps 3] [--size-mib 1024] [--changed-mib 10] [--no-build]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402
from kcluster import KILN, Cluster, build  # noqa: E402
from sparse import READ, summaries  # noqa: E402

PORT = 24870
PIECES = 16
MIB = 1 << 20


def libnbd():
    try:
        import nbd  # noqa: PLC0415
    except ImportError:
        c.ensure_packages({"nbdsh": "python3-libnbd"})
        sys.path.append("/usr/lib/python3/dist-packages")
        import nbd  # noqa: PLC0415
    return nbd


def incremental(nbd, uri: str, bitmap: str, backup: Path) -> int:
    """Copies the dirty ranges of the export at `uri` into `backup`; returns bytes copied."""
    h = nbd.NBD()
    context = f"qemu:dirty-bitmap:{bitmap}"
    h.add_meta_context(context)
    h.connect_uri(uri)
    size = h.get_size()
    ranges: list[tuple[int, int]] = []
    at = 0
    while at < size:
        end = [at]

        def seen(ctx, offset, entries, err, end=end):
            if ctx == context:
                pos = offset
                for i in range(0, len(entries), 2):
                    if entries[i + 1] & 1:
                        ranges.append((pos, entries[i]))
                    pos += entries[i]
                end[0] = pos
            return 0

        h.block_status(min(size - at, 1 << 31), at, seen)
        if end[0] <= at:
            raise c.BenchError(f"block status at {at} made no progress")
        at = end[0]
    copied = 0
    with open(backup, "r+b") as f:
        for o, n in ranges:
            f.seek(o)
            f.write(h.pread(n, o))
            copied += n
    h.shutdown()
    return copied


def export_read_mib(log: Path, seen: int) -> float:
    """MiB the export's clients read since offset `seen` of its log, once they all left."""
    return sum(float(x) for x in READ.findall(summaries(log, seen)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--changed-mib", type=int, default=10)
    ap.add_argument("--dir", default="/var/tmp/kiln-incremental-bench")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    nbd = libnbd()
    c.ensure_packages({"nbdcopy": "libnbd-bin", "qemu-io": "qemu-utils"})
    build(a.no_build)
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    cl = Cluster(base, PORT, "inc", 3, replica=3)
    export = None
    try:
        block = os.urandom(MIB)
        with open(cl.mnt / "disk.img", "wb") as f:
            for _ in range(a.size_mib):
                f.write(block)
        image = f"127.0.0.1:{PORT}:/inc/disk.img"
        sock = base / "e.sock"
        elog = base / "export.log"
        export = subprocess.Popen(
            [KILN, "nbd", image, "--listen", f"unix:{sock}", "--bitmap", "daily"],
            stdout=subprocess.PIPE, stderr=open(elog, "w"), text=True,
            env=dict(cl.env, KILN_LOG="info"))
        line = export.stdout.readline()
        uri = line.rsplit(" at ", 1)[1].strip()
        backup = base / "backup.raw"
        subprocess.run(["nbdcopy", uri, backup], check=True)
        rng = random.Random(7)
        runs: dict[str, list[dict]] = {"incremental": [], "full": []}
        piece = a.changed_mib * MIB // PIECES
        for rep in range(a.reps):
            subprocess.run([KILN, "image", "dirty", "start", image, "daily"], check=True,
                           env=cl.env, capture_output=True)
            slots = rng.sample(range(a.size_mib * MIB // piece), PIECES)
            cmds = []
            for s in slots:
                cmds += ["-c", f"write -P {rng.randrange(1, 255)} {s * piece} {piece}"]
            subprocess.run(["qemu-io", "-f", "raw", *cmds, uri], check=True,
                           capture_output=True)
            order = ["incremental", "full"] if rep % 2 == 0 else ["full", "incremental"]
            for way in order:
                seen = len(elog.read_text())
                t0 = time.monotonic()
                if way == "incremental":
                    incremental(nbd, uri, "daily", backup)
                    target = backup
                else:
                    target = base / "full.raw"
                    subprocess.run(["nbdcopy", uri, target], check=True)
                secs = time.monotonic() - t0
                mib = export_read_mib(elog, seen)
                if not filecmp.cmp(target, cl.mnt / "disk.img", shallow=False):
                    raise c.BenchError(f"{way}: the backup differs from the image")
                runs[way].append({"secs": secs, "read_mib": mib})
            c.log(f"rep {rep}: {runs['incremental'][-1]}  full {runs['full'][-1]}")
        med = {w: {k: statistics.median(r[k] for r in runs[w]) for k in ("secs", "read_mib")}
               for w in runs}
        result = {
            "bench": "incremental",
            "size_mib": a.size_mib,
            "changed_mib": a.changed_mib,
            "median": med,
            "read_vs_changed": med["incremental"]["read_mib"] / a.changed_mib,
            "time_full_vs_incr": med["full"]["secs"] / med["incremental"]["secs"],
            "reps": a.reps,
            "runs": runs,
        }
        c.log(f"incremental: {med['incremental']['read_mib']:.1f} MiB read for "
              f"{a.changed_mib} MiB changed ({result['read_vs_changed']:.2f}x, target <= 1.1) "
              f"in {med['incremental']['secs']:.3f} s; full copy {med['full']['read_mib']:.0f} "
              f"MiB in {med['full']['secs']:.3f} s ({result['time_full_vs_incr']:.1f}x longer)")
        return c.emit(result, a.out)
    finally:
        if export:
            export.send_signal(signal.SIGTERM)
            export.wait()
        cl.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
