#!/usr/bin/env python3
"""Shards: one image's throughput on one replica set against two, alternating in one run.

Setup: two network namespaces (made and removed here) joined by a veth pair: the servers' and
the client's. Every brick has an address of its own in the servers' namespace, as if on a host
of its own, and its replies — the read data — leave through an HTB class of --link-mbit Mbit/s
(a server with one NIC of that speed; 0: no limit, where the 2-core machine's CPU is the
limit). In the servers' namespace, one managed kilnd per volume:

  one        1x3, files whole (the baseline)
  one-shard  1x3, sharded in pieces of the first --blocks size
  two-B      2x3, sharded in pieces of B, for each B in --blocks

each mounted from the client's namespace (vm-image mode), with one --size-mib image written
through the mount (dd, 1 MiB, O_DIRECT). Then per repetition (--reps), over the volumes in an
order that alternates: fio sequential read 128 KiB QD32 and random read 4 KiB QD32 (libaio,
O_DIRECT, --runtime s each).

Prints each volume's medians (MiB/s, IOPS) and their ratios to `one`; JSON to stdout, a table
to stderr.

Usage: bench/shard.py [--link-mbit 1000] [--blocks 1M,4M,64M] [--size-mib 1024] [--reps 3]
                      [--runtime 8] [--dir /var/tmp/kiln-shard-bench] [--no-build]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from kcluster import Cluster, build, log

SRV, CLI = "kiln-shard-srv", "kiln-shard-cli"
IMG = "disk.img"


def sh(*args: str) -> None:
    subprocess.run(args, check=True)


def net_up() -> None:
    """The two namespaces and the veth pair between them (10.77.0.1 servers, .2 client)."""
    for ns in (SRV, CLI):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", "ksb-s", "netns", SRV, "mtu", "9000", "type", "veth", "peer",
       "name", "ksb-c", "netns", CLI, "mtu", "9000")
    sh("ip", "-n", SRV, "addr", "add", "10.77.0.1/24", "dev", "ksb-s")
    sh("ip", "-n", CLI, "addr", "add", "10.77.0.2/24", "dev", "ksb-c")
    sh("ip", "-n", SRV, "link", "set", "ksb-s", "up")
    sh("ip", "-n", CLI, "link", "set", "ksb-c", "up")
    sh("ip", "-n", CLI, "route", "add", "10.77.0.0/16", "via", "10.77.0.1")


def net_down() -> None:
    for ns in (SRV, CLI):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def brick_hosts(volume: int, n: int) -> list[str]:
    """Addresses of volume `volume`'s bricks, each added to the servers' namespace."""
    hosts = [f"10.77.{volume + 1}.{i + 1}" for i in range(n)]
    for h in hosts:
        sh("ip", "-n", SRV, "addr", "add", f"{h}/32", "dev", "lo")
    return hosts


def limit_links(hosts: list[str], mbit: int) -> None:
    """What each brick address sends the client at most `mbit` Mbit/s."""
    tc = ["ip", "netns", "exec", SRV, "tc"]
    sh(*tc, "qdisc", "add", "dev", "ksb-s", "root", "handle", "1:", "htb", "default", "1",
       "r2q", "1000")
    sh(*tc, "class", "add", "dev", "ksb-s", "parent", "1:", "classid", "1:1", "htb", "rate",
       "100gbit")
    for i, h in enumerate(hosts):
        cls = f"1:{10 + i:x}"
        sh(*tc, "class", "add", "dev", "ksb-s", "parent", "1:", "classid", cls, "htb", "rate",
           f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", "256k", "cburst", "256k")
        sh(*tc, "filter", "add", "dev", "ksb-s", "parent", "1:", "protocol", "ip", "prio", "1",
           "u32", "match", "ip", "src", f"{h}/32", "flowid", cls)


def fio(path: Path, rw: str, bs: str, runtime: int) -> dict:
    out = subprocess.run(
        ["fio", "--name=s", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--iodepth=32",
         "--direct=1", "--ioengine=libaio", "--time_based", f"--runtime={runtime}",
         "--output-format=json"], check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return {"mib_s": job["bw_bytes"] / 2**20, "iops": job["iops"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--link-mbit", type=int, default=1000)
    ap.add_argument("--blocks", default="1M,4M,64M")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=8)
    ap.add_argument("--dir", default="/var/tmp/kiln-shard-bench")
    ap.add_argument("--no-build", action="store_true")
    a = ap.parse_args()
    build(a.no_build)
    blocks = a.blocks.split(",")
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    net_up()
    clusters: dict[str, Cluster] = {}
    hosts: list[str] = []
    try:
        plan = [("one", 3, ()), ("one-shard", 3, ("--shard", blocks[0]))]
        plan += [(f"two-{b}", 6, ("--shard", b)) for b in blocks]
        for i, (name, bricks, create) in enumerate(plan):
            d = base / name
            d.mkdir()
            bh = brick_hosts(i, bricks)
            hosts += bh
            clusters[name] = Cluster(d, 25700 + 40 * i, name.replace("-", ""), bricks,
                                     replica=3, create=create, kilnd=("--mgmt-plaintext",),
                                     netns=SRV, host="10.77.0.1",
                                     brick_hosts=bh, client_netns=CLI)
            sh("dd", "if=/dev/urandom", f"of={d / 'mnt' / IMG}", "bs=1M",
               f"count={a.size_mib}", "oflag=direct", "status=none")
            log(f"{name}: {bricks} bricks {' '.join(create)}, {a.size_mib} MiB image written")
        if a.link_mbit:
            limit_links(hosts, a.link_mbit)
        tests = {"seq128k": ("read", "128k"), "rand4k": ("randread", "4k")}
        runs: dict = {n: {t: [] for t in tests} for n in clusters}
        for rep in range(a.reps):
            order = list(clusters) if rep % 2 == 0 else list(reversed(clusters))
            for name in order:
                for t, (rw, bs) in tests.items():
                    runs[name][t].append(fio(clusters[name].mnt / IMG, rw, bs, a.runtime))
            log(f"rep {rep}: " + ", ".join(
                f"{n} {runs[n]['seq128k'][-1]['mib_s']:.0f} MiB/s "
                f"{runs[n]['rand4k'][-1]['iops']:.0f} IOPS" for n in order))
        med = {n: {"seq128k_mib_s": round(statistics.median(r["mib_s"] for r in v["seq128k"]), 1),
                   "rand4k_iops": round(statistics.median(r["iops"] for r in v["rand4k"]))}
               for n, v in runs.items()}
        one = med["one"]
        for n, m in med.items():
            m["seq128k_vs_one"] = round(m["seq128k_mib_s"] / one["seq128k_mib_s"], 2)
            m["rand4k_vs_one"] = round(m["rand4k_iops"] / one["rand4k_iops"], 2)
        out = {"link_mbit": a.link_mbit, "size_mib": a.size_mib, "reps": a.reps,
               "runtime_s": a.runtime, "medians": med}
        for n, m in med.items():
            log(f"{n:>12}: seq 128k QD32 {m['seq128k_mib_s']:7.1f} MiB/s "
                f"({m['seq128k_vs_one']:.2f}x)   rand 4k QD32 {m['rand4k_iops']:7d} IOPS "
                f"({m['rand4k_vs_one']:.2f}x)")
        print(json.dumps(out))
    finally:
        for c in clusters.values():
            c.close()
        net_down()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
