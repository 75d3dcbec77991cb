"""A managed Kiln volume for the benchmarks: a kilnd (release build) whose volume's bricks are
directories under a base directory, mounted — optionally with every Kiln process in a network
namespace (the mount point stays in the host's mount namespace, so fio and friends run as
usual)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KILN = ROOT / "target" / "release" / "kiln"


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


@contextlib.contextmanager
def xfs_loop(base: Path, size: int):
    """An XFS file system with reflink, made on a loop device over a sparse file of `size`
    bytes in `base` and mounted at `base/xfs`; unmounted and detached at the end. The loop
    device does direct I/O to its backing file: the file system's write-back then reaches
    the disk as on a real device, not a second page cache of the host."""
    backing = base / "xfs.img"
    with open(backing, "wb") as f:
        f.truncate(size)
    dev = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", backing], check=True,
                         capture_output=True, text=True).stdout.strip()
    xfs = base / "xfs"
    xfs.mkdir()
    try:
        subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", dev], check=True)
        subprocess.run(["mount", dev, xfs], check=True)
        yield xfs
    finally:
        subprocess.run(["umount", "-l", xfs])
        subprocess.run(["losetup", "-d", dev])


def build(skip: bool) -> None:
    if not skip:
        subprocess.run(["cargo", "build", "--release", "--bin", "kiln"], cwd=ROOT, check=True)


def name_hash(name: str) -> int:
    """The distribute layer's name hash (crates/layer/src/layers/distribute/layout.rs)."""
    h = 0x811C9DC5
    for b in name.encode():
        h ^= b
        h = (h * 0x01000193) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def in_netns(netns: str | None) -> list[str]:
    """The prefix that runs a command in network namespace `netns` (only: the mount namespace
    stays the host's, so a FUSE mount made there is seen everywhere)."""
    return ["nsenter", f"--net=/run/netns/{netns}"] if netns else []


class Cluster:
    """kilnd on `host`:`port` (bricks from `port + 10`), volume `vol` of `bricks` bricks `b0`,
    `b1`, … under `base` (`replica` per set, `create` added to `volume create`), started and
    mounted at `base/mnt` in `mode`. Brick `i` is at host `brick_hosts[i]` (default: `host`).
    With `netns`, kilnd and its bricks run in that network namespace, and the mount in
    `client_netns` (default: the same)."""

    def __init__(self, base: Path, port: int, vol: str, bricks: int, replica: int = 1,
                 create: tuple = (), kilnd: tuple = (), mode: str = "vm-image",
                 netns: str | None = None, host: str = "127.0.0.1",
                 brick_hosts: list[str] | None = None, client_netns: str | None = None):
        self.base, self.port, self.vol, self.host = base, port, vol, host
        self.state = base / "state"
        self.pre = in_netns(netns)
        client_pre = in_netns(client_netns or netns)
        self.env = dict(os.environ, KILN_MGMT_SECRET_FILE=str(self.state / "mgmt.secret"),
                        KILN_SECRET_FILE=str(self.state / f"vols/{vol}/secret"), KILN_LOG="warn")
        self.kd = subprocess.Popen(
            [*self.pre, KILN, "server", "--mgmt", f"tcp:{host}:{port}", "--metrics", "off",
             "--state-dir", self.state, "--brick-port-base", str(port + 10), *kilnd],
            stdout=subprocess.PIPE, stderr=open(base / "kilnd.log", "w"), env=self.env,
            text=True)
        while "management on" not in (self.kd.stdout.readline() or "management on"):
            pass
        self.bricks = [base / f"b{i}" for i in range(bricks)]
        rep = ["replica", str(replica)] if replica > 1 else []
        hosts = brick_hosts or [host] * bricks
        self.cli("volume", "create", vol, *create, *rep,
                 *[f"{h}:{b}" for h, b in zip(hosts, self.bricks)])
        self.cli("volume", "start", vol)
        mount_env = self.env
        if client_netns and client_netns != netns:
            # A client host outside the pool: the pool hosts' own key is refused there, so it
            # gets an identity of its own.
            key = base / "client.key"
            self.cli("auth", "add", "bench-client", "--volume", vol, "--root", "--key-file", key)
            mount_env = dict(self.env, KILN_SECRET_FILE=str(key))
        self.mnt = base / "mnt"
        self.mnt.mkdir()
        self.mount = subprocess.Popen(
            [*client_pre, KILN, "mount", f"{host}:{port}:/{vol}", self.mnt, "--mode", mode],
            stdout=subprocess.PIPE, env=mount_env, text=True)
        while not (self.mount.stdout.readline() or "kiln: mounted").startswith("kiln: mounted"):
            pass

    def cli(self, *args) -> str:
        return subprocess.run([*self.pre, KILN, *map(str, args), "--server",
                               f"{self.host}:{self.port}", "--state-dir", self.state],
                              check=True, capture_output=True, text=True, env=self.env).stdout

    def status(self) -> dict:
        return json.loads(self.cli("volume", "status", self.vol, "--json"))["volumes"][0]

    def brick_ports(self) -> list[int]:
        return [b["port"] for b in self.status()["bricks"]]

    def rebalance_status(self) -> dict:
        return json.loads(self.cli("volume", "rebalance", self.vol, "status", "--json"))

    def close(self) -> None:
        self.mount.send_signal(signal.SIGTERM)
        self.mount.wait()
        st = self.status()
        self.kd.kill()
        for b in st["bricks"]:
            if b.get("pid"):
                try:
                    os.kill(b["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
