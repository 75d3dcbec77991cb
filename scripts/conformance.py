#!/usr/bin/env python3
"""POSIX conformance: the pjdfstest suite, run as root inside real Kiln mounts.

Three setups, made the way an operator makes them (a kilnd management daemon, `kiln volume
create/start`, `kiln mount SERVER:/VOL`):

  general     one brick, the general (page cache) mount
  vm-image    one brick, the vm-image (direct I/O) mount
  replica-3   a replica-3 volume of three bricks, the general mount

pjdfstest (the Rust rewrite, pinned below, built with `cargo install`) runs every test it
has as root, switching to the users `nobody` and `tests` where a test does so. Tests that
do not pass (expected failures, and tests the suite skips) are listed with the reason in
tests/conformance/exclusions.txt; the run fails on any other failure or skip and on a listed
test that passes, so the list only shrinks. Prints per-group counts for each setup, then one
JSON summary line.

Usage: scripts/conformance.py [--setup NAME]... [--keep] [PATTERN...]
  PATTERN  pjdfstest test-name patterns (e.g. chmod), default all.
Needs root, /dev/fuse, apt-get and cargo. Installs what is missing: libacl1-dev, acl and
rsync (apt), pjdfstest (cargo install, into ~/.cache/kiln/tools or KILN_TOOLS_DIR), the suite's
second dummy user `tests`, and scripts/mount.fuse.kiln as /usr/sbin/mount.fuse.kiln (so that
`mount -o remount,ro` of a Kiln mount works).
"""
import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PJDFSTEST_VERSION = "0.2.2"
# Pinned tools are built once per machine, outside any checkout (as scripts/package.sh does).
TOOLS = Path(os.environ.get("KILN_TOOLS_DIR") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln" / "tools")
PJDFSTEST = TOOLS / "bin" / "pjdfstest"
EXCLUSIONS = ROOT / "tests" / "conformance" / "exclusions.txt"
SETUPS = ["general", "vm-image", "replica-3"]
MGMT_PORT = 24507
BRICK_PORT_BASE = 24600


def log(msg):
    print(f"conformance: {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def install():
    """libacl (pjdfstest links it), the pinned pjdfstest, and its second dummy user."""
    need = [p for p in ("libacl1-dev", "acl", "rsync")
            if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if need:
        log(f"installing {' '.join(need)}")
        run(["apt-get", "install", "-y", "-qq", *need],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=subprocess.DEVNULL)
    have = ""
    if PJDFSTEST.exists():
        meta = TOOLS / ".crates.toml"
        have = meta.read_text() if meta.exists() else ""
    if f'"pjdfstest {PJDFSTEST_VERSION} ' not in have:
        log(f"building pjdfstest {PJDFSTEST_VERSION} (cargo install, once)")
        run(["cargo", "install", "--quiet", "pjdfstest", "--version", PJDFSTEST_VERSION,
             "--locked", "--root", str(TOOLS)])
    # The suite remounts the file system read-only (`mount -o remount,ro`) for its EROFS
    # tests; mount(8) hands a fuse.kiln mount to this helper.
    helper = Path("/usr/sbin/mount.fuse.kiln")
    ours = ROOT / "scripts" / "mount.fuse.kiln"
    if not helper.exists() or helper.read_bytes() != ours.read_bytes():
        log(f"installing {helper}")
        shutil.copy(ours, helper)
        helper.chmod(0o755)
    if subprocess.run(["id", "tests"], capture_output=True).returncode != 0:
        log("creating the dummy user `tests`")
        run(["newusers"], input=b"tests:x:::pjdfstest dummy user:/:/usr/sbin/nologin\n")


def exclusions():
    """setup -> {"fail": {test: reason}, "skip": {test: reason}} from the list."""
    out = {s: {"fail": {}, "skip": {}} for s in SETUPS}
    for n, line in enumerate(EXCLUSIONS.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"(fail|skip)\s+(\S+)\s+(\S+)\s+--\s+(.+)", line)
        if not m:
            sys.exit(f"{EXCLUSIONS}:{n}: want `fail|skip SETUPS TEST -- REASON`, got {line!r}")
        setups = SETUPS if m[2] == "all" else m[2].split(",")
        for s in setups:
            if s not in out:
                sys.exit(f"{EXCLUSIONS}:{n}: unknown setup {s!r} (want all or {SETUPS})")
            out[s][m[1]][m[3]] = m[4]
    return out


def target_dir() -> Path:
    """Where cargo puts this workspace's builds: CARGO_TARGET_DIR when set (scripts/test.sh
    shares one across clones), else what cargo says (a config may move it), else target/."""
    if os.environ.get("CARGO_TARGET_DIR"):
        return Path(os.environ["CARGO_TARGET_DIR"])
    try:
        out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout
        return Path(json.loads(out)["target_directory"])
    except (OSError, subprocess.CalledProcessError, KeyError, ValueError):
        return ROOT / "target"


class Cluster:
    """A kilnd management daemon on a state directory, its volumes and their mounts."""

    def __init__(self, work: Path):
        self.work = work
        self.state = work / "state"
        built = target_dir() / "debug"
        self.kiln = built / "kiln"
        self.kilnd = built / "kilnd"
        self.procs = []
        self.mounts = []
        self.env = {**os.environ, "KILN_MGMT_SECRET_FILE": str(self.state / "mgmt.secret")}
        self.server = f"tcp:127.0.0.1:{MGMT_PORT}"

    def start(self):
        self.state.mkdir(parents=True)
        d = subprocess.Popen(
            [str(self.kilnd), "--state-dir", str(self.state), "--mgmt", self.server,
             "--brick-port-base", str(BRICK_PORT_BASE), "--metrics", "off"],
            stdout=subprocess.PIPE, stderr=open(self.work / "kilnd.log", "w"), text=True)
        self.procs.append(d)
        line = d.stdout.readline()
        if "management on" not in line:
            raise RuntimeError(f"kilnd did not start: {line!r} (see {self.work}/kilnd.log)")

    def volume(self, name, bricks, replica=1):
        args = ["volume", "create", name]
        if replica > 1:
            args += ["replica", str(replica)]
        args += [f"127.0.0.1:{self.work / 'bricks' / b}" for b in bricks]
        for a in (args, ["volume", "start", name]):
            run([str(self.kiln), *a, "--server", self.server], env=self.env,
                stdout=subprocess.DEVNULL)

    def mount(self, name, mode):
        # Short: the suite binds Unix sockets in it (108 bytes of address at most).
        mnt = self.work / "m" / f"{name[0]}{mode[0]}"
        mnt.mkdir(parents=True)
        m = subprocess.Popen(
            [str(self.kiln), "mount", f"127.0.0.1:{MGMT_PORT}:/{name}", str(mnt), "--mode", mode,
             "--metrics", "off"],
            stdout=subprocess.PIPE, stderr=open(self.work / f"mount-{name}-{mode}.log", "w"),
            text=True, env={**self.env, "KILN_SECRET_FILE": str(self.state / "vols" / name / "secret")})
        self.procs.append(m)
        line = m.stdout.readline()
        if "mounted" not in line:
            raise RuntimeError(f"mount {name} ({mode}) failed: {line!r}")
        self.mounts.append((m, mnt))
        # The suite switches to other users inside: they must reach the mount.
        for p in (self.work, self.work / "m"):
            p.chmod(0o755)
        return mnt

    def stop(self):
        for m, mnt in reversed(self.mounts):
            subprocess.run([str(self.kiln), "umount", str(mnt)], capture_output=True)
            try:
                m.wait(timeout=20)
            except subprocess.TimeoutExpired:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        for name in ("single", "rep3"):
            for a in (["volume", "stop", name, "--yes"], ["volume", "delete", name, "--yes"]):
                subprocess.run([str(self.kiln), *a, "--server", self.server], env=self.env,
                               capture_output=True)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def config(work: Path, setup: str, expected: dict) -> Path:
    c = work / f"pjdfstest-{setup}.toml"
    fails = ",\n".join(f'  "{t}"' for t in sorted(expected))
    c.write_text(f"""[features]
posix_fallocate = {{}}
utimensat = {{}}
utime_now = {{}}
rename_ctime = {{}}

[settings]
naptime = 0.01
allow_remount = true
expected_failures = [
{fails}
]

[dummy_auth]
entries = [["nobody", "nogroup"], ["tests", "tests"]]
""")
    return c


RESULT = re.compile(r"^(\S+)\s+(ok|FAILED|skipped|failed as expected|PASSED UNEXPECTEDLY)\s*$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# pjdfstest 0.2.2 leaks descriptors open for writing (open::einval_invalid_combination,
# posix_fallocate::affected_only_create_flags), and a file system with a file open for
# writing cannot be remounted read-only: every EROFS test after them fails with "mount point
# is busy", on tmpfs too. Each group runs in a pjdfstest process of its own, so a leak ends
# with its group (whose EROFS tests run before the leaking ones).
GROUPS = ["chmod", "chown", "ftruncate", "link", "mkdir", "mkfifo", "mknod", "open",
          "posix_fallocate", "rename", "rmdir", "symlink", "truncate", "unlink", "utimensat"]
# Patterns match the untrimmed name, pjdfstest::tests::GROUP::..., so these match one group.
BATCHES = [[f"tests::{g}::"] for g in GROUPS]


def suite(work, setup, mnt, secondary, excluded, patterns):
    """Runs pjdfstest in `mnt`; returns (passed?, {group: Counter(outcome)}, failures)."""
    conf = config(work, setup, excluded["fail"])
    groups = collections.defaultdict(collections.Counter)
    failures = []
    ok = True
    t0 = time.monotonic()
    for n, batch in enumerate([patterns] if patterns else BATCHES):
        cmd = [str(PJDFSTEST), "-c", str(conf), "-p", str(mnt), "-s", str(secondary), *batch]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        out = ANSI.sub("", r.stdout)
        (work / f"pjdfstest-{setup}-{n}.out").write_text(out + ANSI.sub("", r.stderr))
        ok &= r.returncode == 0
        lines = out.splitlines()
        for i, line in enumerate(lines):
            m = RESULT.match(line)
            if not m:
                continue
            name, outcome = m[1], m[2]
            groups[name.split("::")[0]][outcome] += 1
            why = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if outcome == "FAILED":
                failures.append(f"{name}: {why}")
            elif outcome == "PASSED UNEXPECTEDLY":
                failures.append(f"{name}: passes now; take it off {EXCLUSIONS.name}")
            elif outcome == "skipped" and name not in excluded["skip"]:
                failures.append(f"{name}: skipped ({why}) but not listed in {EXCLUSIONS.name}")
            elif outcome != "skipped" and name in excluded["skip"]:
                failures.append(f"{name}: runs now; take its skip off {EXCLUSIONS.name}")
    log(f"{setup}: pjdfstest ran {time.monotonic() - t0:.0f} s")
    return ok and not failures, groups, failures


def make_tree(top: Path):
    """A tree with what archivers must keep: owners, modes (setgid directory too), times,
    symlinks, hard links, FIFOs, devices, sockets' absence aside, and user xattrs."""
    top.mkdir()
    (top / "dir").mkdir(mode=0o755)
    (top / "sgid").mkdir()
    os.chmod(top / "sgid", 0o2775)
    os.chown(top / "sgid", 0, 4242)
    (top / "dir" / "file").write_bytes(os.urandom(100_000))
    (top / "dir" / "small").write_text("small\n")
    os.chown(top / "dir" / "small", 65534, 65534)
    os.chmod(top / "dir" / "small", 0o640)
    os.link(top / "dir" / "file", top / "hardlink")
    os.symlink("dir/file", top / "symlink")
    os.symlink("nowhere", top / "dangling")
    os.mkfifo(top / "fifo", 0o600)
    os.mknod(top / "null", 0o600 | 0o020000, os.makedev(1, 3))
    os.setxattr(top / "dir" / "file", "user.kiln", b"xattr value")
    os.setxattr(top / "dir", "user.dir", b"on a directory")
    os.utime(top / "dir" / "small", (1_000_000_000, 1_100_000_000))
    (top / "sgid" / "inherits").write_text("x")


def differences(a: Path, b: Path) -> list:
    """What `rsync -n -aHAXc --delete` would change to make b like a (nothing when equal)."""
    r = subprocess.run(["rsync", "-n", "-aHAXc", "--delete", "-i", f"{a}/", f"{b}/"],
                       capture_output=True, text=True)
    return [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]


def round_trips(work: Path, mnt: Path) -> list:
    """cp -a, tar -xpf and rsync -aHAX of a tree into the mount and back out; returns what
    differed."""
    src = work / "tree"
    if not src.exists():
        make_tree(src)
    bad = []
    for name, into in [
        ("cp -a", lambda dst: run(["cp", "-a", f"{src}/.", str(dst)])),
        ("tar -xpf", lambda dst: run(f"tar -C {src} --xattrs -cpf - . | "
                                     f"tar -C {dst} --xattrs --xattrs-include='*' -xpf -",
                                     shell=True)),
        ("rsync -aHAX", lambda dst: run(["rsync", "-aHAX", f"{src}/", f"{dst}/"])),
    ]:
        inside = mnt / f"rt-{mnt.name}-{name.split()[0]}"
        inside.mkdir()
        out = work / f"out-{mnt.name}-{name.split()[0]}"
        try:
            into(inside)
            run(["rsync", "-aHAX", f"{inside}/", f"{out}/"])
        except subprocess.CalledProcessError as e:
            bad.append(f"{name}: {e}")
            continue
        for side, d in (("in the mount", inside), ("copied back out", out)):
            diff = differences(src, d)
            if diff:
                bad.append(f"{name}: {side} differs: {diff[:5]}")
    return bad


def owned_on_every_brick(work: Path, mnt: Path, bricks: list) -> list:
    """A file made by a non-root user through the mount belongs to that user on every brick
    of the volume (each replica's copy too); returns what was wrong."""
    d = mnt / f"users-{mnt.name}"
    d.mkdir()
    d.chmod(0o777)
    made = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "sh", "-c", f"umask 022; echo mine > {d}/f && mkdir {d}/sub"],
                          capture_output=True, text=True)
    if made.returncode != 0:
        return [f"as nobody, creating in {d} failed: {made.stderr.strip()}"]
    bad = []
    for b in bricks:
        for name in ("f", "sub"):
            p = work / "bricks" / b / d.name / name
            try:
                st = p.lstat()
            except FileNotFoundError:
                bad.append(f"{p} missing")
                continue
            if (st.st_uid, st.st_gid) != (65534, 65534):
                bad.append(f"{p} belongs to {st.st_uid}:{st.st_gid}, not nobody")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="append", choices=SETUPS,
                    help="run only this setup (repeat for several; default all)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    ap.add_argument("patterns", nargs="*", help="pjdfstest test-name patterns")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("conformance: needs root (the suite tests permissions as several users)")
    install()
    excluded = exclusions()
    run(["cargo", "build", "--quiet", "--locked", "--bin", "kiln", "--bin", "kilnd"], cwd=ROOT)
    work = Path(tempfile.mkdtemp(prefix="kc."))
    secondary = Path(tempfile.mkdtemp(prefix="kiln-conformance-other-", dir="/dev/shm"))
    cluster = Cluster(work)
    summary, ok = {}, True
    try:
        cluster.start()
        cluster.volume("single", ["b0"])
        cluster.volume("rep3", ["r0", "r1", "r2"], replica=3)
        mounts = {
            "general": ("single", "general"),
            "vm-image": ("single", "vm-image"),
            "replica-3": ("rep3", "general"),
        }
        bricks = {"single": ["b0"], "rep3": ["r0", "r1", "r2"]}
        for setup in a.setup or SETUPS:
            mnt = cluster.mount(*mounts[setup])
            passed, groups, failures = suite(work, setup, mnt, secondary, excluded[setup],
                                             a.patterns)
            ok &= passed
            total = collections.Counter()
            print(f"\n== {setup}: per group (ok / failed / expected failures / skipped)")
            for g in sorted(groups):
                c = groups[g]
                total.update(c)
                print(f"  {g:<20} {c['ok']:>4} / {c['FAILED'] + c['PASSED UNEXPECTEDLY']:>3} / "
                      f"{c['failed as expected']:>3} / {c['skipped']:>3}")
            print(f"  {'total':<20} {total['ok']:>4} / "
                  f"{total['FAILED'] + total['PASSED UNEXPECTEDLY']:>3} / "
                  f"{total['failed as expected']:>3} / {total['skipped']:>3}")
            trips = round_trips(work, mnt)
            print(f"  round trips (cp -a, tar -xpf, rsync -aHAX in and out): "
                  f"{'identical' if not trips else 'DIFFERENT'}")
            owners = owned_on_every_brick(work, mnt, bricks[mounts[setup][0]])
            print(f"  a user's files on every brick: {'theirs' if not owners else 'WRONG'}")
            failures += trips + owners
            ok &= not trips and not owners
            for f in failures:
                print(f"  FAILED {f}")
            summary[setup] = {"groups": {g: dict(c) for g, c in sorted(groups.items())},
                              "total": dict(total), "failures": failures}
    finally:
        cluster.stop()
        shutil.rmtree(secondary, ignore_errors=True)
        if a.keep or not ok:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"pjdfstest": PJDFSTEST_VERSION, "ok": ok, "setups": summary}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
