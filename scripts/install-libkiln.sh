#!/usr/bin/env bash
# Builds libkiln in release mode and installs libkiln.so, kiln.h and kiln.pc under PREFIX
# (default /usr/local), so that `pkg-config --cflags --libs kiln` works for C programs.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-/usr/local}
cargo build --release -p kiln-capi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
install -d "$prefix/lib" "$prefix/include" "$prefix/lib/pkgconfig"
# The library's SONAME is libkiln.so.0 (crates/capi/build.rs): programs load that name, the
# linker finds libkiln.so, and both point at the versioned file.
install -m 0755 target/release/libkiln.so "$prefix/lib/libkiln.so.$version"
ln -sf "libkiln.so.$version" "$prefix/lib/libkiln.so.0"
ln -sf libkiln.so.0 "$prefix/lib/libkiln.so"
install -m 0644 crates/capi/include/kiln.h "$prefix/include/kiln.h"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" crates/capi/kiln.pc.in >"$prefix/lib/pkgconfig/kiln.pc"
echo "installed libkiln $version under $prefix (PKG_CONFIG_PATH=$prefix/lib/pkgconfig)"
