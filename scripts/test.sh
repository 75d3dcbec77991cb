#!/usr/bin/env bash
# Runs every Kiln check: formatting, lints, and all tests (unit, property, golden-vector and
# end-to-end tests against real kilnd processes over real sockets). `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi
command -v cargo >/dev/null 2>&1 || { echo "test.sh: cargo not found; install Rust with rustup" >&2; exit 1; }
for c in rustfmt clippy; do
  if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1; then
    rustup component add "$c"
  fi
done

# Real clients the end-to-end tests drive: the FUSE helpers, qemu-img, nbdinfo and fio; tcpdump
# watches the pool's traffic for secrets; XFS (reflink) bricks on loop devices for snapshots;
# logrotate runs the package's rotation in its install test.
need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
command -v qemu-img >/dev/null 2>&1 || need+=(qemu-utils)
command -v nbdinfo >/dev/null 2>&1 || need+=(libnbd-bin)
command -v fio >/dev/null 2>&1 || need+=(fio)
command -v tcpdump >/dev/null 2>&1 || need+=(tcpdump)
command -v mkfs.xfs >/dev/null 2>&1 || need+=(xfsprogs)
command -v losetup >/dev/null 2>&1 || need+=(mount)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v python3 >/dev/null 2>&1 || need+=(python3)
command -v logrotate >/dev/null 2>&1 || need+=(logrotate)
if [ ${#need[@]} -gt 0 ]; then
  echo "[${SECONDS}s] == installing ${need[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
# The reference parser a test reads /metrics with: the Prometheus project's Python client.
if ! python3 -c 'import prometheus_client' 2>/dev/null; then
  echo "[${SECONDS}s] == installing prometheus-client (Python)"
  python3 -m pip install -q 'prometheus-client==0.21.1' 2>/dev/null \
    || python3 -m pip install -q --break-system-packages 'prometheus-client==0.21.1'
fi
[ -e /dev/fuse ] || { echo "test.sh: /dev/fuse is missing; the FUSE tests need it (modprobe fuse)" >&2; exit 1; }

# Incremental state is kept in the cache (cargo's default for the dev profile): a clone's
# files are all new to cargo, so it recompiles every Kiln crate, and rustc then reuses what
# the last run compiled from the same sources at the same path. Rebuilding the tests of a
# clone that changed nothing took 15 s with it, 275 s without; it costs about 3 GB of disk.
# CARGO_INCREMENTAL=0 turns it off.
# One build cache for every clone on this machine (unless CARGO_TARGET_DIR says otherwise):
# a fresh clone then rebuilds only Kiln's own crates, not the ~400 it depends on. Cargo
# names the workspace's artifacts by their path inside the workspace, so clones in other
# places reuse the same files rather than piling up new ones. The tests, conformance and the
# package run binaries from there, so a second run on the same cache waits for the first.
if [ -z "${CARGO_TARGET_DIR:-}" ]; then
  export CARGO_TARGET_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/kiln/target"
fi
mkdir -p "$CARGO_TARGET_DIR"
if [ -z "${KILN_TEST_LOCKED:-}" ]; then
  # flock -o: the lock is flock's own, so nothing this run starts can keep holding it.
  lock="$CARGO_TARGET_DIR/.kiln-test.lock"
  flock -n -o "$lock" true || echo "[${SECONDS}s] == waiting for the other run using $CARGO_TARGET_DIR"
  KILN_TEST_LOCKED=1 exec flock -o "$lock" "$PWD/scripts/test.sh" "$@"
fi
echo "[${SECONDS}s] == build cache: $CARGO_TARGET_DIR"
# Cargo judges a workspace crate fresh by modification times. After another clone built here,
# this clone's files can be older than what that clone built from other sources, and cargo
# would take that build for this one's: the first run from a different clone touches this
# clone's sources, so they win (a fresh clone's files are newer anyway).
last_clone="$CARGO_TARGET_DIR/.kiln-last-clone"
if [ "$(cat "$last_clone" 2>/dev/null)" != "$PWD" ]; then
  git ls-files -z 2>/dev/null | xargs -0 -r touch -c --
  echo "$PWD" > "$last_clone"
fi

echo "[${SECONDS}s] == cargo fmt --check"
cargo fmt --all -- --check
echo "[${SECONDS}s] == cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The test runner: cargo-nextest, pinned. It starts each test in a process of its own and runs
# several at once; .config/nextest.toml says how many, which start first and which take the
# machine alone. Doc tests are cargo test's own.
# Built unoptimised: it only starts and watches the tests, and that halves its build on a
# fresh machine (3 minutes, not 7).
nextest_version=0.9.151
if [ "$(cargo nextest --version 2>/dev/null | awk 'NR == 1 { print $2 }')" != "$nextest_version" ]; then
  echo "[${SECONDS}s] == installing cargo-nextest $nextest_version"
  cargo install --locked --quiet --debug cargo-nextest --version "$nextest_version" \
    --no-default-features --features default-no-update
fi
echo "[${SECONDS}s] == cargo nextest run"
cargo nextest run --workspace --locked
echo "[${SECONDS}s] == doc tests"
cargo test --workspace --locked --doc

# POSIX conformance: pjdfstest as root inside real mounts (one brick general and vm-image, a
# replica-3 volume), against tests/conformance/exclusions.txt. KILN_CONFORMANCE=0 skips it.
if [ "${KILN_CONFORMANCE:-1}" = 0 ]; then
  echo "[${SECONDS}s] == conformance skipped (KILN_CONFORMANCE=0)"
elif [ "$(id -u)" != 0 ]; then
  echo "[${SECONDS}s] == WARNING: conformance skipped: it needs root (it tests permissions as several users)" >&2
else
  echo "[${SECONDS}s] == POSIX conformance (pjdfstest)"
  python3 scripts/conformance.py
fi

# The Debian package (scripts/package.sh: release build, man pages, completion, cargo-deb),
# installed, used through systemd and /etc/fstab, and purged in a throwaway root with systemd as
# its PID 1 (scripts/install-test.sh). KILN_PACKAGE_TEST=0 skips it.
if [ "${KILN_PACKAGE_TEST:-1}" = 0 ]; then
  echo "[${SECONDS}s] == package test skipped (KILN_PACKAGE_TEST=0)"
elif [ "$(id -u)" != 0 ]; then
  echo "[${SECONDS}s] == WARNING: package test skipped: it needs root (namespaces, mounts, dpkg)" >&2
else
  # The dev build cargo test made, packaged: the same files as the release package without a
  # second, optimised build of everything (scripts/package.sh makes that one).
  echo "[${SECONDS}s] == package install test"
  scripts/install-test.sh --profile dev
fi

# Fuzz every decoder a peer can reach (Kiln frames and fop arguments, NBD options and requests,
# TLS records) for KILN_FUZZ_SECS seconds per target (default 10; 0 skips). The fuzz targets
# build with a nightly toolchain; without one this is skipped with a warning, not failed.
fuzz_secs=${KILN_FUZZ_SECS:-10}
[[ $fuzz_secs =~ ^[0-9]+$ ]] || { echo "test.sh: KILN_FUZZ_SECS must be a number of seconds, not $fuzz_secs" >&2; exit 1; }
if [ "$fuzz_secs" = 0 ]; then
  echo "[${SECONDS}s] == fuzzing skipped (KILN_FUZZ_SECS=0)"
elif ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "[${SECONDS}s] == WARNING: fuzzing skipped: no nightly toolchain (rustup toolchain install nightly)" >&2
else
  # Built unoptimised (KILN_FUZZ_DEV, default 1 here): on a fresh machine that halves the
  # fuzz build (2.5 min, not 5); the short run finds what lies near the surface either way.
  echo "[${SECONDS}s] == fuzzing every target for ${fuzz_secs}s"
  KILN_FUZZ_DEV=${KILN_FUZZ_DEV:-1} KILN_FUZZ_QUIET=1 scripts/fuzz.sh "$fuzz_secs"
fi
echo "[${SECONDS}s] == every check passed"
