#!/usr/bin/env bash
# Small files on Kiln FUSE vs GlusterFS FUSE vs tmpfs: see bench/README.md or --help.
# Thin wrapper: makes sure python3 is there, then hands everything to tree.py.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! command -v python3 >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3 >/dev/null
fi
exec python3 "$here/tree.py" "$@"
