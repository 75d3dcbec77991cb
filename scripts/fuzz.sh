#!/usr/bin/env bash
# Fuzzes the frame decoder and every fop's argument decoder with libFuzzer (cargo-fuzz), for a
# bounded time each: scripts/fuzz.sh [SECONDS_PER_TARGET] (default 60). Needs a nightly
# toolchain (rustup toolchain install nightly); installs cargo-fuzz from crates.io if missing.
# Crashes land in fuzz/artifacts/<target>/ with the input that caused them.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
rustup run nightly rustc --version >/dev/null 2>&1 || { echo "fuzz.sh: needs a nightly toolchain (rustup toolchain install nightly)" >&2; exit 1; }
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
for t in frame fop_args; do
  echo "== fuzzing $t for ${secs}s"
  cargo +nightly fuzz run "$t" -- -max_total_time="$secs"
done
