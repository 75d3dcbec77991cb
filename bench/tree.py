#!/usr/bin/env python3
"""Small files: a cold tree read, `ls -lR` of 100,000 entries and an untar, on three systems.

Systems, each a directory the jobs work in:
  tmpfs         a plain tmpfs directory (the floor)
  kiln          kiln mount --mode general of a kiln server whose brick is on a tmpfs
                (through the brick's Unix socket, or loopback TCP with --kiln-transport tcp)
  gluster       the GlusterFS FUSE mount of volume "dist" (../shared/bench/gluster.sh: one brick
                on a tmpfs, read-ahead / write-behind / io-cache / quick-read off)

Jobs, every repetition, the order of the systems rotating from one repetition to the next:
  tree_read     find TREE -type f -print0 | xargs -0 cat > /dev/null, cold: the page cache,
                dentries and inodes dropped (echo 3 > /proc/sys/vm/drop_caches) and the Kiln
                mount made afresh (so nothing its process keeps survives) before each run.
                TREE is /usr/include and /usr/share/doc, laid out once per system by tar.
                Reported in MB/s of file data.
  ls_lR         ls -lR of a tree of --entries entries (default 100,000 empty files in
                directories of 1,000), cold as above; seconds.
  untar         tar -x of /usr/include into a fresh directory, then syncfs; seconds. Checked
                afterwards (not timed): every file's content, mode, owner, group and size
                (and every symlink's target) equal the source's.

Targets (ratios of medians): tree_read kiln/gluster >= 5 and kiln/tmpfs >= 0.25; ls_lR
gluster/kiln time >= 5; untar gluster/kiln time >= 3.

Set-up: apt-get installs what is missing; cargo build --release -p kiln-cli (--no-build skips
it); a tmpfs on /tmp/kiln-tree-bench/tmpfs holds the tmpfs system and Kiln's brick;
gluster.sh up / mount. Clean-up (also on Ctrl-C): the Kiln mount and server, the tmpfs and the
GlusterFS mount; gluster.sh down only if this script brought GlusterFS up and --keep-gluster was
not given. Needs root.

A table goes to stderr, one JSON object to stdout (and to --out FILE): config, medians, ratios,
runs. Exit status 1 if a run or a check failed, 2 if set-up failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import BenchError, GlusterRef, emit, ensure_packages, privileged, repo_root  # noqa: E402
from fuse_compare import is_mountpoint, stop_process, unmount, wait_for_line  # noqa: E402

WORK = Path("/tmp/kiln-tree-bench")
TMPFS = WORK / "tmpfs"
MOUNTS = {"tmpfs": TMPFS / "local", "kiln": WORK / "kiln", "gluster": WORK / "gluster"}
SYSTEMS = ["tmpfs", "kiln", "gluster"]
SOURCES = ["usr/include", "usr/share/doc"]
JOBS = ["tree_read", "ls_lR", "untar"]


def log(msg: str) -> None:
    print(f"[tree] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def listing(root: Path) -> dict[str, tuple]:
    """path -> (kind, mode, uid, gid, size, link target) for everything under root."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            link = os.readlink(p) if p.is_symlink() else None
            size = st.st_size if not p.is_dir() else 0
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, size, link)
    return out


class TreeBench(GlusterRef):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.root = repo_root()
        GlusterRef.__init__(self, self.root)
        self.kiln_bin = args.kiln_bin or self.root / "target" / "release" / "kiln"
        self.tmp = Path(tempfile.mkdtemp(prefix="kiln-tree-"))
        self.server: subprocess.Popen | None = None
        self.mount: subprocess.Popen | None = None
        self.source = ""
        self.mounted_tmpfs = False
        self.started_gluster = False
        self.mounted_gluster = False
        self.tree_bytes = 0
        self.tree_files = 0
        self.runs: list[dict] = []
        self.failures: list[str] = []

    # ------------------------------------------------------------- set-up

    def setup(self) -> None:
        if not self.gluster_sh.is_file():
            raise BenchError(f"{self.gluster_sh} not found (the shared/ dir beside the repo)")
        ensure_packages({"fusermount3": "fuse3", "tar": "tar"})
        if not self.args.no_build:
            log("cargo build --release -p kiln-cli")
            sh(["cargo", "build", "--release", "-p", "kiln-cli"], cwd=self.root, stdout=sys.stderr)
        if not Path(self.kiln_bin).is_file():
            raise BenchError(f"{self.kiln_bin} is missing (build failed or --no-build)")
        TMPFS.mkdir(parents=True, exist_ok=True)
        if not is_mountpoint(TMPFS):
            sh(privileged() + ["mount", "-t", "tmpfs", "-o", "size=6g", "kiln-tree-bench",
                               str(TMPFS)])
            self.mounted_tmpfs = True
        MOUNTS["tmpfs"].mkdir(exist_ok=True)
        self.kiln_server()
        self.kiln_mount()
        self.gluster_mount()
        self.make_sources()
        for system in SYSTEMS:
            self.lay_out(system)

    def kiln_server(self) -> None:
        brick = TMPFS / "brick"
        brick.mkdir(exist_ok=True)
        sock = self.tmp / "kilnd.sock"
        server_log = self.tmp / "kiln-server.log"
        with open(server_log, "w") as f:
            self.server = subprocess.Popen(
                [str(self.kiln_bin), "server", "--brick", str(brick),
                 "--listen", "tcp:127.0.0.1:0", "--listen", f"unix:{sock}"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        m = wait_for_line(self.server, server_log, r"kilnd: listening on tcp:127\.0\.0\.1:(\d+)",
                          "kiln server")
        addr = f"unix:{sock}" if self.args.kiln_transport == "unix" else f"127.0.0.1:{m.group(1)}"
        self.source = f"{addr}:/vol"
        log(f"kiln server (pid {self.server.pid}), brick {brick}, mounted through {addr}")

    def kiln_mount(self) -> None:
        mnt = MOUNTS["kiln"]
        mnt.mkdir(parents=True, exist_ok=True)
        if is_mountpoint(mnt):
            raise BenchError(f"{mnt} is already a mount point (left over?); unmount it")
        mount_log = self.tmp / "kiln-mount.log"
        with open(mount_log, "w") as f:
            self.mount = subprocess.Popen(
                [str(self.kiln_bin), "mount", self.source, str(mnt), "--mode", "general"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        wait_for_line(self.mount, mount_log, r"kiln: mounted", "kiln mount")

    def kiln_remount(self) -> None:
        stop_process(self.mount, "kiln mount")
        self.mount = None
        unmount(MOUNTS["kiln"], "the kiln mount")
        self.kiln_mount()

    def gluster_mount(self) -> None:
        was_up = self.glusterd_alive()
        self.started_gluster = not was_up
        log(self.gluster("up").strip())
        mnt = MOUNTS["gluster"]
        mnt.mkdir(parents=True, exist_ok=True)
        if not is_mountpoint(mnt):
            self.gluster("mount", "dist", str(mnt), timeout=120)
            self.mounted_gluster = True

    def make_sources(self) -> None:
        """The tree's tar and /usr/include's tar, and the empty-file tree's tar."""
        self.tree_tar = self.tmp / "tree.tar"
        sh(["tar", "-C", "/", "-cf", str(self.tree_tar), *SOURCES])
        self.include_tar = self.tmp / "include.tar"
        sh(["tar", "-C", "/usr", "-cf", str(self.include_tar), "include"])
        for src in SOURCES:
            for dirpath, _, files in os.walk(Path("/") / src):
                for name in files:
                    p = Path(dirpath) / name
                    if p.is_file() and not p.is_symlink():
                        self.tree_files += 1
                        self.tree_bytes += p.stat().st_size
        many = self.tmp / "many"
        per = 1000
        for d in range((self.args.entries + per - 1) // per):
            dd = many / f"d{d:03}"
            dd.mkdir(parents=True)
            for i in range(min(per, self.args.entries - d * per)):
                (dd / f"f{i:04}").touch()
        self.many_tar = self.tmp / "many.tar"
        sh(["tar", "-C", str(self.tmp), "-cf", str(self.many_tar), "many"])
        log(f"tree: {self.tree_files} files, {self.tree_bytes / 1e6:.0f} MB; "
            f"{self.args.entries} empty files for ls -lR")

    def lay_out(self, system: str) -> None:
        d = MOUNTS[system]
        t0 = time.monotonic()
        for tar in (self.tree_tar, self.many_tar):
            sh(["tar", "-C", str(d), "-xf", str(tar)])
        os.sync()
        log(f"laid out the trees on {system} in {time.monotonic() - t0:.1f} s")

    # ------------------------------------------------------------- jobs

    def cold(self) -> None:
        self.kiln_remount()
        drop_caches()

    def tree_read(self, system: str) -> dict:
        self.cold()
        d = MOUNTS[system]
        t0 = time.monotonic()
        sh(["sh", "-c", 'find "$1" -type f -print0 | xargs -0 cat > /dev/null', "-",
            str(d / "usr")])
        s = time.monotonic() - t0
        return {"s": s, "mb_s": self.tree_bytes / 1e6 / s}

    def ls_lR(self, system: str) -> dict:
        self.cold()
        t0 = time.monotonic()
        sh(["ls", "-lR", str(MOUNTS[system] / "many")], stdout=subprocess.DEVNULL)
        return {"s": time.monotonic() - t0}

    def untar(self, system: str, rep: int) -> dict:
        dest = MOUNTS[system] / f"untar{rep}"
        dest.mkdir()
        t0 = time.monotonic()
        sh(["tar", "-C", str(dest), "-xf", str(self.include_tar)])
        fd = os.open(dest, os.O_RDONLY)
        try:
            os.syncfs(fd) if hasattr(os, "syncfs") else os.sync()
        finally:
            os.close(fd)
        s = time.monotonic() - t0
        self.check_untar(system, dest / "include")
        return {"s": s}

    def check_untar(self, system: str, got: Path) -> None:
        want = listing(Path("/usr/include"))
        have = listing(got)
        bad = [p for p in want if have.get(p) != want[p]]
        extra = [p for p in have if p not in want]
        diff = subprocess.run(["diff", "-r", "--no-dereference", "/usr/include", str(got)],
                              capture_output=True, text=True)
        if bad or extra or diff.returncode != 0:
            msg = (f"untar on {system}: {len(bad)} entries differ (e.g. {bad[:3]}), "
                   f"{len(extra)} extra, diff -r: {diff.stdout[:300]}")
            self.failures.append(msg)
            log("CHECK FAILED: " + msg)

    def run(self) -> None:
        for rep in range(self.args.reps):
            order = SYSTEMS[rep % 3:] + SYSTEMS[:rep % 3]
            for job in JOBS:
                for system in order:
                    r = (self.untar(system, rep) if job == "untar"
                         else getattr(self, job)(system))
                    r.update(job=job, system=system, rep=rep)
                    self.runs.append(r)
                    log(f"rep {rep + 1} {job:9} {system:7} {r['s']:7.2f} s"
                        + (f"  {r['mb_s']:7.1f} MB/s" if "mb_s" in r else ""))

    # ------------------------------------------------------------- clean-up

    def cleanup(self) -> None:
        stop_process(self.mount, "kiln mount")
        unmount(MOUNTS["kiln"], "the kiln mount")
        stop_process(self.server, "kiln server")
        if self.mounted_gluster:
            unmount(MOUNTS["gluster"], "the GlusterFS mount")
        if self.started_gluster and not self.args.keep_gluster:
            try:
                self.gluster("down")
            except BenchError as e:
                log(str(e))
        if self.mounted_tmpfs:
            unmount(TMPFS, "the tmpfs")


def medians(runs: list[dict]) -> dict:
    med: dict = {}
    for job in JOBS:
        for system in SYSTEMS:
            rs = [r for r in runs if r["job"] == job and r["system"] == system]
            if rs:
                med.setdefault(job, {})[system] = {
                    k: statistics.median(r[k] for r in rs) for k in ("s", "mb_s") if k in rs[0]}
    return med


def ratios(med: dict) -> list[dict]:
    def get(job, system, key):
        return med.get(job, {}).get(system, {}).get(key)

    out = []
    for name, num, den, target in [
        ("tree_read kiln / gluster MB/s", get("tree_read", "kiln", "mb_s"),
         get("tree_read", "gluster", "mb_s"), 5),
        ("tree_read kiln / tmpfs MB/s", get("tree_read", "kiln", "mb_s"),
         get("tree_read", "tmpfs", "mb_s"), 0.25),
        ("ls_lR gluster / kiln time", get("ls_lR", "gluster", "s"), get("ls_lR", "kiln", "s"), 5),
        ("untar gluster / kiln time", get("untar", "gluster", "s"), get("untar", "kiln", "s"), 3),
    ]:
        v = num / den if num and den else None
        out.append({"ratio": name, "value": v, "target": target,
                    "pass": v is not None and v >= target})
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--entries", type=int, default=100_000,
                   help="empty files in the ls -lR tree (default 100000)")
    p.add_argument("--kiln-transport", choices=["unix", "tcp"], default="unix",
                   help="how the Kiln mount reaches its brick (default unix)")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--keep-gluster", action="store_true", help="leave GlusterFS running")
    p.add_argument("--no-build", action="store_true", help="skip cargo build")
    p.add_argument("--kiln-bin", type=Path, help="kiln binary (default target/release/kiln)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("tree.py needs root (mounts, drop_caches)", file=sys.stderr)
        return 2
    b = TreeBench(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        try:
            b.setup()
        except (BenchError, subprocess.CalledProcessError, OSError) as e:
            log(f"set-up failed: {e}")
            return 2
        b.run()
    except (BenchError, subprocess.CalledProcessError) as e:
        log(f"run failed: {e}")
        b.failures.append(str(e))
    finally:
        b.cleanup()
    med = medians(b.runs)
    rats = ratios(med)
    print(f"\nmedians of {args.reps} reps (kiln through {args.kiln_transport}); "
          f"{b.tree_files} files / {b.tree_bytes / 1e6:.0f} MB; ls -lR of {args.entries}",
          file=sys.stderr)
    for job in JOBS:
        for system in SYSTEMS:
            m = med.get(job, {}).get(system)
            if m:
                extra = f"  {m['mb_s']:8.1f} MB/s" if "mb_s" in m else ""
                print(f"  {job:9} {system:7} {m['s']:8.2f} s{extra}", file=sys.stderr)
    for r in rats:
        v = "-" if r["value"] is None else f"{r['value']:.2f}"
        print(f"  {r['ratio']:32} {v:>6}  >= {r['target']:<5} {'PASS' if r['pass'] else 'FAIL'}",
              file=sys.stderr)
    emit({"config": vars(args) | {"kiln_bin": str(b.kiln_bin), "out": args.out},
          "tree": {"files": b.tree_files, "bytes": b.tree_bytes},
          "medians": med, "ratios": rats, "runs": b.runs, "failures": b.failures}, args.out)
    return 1 if b.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
