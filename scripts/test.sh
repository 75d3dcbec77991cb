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

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked
