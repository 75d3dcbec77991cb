#!/usr/bin/env python3
"""NBD TRIM of an image on a replica-3 volume: the space comes back on every replica's brick.

Setup: a managed kilnd (release build), a replica-3 volume whose bricks are directories under
--dir (a disk file system, not tmpfs), mounted; per repetition (--reps, default 3) an image of
--size-mib MiB of random data written through the mount and written back (`sync`), exported
by `kiln nbd`, and then one of two ways, in an order that alternates:

  trim     qemu-io `discard 0 SIZE` through the export (NBD_CMD_TRIM), whole image
  none     no trim (the baseline: what the bricks hold for the image)

after which each brick's allocated bytes for the image are read (`du`: st_blocks * 512), and
the trimmed range is read back through the export and must be zeros. The report gives, per
way, the medians of the bytes each replica holds, and the bytes freed per replica against the
size trimmed (target: the whole size on each). A table goes to stderr, one JSON object to
stdout (and --out FILE).

Usage: bench/discard.py [--reps 3] [--size-mib 1024] [--no-build]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402
from kcluster import KILN, Cluster, build  # noqa: E402

PORT = 24890
MIB = 1 << 20


def allocated(path: Path) -> int:
    """Bytes the file system allocated to `path`."""
    return os.stat(path).st_blocks * 512


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dir", default="/var/tmp/kiln-discard-bench")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    c.ensure_packages({"qemu-io": "qemu-utils"})
    build(a.no_build)
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    size = a.size_mib * MIB
    cl = Cluster(base, PORT, "trim", 3, replica=3)
    image = f"127.0.0.1:{PORT}:/trim/disk.img"
    runs: dict[str, list[dict]] = {"trim": [], "none": []}
    block = os.urandom(MIB)
    try:
        for rep in range(a.reps):
            for way in (["trim", "none"] if rep % 2 == 0 else ["none", "trim"]):
                (cl.mnt / "disk.img").unlink(missing_ok=True)
                with open(cl.mnt / "disk.img", "wb") as f:
                    for _ in range(a.size_mib):
                        f.write(block)
                subprocess.run(["sync"], check=True)
                before = [allocated(b / "disk.img") for b in cl.bricks]
                export = subprocess.Popen(
                    [KILN, "nbd", image, "--listen", f"unix:{base / 'e.sock'}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=cl.env)
                try:
                    uri = export.stdout.readline().rsplit(" at ", 1)[1].strip()
                    if way == "trim":
                        subprocess.run(["qemu-io", "-f", "raw", "-c", f"discard 0 {size}",
                                        "-c", f"read -P 0 0 {size}", uri],
                                       check=True, capture_output=True, text=True)
                finally:
                    export.send_signal(signal.SIGTERM)
                    export.wait()
                after = [allocated(b / "disk.img") for b in cl.bricks]
                runs[way].append({"before": before, "after": after,
                                  "freed": [x - y for x, y in zip(before, after)]})
            c.log(f"rep {rep}: " + "  ".join(f"{w}: {runs[w][-1]['after']}" for w in runs))
        med = lambda w, k, i: statistics.median(r[k][i] for r in runs[w])  # noqa: E731
        result = {
            "bench": "discard",
            "size_bytes": size,
            "held_after": {w: [med(w, "after", i) for i in range(3)] for w in runs},
            "freed_by_trim": [med("trim", "freed", i) for i in range(3)],
            "freed_vs_size": [med("trim", "freed", i) / size for i in range(3)],
            "reps": a.reps,
            "runs": runs,
        }
        c.log(f"NBD TRIM of {a.size_mib} MiB on replica 3: freed "
              f"{[f'{x / MIB:.1f}' for x in result['freed_by_trim']]} MiB per brick; "
              f"without it the bricks hold {[f'{x / MIB:.1f}' for x in result['held_after']['none']]} MiB")
        return c.emit(result, a.out)
    finally:
        cl.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
