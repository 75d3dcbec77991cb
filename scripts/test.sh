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

# Real clients the end-to-end tests drive: the FUSE helpers, qemu-img, nbdinfo and fio.
need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
command -v qemu-img >/dev/null 2>&1 || need+=(qemu-utils)
command -v nbdinfo >/dev/null 2>&1 || need+=(libnbd-bin)
command -v fio >/dev/null 2>&1 || need+=(fio)
command -v cc >/dev/null 2>&1 || need+=(gcc)
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing ${need[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -e /dev/fuse ] || { echo "test.sh: /dev/fuse is missing; the FUSE tests need it (modprobe fuse)" >&2; exit 1; }

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked
