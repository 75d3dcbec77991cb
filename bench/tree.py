#!/usr/bin/env python3
"""Small files: a cold tree read, `ls -lR` of 100,000 entries and an untar, on three systems.

Systems, each a directory the jobs work in:
  tmpfs         a plain tmpfs directory (the floor)
  kiln          kiln mount --mode general of a kiln server whose brick is on a tmpfs
                (through the brick's Unix socket, or loopback TCP with --kiln-transport tcp)
  gluster       the GlusterFS FUSE mount of volume "dist" (../shared/bench/gluster.sh: one brick
                on a tmpfs, read-ahead / write-behind / io-cache / quick-read off)
  kiln-old      with --old-kiln-bin: kiln as above, from another build (a change's baseline),
                with a server, brick and mount of its own
--systems picks some of them (default tmpfs,kiln,gluster; kiln-old joins with --old-kiln-bin).

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
gluster/kiln time >= 5; untar gluster/kiln time >= 3. With kiln-old, each job's kiln/kiln-old
ratio too (speed: above 1 is the new build faster), with no target.

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
MOUNTS = {"tmpfs": TMPFS / "local", "kiln": WORK / "kiln", "gluster": WORK / "gluster",
          "kiln-old": WORK / "kiln-old"}
ALL_SYSTEMS = ["tmpfs", "kiln", "gluster", "kiln-old"]
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
        self.systems: list[str] = args.systems
        self.tmp = Path(tempfile.mkdtemp(prefix="kiln-tree-"))
        # Per Kiln system: its binary, server, mount and source.
        self.kilns: dict[str, dict] = {
            k: {"bin": self.kiln_bin if k == "kiln" else args.old_kiln_bin,
                "server": None, "mount": None, "source": ""}
            for k in self.systems if k.startswith("kiln")}
        self.mounted_tmpfs = False
        self.started_gluster = False
        self.mounted_gluster = False
        self.tree_bytes = 0
        self.tree_files = 0
        self.runs: list[dict] = []
        self.failures: list[str] = []

    # ------------------------------------------------------------- set-up

    def setup(self) -> None:
        if "gluster" in self.systems and not self.gluster_sh.is_file():
            raise BenchError(f"{self.gluster_sh} not found (the shared/ dir beside the repo)")
        ensure_packages({"fusermount3": "fuse3", "tar": "tar"})
        if not self.args.no_build:
            log("cargo build --release -p kiln-cli")
            sh(["cargo", "build", "--release", "-p", "kiln-cli"], cwd=self.root, stdout=sys.stderr)
        for k, kiln in self.kilns.items():
            if not Path(kiln["bin"]).is_file():
                raise BenchError(f"{k}: {kiln['bin']} is missing (build failed or --no-build)")
        TMPFS.mkdir(parents=True, exist_ok=True)
        if not is_mountpoint(TMPFS):
            sh(privileged() + ["mount", "-t", "tmpfs", "-o", "size=6g", "kiln-tree-bench",
                               str(TMPFS)])
            self.mounted_tmpfs = True
        MOUNTS["tmpfs"].mkdir(exist_ok=True)
        for k in self.kilns:
            self.kiln_server(k)
            self.kiln_mount(k)
        if "gluster" in self.systems:
            self.gluster_mount()
        self.make_sources()
        for system in self.systems:
            self.lay_out(system)

    def kiln_server(self, k: str) -> None:
        kiln = self.kilns[k]
        brick = TMPFS / f"brick-{k}"
        brick.mkdir(exist_ok=True)
        sock = self.tmp / f"{k}.sock"
        server_log = self.tmp / f"{k}-server.log"
        with open(server_log, "w") as f:
            kiln["server"] = subprocess.Popen(
                [str(kiln["bin"]), "server", "--brick", str(brick),
                 "--listen", "tcp:127.0.0.1:0", "--listen", f"unix:{sock}"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        m = wait_for_line(kiln["server"], server_log,
                          r"kilnd: listening on tcp:127\.0\.0\.1:(\d+)", f"{k} server")
        addr = f"unix:{sock}" if self.args.kiln_transport == "unix" else f"127.0.0.1:{m.group(1)}"
        kiln["source"] = f"{addr}:/vol"
        log(f"{k} server (pid {kiln['server'].pid}, {kiln['bin']}), brick {brick}, "
            f"mounted through {addr}")

    def kiln_mount(self, k: str) -> None:
        kiln = self.kilns[k]
        mnt = MOUNTS[k]
        mnt.mkdir(parents=True, exist_ok=True)
        if is_mountpoint(mnt):
            raise BenchError(f"{mnt} is already a mount point (left over?); unmount it")
        mount_log = self.tmp / f"{k}-mount.log"
        with open(mount_log, "w") as f:
            kiln["mount"] = subprocess.Popen(
                [str(kiln["bin"]), "mount", kiln["source"], str(mnt), "--mode", "general"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        wait_for_line(kiln["mount"], mount_log, r"kiln: mounted", f"{k} mount")

    def kiln_remount(self, k: str) -> None:
        stop_process(self.kilns[k]["mount"], f"{k} mount")
        self.kilns[k]["mount"] = None
        unmount(MOUNTS[k], f"the {k} mount")
        self.kiln_mount(k)

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

    def cold(self, system: str) -> None:
        """A Kiln system's mount made afresh (nothing its process keeps survives), then
        every cache dropped."""
        if system in self.kilns:
            self.kiln_remount(system)
        drop_caches()

    def tree_read(self, system: str) -> dict:
        self.cold(system)
        d = MOUNTS[system]
        t0 = time.monotonic()
        sh(["sh", "-c", 'find "$1" -type f -print0 | xargs -0 cat > /dev/null', "-",
            str(d / "usr")])
        s = time.monotonic() - t0
        return {"s": s, "mb_s": self.tree_bytes / 1e6 / s}

    def ls_lR(self, system: str) -> dict:
        self.cold(system)
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
            n = len(self.systems)
            order = self.systems[rep % n:] + self.systems[:rep % n]
            for job in self.args.jobs:
                for system in order:
                    r = (self.untar(system, rep) if job == "untar"
                         else getattr(self, job)(system))
                    r.update(job=job, system=system, rep=rep)
                    self.runs.append(r)
                    log(f"rep {rep + 1} {job:9} {system:8} {r['s']:7.2f} s"
                        + (f"  {r['mb_s']:7.1f} MB/s" if "mb_s" in r else ""))

    # ------------------------------------------------------------- clean-up

    def cleanup(self) -> None:
        for k, kiln in self.kilns.items():
            stop_process(kiln["mount"], f"{k} mount")
            unmount(MOUNTS[k], f"the {k} mount")
            stop_process(kiln["server"], f"{k} server")
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
        for system in ALL_SYSTEMS:
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
        ("tree_read kiln / kiln-old MB/s", get("tree_read", "kiln", "mb_s"),
         get("tree_read", "kiln-old", "mb_s"), None),
        ("ls_lR kiln-old / kiln time", get("ls_lR", "kiln-old", "s"), get("ls_lR", "kiln", "s"),
         None),
        ("untar kiln-old / kiln time", get("untar", "kiln-old", "s"), get("untar", "kiln", "s"),
         None),
    ]:
        if not (num and den):
            continue  # a system not run
        v = num / den
        out.append({"ratio": name, "value": v, "target": target,
                    "pass": None if target is None else v >= target})
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
    p.add_argument("--old-kiln-bin", type=Path,
                   help="a baseline kiln binary, run as system kiln-old beside kiln")
    p.add_argument("--jobs", default=",".join(JOBS),
                   help=f"comma-separated jobs to run (default {','.join(JOBS)})")
    p.add_argument("--systems", default="tmpfs,kiln,gluster",
                   help="comma-separated systems to run (of tmpfs, kiln, gluster, kiln-old; "
                        "default tmpfs,kiln,gluster, and kiln-old with --old-kiln-bin)")
    args = p.parse_args(argv)
    args.systems = [x for x in args.systems.split(",") if x]
    args.jobs = [x for x in args.jobs.split(",") if x]
    if not args.jobs or any(j not in JOBS for j in args.jobs):
        p.error(f"--jobs: pick from {', '.join(JOBS)}")
    if args.old_kiln_bin and "kiln-old" not in args.systems:
        args.systems.append("kiln-old")
    unknown = [x for x in args.systems if x not in ALL_SYSTEMS]
    if unknown or not args.systems:
        p.error(f"--systems: unknown {unknown} (pick from {', '.join(ALL_SYSTEMS)})")
    if "kiln-old" in args.systems and not args.old_kiln_bin:
        p.error("--systems kiln-old needs --old-kiln-bin")
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
        for system in ALL_SYSTEMS:
            m = med.get(job, {}).get(system)
            if m:
                extra = f"  {m['mb_s']:8.1f} MB/s" if "mb_s" in m else ""
                print(f"  {job:9} {system:8} {m['s']:8.2f} s{extra}", file=sys.stderr)
    for r in rats:
        verdict = ("" if r["pass"] is None
                   else f"  >= {r['target']:<5} {'PASS' if r['pass'] else 'FAIL'}")
        print(f"  {r['ratio']:32} {r['value']:6.2f}{verdict}", file=sys.stderr)
    emit({"config": vars(args) | {"kiln_bin": str(b.kiln_bin), "out": args.out,
                                  "old_kiln_bin": args.old_kiln_bin and str(args.old_kiln_bin)},
          "tree": {"files": b.tree_files, "bytes": b.tree_bytes},
          "medians": med, "ratios": rats, "runs": b.runs, "failures": b.failures}, args.out)
    return 1 if b.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
