#!/usr/bin/env python3
"""A QEMU guest's disk through Kiln's vhost-user-blk device, against kiln nbd, a local file
served by qemu-storage-daemon's vhost-user-blk export, and GlusterFS through QEMU's gluster://
driver — all in one run, alternating.

The guest (TCG on this machine: see shared/vm/README.md) runs the 2013 seed job inside:
four sequential 128 KiB readers on /dev/vda at iodepth 4, 32, 8 and 16, each over its own
512 MiB range, libaio, direct, time based (--runtime s). Set-up, all on tmpfs under --dir:

  kiln_vhost   kiln server (one brick, Unix socket) + kiln vhost-user-blk on a 2 GiB image
  kiln_nbd     the same brick + kiln nbd, the guest's drive nbd+unix://
  qsd_local    qemu-storage-daemon --export vhost-user-blk on a local 2 GiB file (the floor)
  qemu_nbd_local  qemu-nbd (read-only, io_uring, cache=none) on the same local file, the
               guest's drive nbd+unix:// (the issue's anchor: QEMU's own NBD path)
  gluster      shared/bench/gluster.sh's volume dist, the guest's drive gluster://
               (--no-gluster to leave it out)

Per repetition (--reps, default 3) every way runs once, the order rotating. The report gives,
per way, the medians of each job's MiB/s, of their sum, and of MiB read per CPU-second of
the host processes serving the guest (mib_per_cpu_s: the backend, and Kiln's brick; what
they take, the TCG guest does not get), and the ratios of the sums:
kiln_vhost / kiln_nbd (target >= 1.8) and kiln_vhost / qsd_local (target >= 0.9), and the
device's bytes_copied. A table goes to stderr, one JSON object to stdout (and --out FILE).

Usage: bench/vhost.py [--reps 3] [--runtime 5] [--no-gluster] [--no-build]
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare as c  # noqa: E402

ROOT = c.repo_root()
VM = ROOT.parent / "shared" / "vm"
GLUSTER = ROOT.parent / "shared" / "bench" / "gluster.sh"
SIZE = 2 << 30
MEM = "2G"


def wait_path(p: Path, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while not p.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise c.BenchError(f"{what} did not start")
        time.sleep(0.02)


def guest(way: str, spec: list[str], runtime: int, work: Path) -> dict:
    """One guest run of the seed job; per job MiB/s."""
    out = work / f"{way}.json"
    args = [str(VM / "guest-fio.sh"), "--job", str(VM / "jobs" / "seed-2013.fio"),
            "--runtime", str(runtime), "--mem", MEM, "-q", "--out", str(out)]
    r = subprocess.run(args + spec, capture_output=True, text=True)
    if r.returncode != 0:
        raise c.BenchError(f"{way}: guest run failed: {c.tail(r.stderr)}")
    jobs = json.loads(out.read_text())["jobs"]
    return {j["jobname"]: j["read"]["bw_bytes"] / (1 << 20) for j in jobs}


def gluster_pids() -> list[int]:
    """The brick processes of shared/bench's volume dist (the client is QEMU's gfapi)."""
    out = subprocess.run([str(GLUSTER), "pids", "dist"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()[1:] if p.isdigit()]


def vhost_args(sock: Path) -> list[str]:
    return ["--", "-object", f"memory-backend-memfd,id=mem,size={MEM},share=on",
            "-numa", "node,memdev=mem", "-chardev", f"socket,id=c,path={sock}",
            "-device", "vhost-user-blk-pci,chardev=c,num-queues=2"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm/kiln-vhost-bench")
    ap.add_argument("--no-gluster", action="store_true")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if not (VM / "guest-fio.sh").exists():
        raise c.BenchError(f"no guest harness at {VM}")
    c.ensure_packages({"qemu-storage-daemon": "qemu-system-x86", "qemu-nbd": "qemu-utils"})
    kiln = c.release_kiln(a.no_build)
    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    (work / "brick").mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    gluster = not a.no_gluster and GLUSTER.exists()

    def start(args: list[str], sock: Path, what: str, log: str) -> subprocess.Popen:
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                             stderr=open(work / log, "w"), env=dict(os.environ, KILN_LOG="info"))
        procs.append(p)
        wait_path(sock, p, what)
        return p

    try:
        block = os.urandom(1 << 20)
        for f in (work / "brick" / "bench.img", work / "local.img"):
            with open(f, "wb") as out:
                for _ in range(SIZE >> 20):
                    out.write(block)
        server = start([str(kiln), "server", "--brick", str(work / "brick"), "--listen",
                        f"unix:{work / 'k.sock'}", "--metrics", "off"], work / "k.sock",
                       "kiln server", "server.log")
        image = f"unix:{work / 'k.sock'}:/bench/bench.img"
        dev = start([str(kiln), "vhost-user-blk", image, "--socket", str(work / "kv.sock"),
                     "--lock", "off"], work / "kv.sock", "kiln vhost-user-blk", "vhost.log")
        nbd = start([str(kiln), "nbd", image, "--listen", f"unix:{work / 'kn.sock'}", "--lock",
                     "off"], work / "kn.sock", "kiln nbd", "nbd.log")
        qsd = start(["qemu-storage-daemon", "--blockdev",
               f"driver=file,node-name=f,filename={work / 'local.img'},cache.direct=on,"
               "aio=io_uring", "--blockdev", "driver=raw,node-name=r,file=f", "--export",
               f"type=vhost-user-blk,id=e,node-name=r,addr.type=unix,"
               f"addr.path={work / 'q.sock'},writable=on,num-queues=2"],
              work / "q.sock", "qemu-storage-daemon", "qsd.log")
        # The anchor: QEMU's own NBD server on the local file (the same image as
        # qsd_local's; both only read it, so the write locks QEMU takes are not asked for).
        qnbd = start(["qemu-nbd", "-t", "-k", str(work / "qn.sock"), "-f", "raw", "-r",
                      "--cache=none", "--aio=io_uring", "--shared=4", str(work / "local.img")],
                     work / "qn.sock", "qemu-nbd", "qemu-nbd.log")
        ways = {
            "kiln_vhost": vhost_args(work / "kv.sock"),
            "kiln_nbd": ["--drive", f"file=nbd+unix:///bench.img?socket={work / 'kn.sock'},"
                         "format=raw,if=virtio,cache=none"],
            "qsd_local": vhost_args(work / "q.sock"),
            "qemu_nbd_local": ["--drive", f"file=nbd+unix:///?socket={work / 'qn.sock'},"
                               "format=raw,if=virtio,cache=none,readonly=on"],
        }
        if gluster:
            subprocess.run([str(GLUSTER), "up"], check=True, stdout=sys.stderr)
            subprocess.run([str(GLUSTER), "fio", "dist", "--filename=bench.img", "--thread",
                            "--name=layout", "--rw=write", "--bs=1m", "--iodepth=8",
                            f"--size={SIZE}", "--output=/dev/null"], check=True,
                           capture_output=True)
            ways["gluster"] = ["--drive", "file=gluster://127.0.0.1/dist/bench.img,"
                               "format=raw,if=virtio,cache=none"]
        # The host processes that serve each way (their CPU is taken from the guest's).
        serving = {"kiln_vhost": [server.pid, dev.pid], "kiln_nbd": [server.pid, nbd.pid],
                   "qsd_local": [qsd.pid], "qemu_nbd_local": [qnbd.pid], "gluster": gluster_pids() if gluster else []}
        names = list(ways)
        runs: dict[str, list[dict]] = {w: [] for w in names}
        for rep in range(a.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for w in order:
                before = sum(c.proc_cpu_s(p) or 0.0 for p in serving[w])
                got = guest(w, ways[w], a.runtime, work)
                cpu = sum(c.proc_cpu_s(p) or 0.0 for p in serving[w]) - before
                got["total"] = sum(got.values())
                # Per job the guest read total × runtime MiB in all; per CPU-second of the
                # processes serving it.
                got["mib_per_cpu_s"] = got["total"] * a.runtime / cpu if cpu > 0 else 0.0
                runs[w].append(got)
                c.log(f"rep {rep} {w}: {got['total']:.0f} MiB/s")
        med = {w: {k: statistics.median(r[k] for r in runs[w]) for k in runs[w][0]}
               for w in names}
        dev.send_signal(signal.SIGTERM)
        dev.wait()
        summary = [ln for ln in (work / "vhost.log").read_text().splitlines()
                   if "device summary" in ln]
        copied = int(summary[-1].split("bytes_copied=")[1].split()[0]) if summary else None
        result = {
            "bench": "vhost",
            "job": "seed-2013 (128k seq read, QD 4/32/8/16, TCG guest)",
            "median_mib_s": med,
            "vhost_vs_nbd": med["kiln_vhost"]["total"] / med["kiln_nbd"]["total"],
            "vhost_vs_qsd_local": med["kiln_vhost"]["total"] / med["qsd_local"]["total"],
            "vhost_vs_qemu_nbd_local": (med["kiln_vhost"]["total"]
                                        / med["qemu_nbd_local"]["total"]),
            "vhost_vs_gluster": (med["kiln_vhost"]["total"] / med["gluster"]["total"]
                                 if gluster else None),
            "bytes_copied": copied,
            "reps": a.reps,
            "runs": runs,
        }
        for w in names:
            c.log(f"{w:12} " + "  ".join(f"{k} {v:7.0f}" for k, v in med[w].items()))
        c.log(f"kiln_vhost / kiln_nbd {result['vhost_vs_nbd']:.2f} (target >= 1.8), "
              f"/ qsd_local {result['vhost_vs_qsd_local']:.2f} (target >= 0.9), "
              f"/ qemu_nbd_local {result['vhost_vs_qemu_nbd_local']:.2f}; "
              f"bytes_copied {copied}")
        return c.emit(result, a.out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if gluster:
            subprocess.run([str(GLUSTER), "down"], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
