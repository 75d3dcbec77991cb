#!/usr/bin/env bash
# kiln nbd vs qemu-nbd on GlusterFS: the same fio nbd jobs against both NBD exports.
#
#   bench/nbd_compare.sh [--reps N] [--runtime S] [--size SIZE] [--out FILE]
#                        [--keep-gluster] [--no-build] [--only kiln|qemu]
#
# Kiln side:  target/release/kiln server --brick DIR --listen unix:...   (DIR on a tmpfs this
#             script mounts at /tmp/kiln-nbd-bench/tmpfs and unmounts at the end), and
#             target/release/kiln nbd unix:...:/bench/bench.img --listen unix:.../kiln.nbd
# Reference:  qemu-nbd -f raw -t --socket=... gluster://HOST/dist/bench.img, QEMU's gluster
#             block driver (Debian package qemu-block-extra) on the "dist" volume of
#             ../shared/bench/gluster.sh (one brick on tmpfs, performance translators off).
#
# Both images are SIZE (default 1g) and laid out by one sequential write pass first, so reads
# read real data. Jobs, each run with fio's nbd engine (libnbd) for --runtime seconds (default
# 10):
#   seqread_128k_qd32   --rw=read     --bs=128k --iodepth=32     target: Kiln MB/s >= 2x
#   randread_4k_qd1     --rw=randread --bs=4k   --iodepth=1      target: Kiln IOPS >= 2x
# Every repetition (--reps, default 3) runs each job on both sides back to back, the order
# flipping each time; reported numbers are medians over repetitions, ratios are ratios of
# medians. Server CPU is utime+stime of the serving processes over the run (kiln nbd + kiln
# server; qemu-nbd + the gluster brick process). MB = 10^6 bytes.
#
# Needs root (apt-get, mount). Installs fio, qemu-utils, qemu-block-extra and python3 when
# missing; stops everything it started at the end (also on Ctrl-C), and runs gluster.sh down
# only if it brought GlusterFS up itself and --keep-gluster was not given.
set -euo pipefail

REPS=3
RUNTIME=10
SIZE=1g
OUT=""
KEEP_GLUSTER=0
BUILD=1
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2 ;;
    --runtime) RUNTIME=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --keep-gluster) KEEP_GLUSTER=1; shift ;;
    --no-build) BUILD=0; shift ;;
    --only) ONLY=$2; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "nbd_compare.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$ONLY" in ""|kiln|qemu) ;; *) echo "nbd_compare.sh: --only kiln or --only qemu" >&2; exit 2 ;; esac

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
GLUSTER_SH="$root/../shared/bench/gluster.sh"
WORK=/tmp/kiln-nbd-bench
TMPFS=$WORK/tmpfs
KILN="$root/target/release/kiln"
RESULTS=$WORK/results.jsonl
GHOST=$(hostname)

log() { echo "nbd_compare: $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (apt-get, mount)"
want_kiln() { [ "$ONLY" != qemu ]; }
want_qemu() { [ "$ONLY" != kiln ]; }

# ---------------------------------------------------------------- set-up and clean-up

KILND_PID="" NBD_PID="" QNBD_PID="" MOUNTED=0 STARTED_GLUSTER=0
cleanup() {
  local p
  for p in $NBD_PID $QNBD_PID $KILND_PID; do
    kill "$p" 2>/dev/null || true
  done
  for p in $NBD_PID $QNBD_PID $KILND_PID; do
    wait "$p" 2>/dev/null || true
  done
  if [ "$MOUNTED" = 1 ]; then
    umount "$TMPFS" 2>/dev/null || umount -l "$TMPFS" || true
    log "unmounted $TMPFS"
  fi
  if [ "$STARTED_GLUSTER" = 1 ] && [ "$KEEP_GLUSTER" = 0 ]; then
    log "gluster.sh down"
    "$GLUSTER_SH" down >/dev/null 2>&1 || log "gluster.sh down failed"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

need=()
command -v fio >/dev/null || need+=(fio)
command -v python3 >/dev/null || need+=(python3)
if want_qemu; then
  command -v qemu-nbd >/dev/null || need+=(qemu-utils)
  dpkg -s qemu-block-extra >/dev/null 2>&1 || need+=(qemu-block-extra)
fi
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd engine (Debian's fio has it)"

rm -rf "$WORK/run" && mkdir -p "$WORK/run" "$TMPFS"
: >"$RESULTS"

# Waits up to 20 s for the Unix socket $1 to appear; $2 is the PID that should create it.
wait_socket() {
  local i
  for i in $(seq 1 200); do
    [ -S "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# CPU seconds (utime+stime) of the given PIDs, summed.
cpu_s() {
  python3 - "$@" <<'PY'
import os, sys
t = 0
for pid in sys.argv[1:]:
    try:
        s = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    f = s[s.rindex(")") + 2:].split()
    t += int(f[11]) + int(f[12])
print(t / os.sysconf("SC_CLK_TCK"))
PY
}

NBD=()
if want_kiln; then
  if [ "$BUILD" = 1 ]; then
    log "cargo build --release --bin kiln"
    (cd "$root" && cargo build --release --bin kiln >&2)
  fi
  [ -x "$KILN" ] || die "$KILN not built (drop --no-build)"
  NBD=("$KILN" nbd)

  if ! mountpoint -q "$TMPFS"; then
    mount -t tmpfs -o size=4g kiln-nbd-bench "$TMPFS"
    MOUNTED=1
  fi
  mkdir -p "$TMPFS/brick"
  rm -f "$TMPFS/brick/bench.img"
  truncate -s "$SIZE" "$TMPFS/brick/bench.img"
  "$KILN" server --brick "$TMPFS/brick" --listen "unix:$WORK/run/kilnd.sock" \
    >"$WORK/run/kilnd.log" 2>&1 &
  KILND_PID=$!
  wait_socket "$WORK/run/kilnd.sock" "$KILND_PID" || die "kiln server did not start: $(tail -3 "$WORK/run/kilnd.log")"
  "${NBD[@]}" "unix:$WORK/run/kilnd.sock:/bench/bench.img" --listen "unix:$WORK/run/kiln.nbd" \
    >"$WORK/run/kiln-nbd.log" 2>&1 &
  NBD_PID=$!
  wait_socket "$WORK/run/kiln.nbd" "$NBD_PID" || die "kiln nbd did not start: $(tail -3 "$WORK/run/kiln-nbd.log")"
  KILN_URI="nbd+unix:///bench.img?socket=$WORK/run/kiln.nbd"
  log "kiln nbd (pid $NBD_PID) on kiln server (pid $KILND_PID): $KILN_URI"
  log "laying out bench.img ($SIZE) through kiln nbd with one write pass"
  fio --ioengine=nbd --uri="$KILN_URI" --name=layout --rw=write --bs=1m --iodepth=8 \
    --size="$SIZE" --output=/dev/null || die "layout through kiln nbd failed"
fi

if want_qemu; then
  [ -x "$GLUSTER_SH" ] || die "$GLUSTER_SH not found (the shared/ dir beside the repo)"
  gpid=$("$GLUSTER_SH" pids dist 2>/dev/null | head -1 || true)
  if [ -z "$gpid" ] || ! kill -0 "$gpid" 2>/dev/null; then STARTED_GLUSTER=1; fi
  log "gluster.sh up"
  "$GLUSTER_SH" up >&2
  BRICK_PIDS=$("$GLUSTER_SH" pids dist | tail -n +2 | tr '\n' ' ')
  [ -n "${BRICK_PIDS// }" ] || die "no brick process for volume dist"
  log "laying out bench.img ($SIZE) on GlusterFS with one write pass"
  "$GLUSTER_SH" fio dist --filename=bench.img --thread --name=layout --rw=write --bs=1m \
    --iodepth=8 --size="$SIZE" --output=/dev/null >/dev/null 2>&1 || die "GlusterFS layout failed"
  qemu-nbd -f raw -t -e 8 --socket="$WORK/run/qemu.nbd" "gluster://$GHOST/dist/bench.img" \
    >"$WORK/run/qemu-nbd.log" 2>&1 &
  QNBD_PID=$!
  wait_socket "$WORK/run/qemu.nbd" "$QNBD_PID" || die "qemu-nbd did not start: $(tail -3 "$WORK/run/qemu-nbd.log")"
  QEMU_URI="nbd+unix:///?socket=$WORK/run/qemu.nbd"
  log "qemu-nbd (pid $QNBD_PID) on gluster://$GHOST/dist/bench.img, brick pid(s) $BRICK_PIDS"
fi

# ---------------------------------------------------------------- measuring

# run_job SIDE JOB URI PIDS... : one fio run; appends a JSON line to $RESULTS.
run_job() {
  local side=$1 job=$2 uri=$3; shift 3
  local args
  case "$job" in
    seqread_128k_qd32) args=(--rw=read --bs=128k --iodepth=32) ;;
    randread_4k_qd1) args=(--rw=randread --bs=4k --iodepth=1) ;;
  esac
  local before after json=$WORK/run/fio.json
  before=$(cpu_s "$@")
  fio --ioengine=nbd --uri="$uri" --name=j "${args[@]}" --runtime="$RUNTIME" --time_based \
    --lat_percentiles=1 --percentile_list=50:99 --output-format=json --output="$json" \
    || die "fio $side $job failed: $(tail -3 "$json")"
  after=$(cpu_s "$@")
  python3 - "$side" "$job" "$before" "$after" "$RESULTS" "$json" <<'PY'
import json, sys
side, job, before, after, results, path = sys.argv[1:]
text = open(path).read()
doc = json.loads(text[text.index("{"):])
j = doc["jobs"][0]
if j.get("error"):
    sys.exit(f"fio job error {j['error']}")
r = j["read"]
pct = (r.get("lat_ns") or {}).get("percentile") or (r.get("clat_ns") or {}).get("percentile") or {}
rec = {
    "side": side, "job": job,
    "mb_s": r["bw_bytes"] / 1e6, "iops": r["iops"],
    "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3,
    "server_cpu_s": float(after) - float(before),
}
rec["mb_per_server_cpu_s"] = r["io_bytes"] / 1e6 / rec["server_cpu_s"] if rec["server_cpu_s"] > 0 else None
open(results, "a").write(json.dumps(rec) + "\n")
print(f"  {side:5} {job:18} {rec['mb_s']:9.1f} MB/s {rec['iops']:9.0f} IOPS  p50 {rec['p50_us']:7.1f} us"
      f"  p99 {rec['p99_us']:7.1f} us  server CPU {rec['server_cpu_s']:5.2f} s", file=sys.stderr)
PY
}

for rep in $(seq 1 "$REPS"); do
  log "repetition $rep/$REPS"
  if [ $((rep % 2)) = 1 ]; then order="kiln qemu"; else order="qemu kiln"; fi
  for job in seqread_128k_qd32 randread_4k_qd1; do
    for side in $order; do
      if [ "$side" = kiln ] && want_kiln; then
        run_job kiln "$job" "$KILN_URI" "$NBD_PID" "$KILND_PID"
      elif [ "$side" = qemu ] && want_qemu; then
        # shellcheck disable=SC2086
        run_job qemu "$job" "$QEMU_URI" "$QNBD_PID" $BRICK_PIDS
      fi
    done
  done
done

# ---------------------------------------------------------------- report

python3 - "$RESULTS" "$OUT" "$REPS" "$RUNTIME" "$SIZE" <<'PY'
import json, statistics, sys
results, out, reps, runtime, size = sys.argv[1:]
recs = [json.loads(l) for l in open(results) if l.strip()]
med = {}
for side in ("kiln", "qemu"):
    for job in ("seqread_128k_qd32", "randread_4k_qd1"):
        rs = [r for r in recs if r["side"] == side and r["job"] == job]
        if not rs:
            continue
        med[(side, job)] = {k: statistics.median(r[k] for r in rs if r[k] is not None)
                            for k in ("mb_s", "iops", "p50_us", "p99_us", "server_cpu_s")}
print(f"\nmedians over {reps} repetitions, {runtime} s each, {size} image "
      "(kiln = kiln nbd on a Kiln brick; qemu = qemu-nbd on GlusterFS via QEMU's gluster driver)")
print(f"{'job':20} {'side':5} {'MB/s':>9} {'IOPS':>9} {'p50 us':>8} {'p99 us':>8} {'srv CPU s':>9}")
for (side, job), m in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"{job:20} {side:5} {m['mb_s']:9.1f} {m['iops']:9.0f} {m['p50_us']:8.1f} {m['p99_us']:8.1f} "
          f"{m['server_cpu_s']:9.2f}")
ratios = {}
for job, key, unit in (("seqread_128k_qd32", "mb_s", "MB/s"), ("randread_4k_qd1", "iops", "IOPS")):
    k, q = med.get(("kiln", job)), med.get(("qemu", job))
    if k and q and q[key] > 0:
        ratios[job] = k[key] / q[key]
        verdict = "PASS" if ratios[job] >= 2 else "FAIL"
        print(f"ratio {job}: kiln/qemu {unit} = {ratios[job]:.2f}  (target >= 2: {verdict})")
doc = {"reps": int(reps), "runtime_s": int(runtime), "size": size, "runs": recs,
       "medians": {f"{s}/{j}": m for (s, j), m in med.items()}, "ratios": ratios}
if out:
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"JSON written to {out}")
PY
