#!/usr/bin/env bash
# Builds the Debian package `kiln` (target/debian/kiln_VERSION-1_amd64.deb): kiln, kilnd and
# its systemd unit, libkiln (kiln.h, kiln.pc), man pages, bash completion, the mount helpers.
# What goes where is [package.metadata.deb] in crates/cli/Cargo.toml.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/package.sh [--no-build] [--profile NAME]

Builds kiln, kilnd and libkiln in release mode, generates the man pages, the bash completion
and kiln.pc into target/package/, and packages them with cargo-deb (pinned; installed into
~/.cache/kiln/tools or $KILN_TOOLS_DIR unless that version is on PATH). Prints the .deb's path
as its last line.

  --no-build   package the release binaries already in the target directory
  --profile P  package the binaries of cargo profile P instead of release (CI tests the
               package with the dev build it already has: same files, faster)
  -h, --help   this text
EOF
}

build=1 profile=release
while [ $# -gt 0 ]; do
    case $1 in
        --no-build) build=0 ;;
        --profile) [ $# -ge 2 ] || { usage >&2; exit 2; }; profile=$2; shift ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
    shift
done

die() { echo "package.sh: $*" >&2; exit 1; }

cd "$(dirname "$0")/.."
root=$PWD
cargo_deb_version=3.8.0
# Pinned tools are built once per machine, outside any checkout (a fresh clone does not build
# them again); KILN_TOOLS_DIR puts them elsewhere.
tools=${KILN_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/tools}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)

# The asset paths name the amd64 multiarch directory and the library's versioned file name.
arch=$(dpkg --print-architecture)
[ "$arch" = amd64 ] || die "the assets in crates/cli/Cargo.toml are for amd64, not $arch"
grep -q "libkiln.so.$version\"" crates/cli/Cargo.toml \
    || die "crates/cli/Cargo.toml packages libkiln under another version than $version"

# cargo-deb, exactly this version: its maintainer-script fragments are part of the package.
cargo_deb=
if [ "$(cargo-deb --version 2>/dev/null)" = "cargo-deb $cargo_deb_version" ]; then
    cargo_deb=$(command -v cargo-deb)
elif [ "$("$tools/bin/cargo-deb" --version 2>/dev/null)" = "cargo-deb $cargo_deb_version" ]; then
    cargo_deb=$tools/bin/cargo-deb
else
    echo "package.sh: installing cargo-deb $cargo_deb_version into $tools" >&2
    cargo install cargo-deb --version "=$cargo_deb_version" --locked --root "$tools" >&2
    cargo_deb=$tools/bin/cargo-deb
fi

target=$(cargo metadata --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target" ] || die "cannot find the target directory (cargo metadata)"
# Cargo's directory for the profile: dev builds land in debug/.
case $profile in dev | test) release=$target/debug ;; *) release=$target/$profile ;; esac

if [ "$build" = 1 ]; then
    cargo build --profile "$profile" --locked -p kiln-cli -p kilnd -p kiln-capi >&2
fi
for f in kiln kilnd libkiln.so; do
    [ -f "$release/$f" ] || die "$release/$f is missing (build it, or drop --no-build)"
done
# Programs linked against libkiln record this name; a library without it cannot be upgraded
# in place.
# (grep reads all of readelf's output: with -q and pipefail an early exit could fail the pipe.)
grep -q 'SONAME.*\[libkiln\.so\.0\]' < <(readelf -d "$release/libkiln.so") \
    || die "$release/libkiln.so has no SONAME libkiln.so.0"

# Generated from the binary just built, so they match its --help.
stage=$root/target/package
rm -rf "$stage/man" "$stage/completions" "$stage/kiln.pc"
mkdir -p "$stage/man" "$stage/completions"
"$release/kiln" generate man "$stage/man" >&2
"$release/kiln" generate completions bash >"$stage/completions/kiln.bash"
[ -s "$stage/completions/kiln.bash" ] || die "empty bash completion"
# The template's libdir is PREFIX/lib; Debian keeps libraries in the multiarch directory.
sed -e "s|@PREFIX@|/usr|" -e "s|@VERSION@|$version|" \
    -e 's|^libdir=.*|libdir=${prefix}/lib/x86_64-linux-gnu|' \
    crates/capi/kiln.pc.in >"$stage/kiln.pc"

# --no-strip: the release profile strips the binaries already (release-debug keeps symbols).
# A dev build is packaged with fast compression: it is for tests, and ten times the size.
fast=()
[ "$profile" = release ] || fast=(--fast)
out=$("$cargo_deb" -p kiln-cli --no-build --no-strip --profile "$profile" "${fast[@]}" \
    -o "$target/debian/")
deb=$(printf '%s\n' "$out" | tail -n 1)
[ -f "$deb" ] || die "cargo-deb made no package ($out)"
ls -l "$release/kiln" "$release/kilnd" "$release/libkiln.so" "$deb" >&2
echo "$deb"
