#!/usr/bin/env bash
# Fuzzes every decoder a peer can reach with libFuzzer (cargo-fuzz), for a bounded time each:
#   scripts/fuzz.sh [SECONDS_PER_TARGET [TARGET...]]   (default 60 s, 0 = until interrupted;
#   every target)
# The targets are the [[bin]]s of fuzz/Cargo.toml (`cargo fuzz list`), so a new one is picked up
# by itself: frame and fop_args (Kiln frames and fop arguments), nbd_option and nbd_request
# (the NBD handshake options and transmission requests), tls_record (the TLS record layer).
# Needs a nightly toolchain (rustup toolchain install nightly); installs cargo-fuzz from
# crates.io if missing. Crashes land in fuzz/artifacts/<target>/ with the input that caused
# them (replay: cd fuzz && cargo +nightly fuzz run TARGET artifacts/TARGET/crash-...); the
# corpus grows in fuzz/corpus/<target>/. KILN_FUZZ_QUIET=1 prints one summary line per target
# (and the tail of libFuzzer's output if it fails) instead of libFuzzer's progress.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
CARGO_FUZZ_VERSION=0.13.2
secs=${1:-60}
[ $# -gt 0 ] && shift
[[ $secs =~ ^[0-9]+$ ]] || { echo "fuzz.sh: SECONDS_PER_TARGET must be a number, not $secs" >&2; exit 1; }
rustup run nightly rustc --version >/dev/null 2>&1 || { echo "fuzz.sh: needs a nightly toolchain (rustup toolchain install nightly)" >&2; exit 1; }
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list)
[ ${#targets[@]} -gt 0 ] || { echo "fuzz.sh: no fuzz targets in fuzz/Cargo.toml" >&2; exit 1; }

# KILN_FUZZ_DEV=1 builds without optimisation: a few times faster to build and slower to
# run, the trade a short smoke run in CI wants (a long hunt wants the default).
mode=()
[ "${KILN_FUZZ_DEV:-0}" = 1 ] && mode=(--dev)
echo "== building the fuzz targets${mode[*]:+ (${mode[*]})}: ${targets[*]}"
cargo +nightly fuzz build "${mode[@]}"
for t in "${targets[@]}"; do
  echo "== fuzzing $t for ${secs}s"
  # A run stuck on one input for 60 s is a hang, and reported as a crash.
  args=(-max_total_time="$secs" -timeout=60)
  if [ "${KILN_FUZZ_QUIET:-0}" = 1 ]; then
    log=$(mktemp)
    if ! cargo +nightly fuzz run "${mode[@]}" "$t" -- "${args[@]}" >"$log" 2>&1; then
      tail -n 60 "$log" >&2
      rm -f "$log"
      echo "fuzz.sh: fuzzing $t failed (a crashing input, if any, is in fuzz/artifacts/$t/)" >&2
      exit 1
    fi
    grep -E '^#[0-9]+[[:space:]]+DONE' "$log" || tail -n 1 "$log"
    rm -f "$log"
  else
    cargo +nightly fuzz run "${mode[@]}" "$t" -- "${args[@]}"
  fi
done
