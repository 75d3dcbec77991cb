#!/usr/bin/env bash
# Issue 19's install test: the Debian package installed, used and purged on a machine run by
# systemd, with nothing left behind.
#
# The "machine" is a throwaway root: an overlay of the host's / whose changes live on a tmpfs,
# in new mount, PID, network (loopback only), UTS, IPC and cgroup namespaces, with systemd as
# its PID 1. Nothing it does reaches the host's files: when the namespaces end, so does
# everything written there. (systemd must never boot on the host's own root: its tmpfiles
# setup would clean the host's /tmp, and worse.)
#
# The steps: dpkg -i before systemd runs (nothing may start), dpkg --purge, boot systemd,
# dpkg -i again, the files (man pages, completion, libkiln with its SONAME and kiln.pc, a C
# program built against it), `systemctl enable --now kilnd`, a volume, an /etc/fstab line and
# `mount -a`, data through the mount and back, kilnd's /metrics on its configured port, an NBD
# export as a kiln-nbd@ instance read by nbdcopy, logrotate of the bricks' logs, kilnd
# restarted under the mount (the bricks live on), remounts ro and rw, a read-only mount with
# options, the fstab line as a systemd mount unit, umount, volume stop,
# `systemctl disable --now kilnd`, `dpkg --purge kiln`, and then a search of everything the
# root changed for anything of Kiln's.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/install-test.sh [--deb PATH] [--no-build] [--profile NAME] [--keep] [--no-automount]

Installs the kiln package in a throwaway root with systemd as PID 1, uses it and purges it;
prints PASS or FAIL per step and exits non-zero on a failure. Needs root.

  --deb PATH   test this package (default: build one with scripts/package.sh)
  --no-build   passed to scripts/package.sh: package the release binaries already built
  --profile P  passed to scripts/package.sh: package cargo profile P's binaries (dev in CI)
  --keep       keep the work directory (logs) after a successful run
  --no-automount  skip mounting the fstab line through systemd's automount
                  (x-systemd.automount)
  -h, --help   this text
EOF
}

die() { echo "install-test: $*" >&2; exit 2; }

# "MOUNTPOINT TYPE OPTIONS PATH" for each cgroup hierarchy of this host: its mount point,
# cgroup or cgroup2, its controllers (mount options) and this process's cgroup in it.
cgroup_hierarchies() {
    awk 'FNR == NR { i = index($0, ":"); rest = substr($0, i + 1); j = index(rest, ":")
                     path[substr(rest, 1, j - 1)] = substr(rest, j + 1); next }
         { for (i = 7; $i != "-"; i++) ; t = $(i + 1)
           if (t == "cgroup2") { print $5, t, "-", path[""]; next }
           if (t != "cgroup") next
           n = split($(i + 3), o, ","); c = ""
           for (k = 1; k <= n; k++)
               if (o[k] !~ /^(rw|ro|xattr|clone_children|noprefix|release_agent=.*)$/)
                   c = c (c == "" ? "" : ",") o[k]
           if (c in path) print $5, t, c, path[c] }' /proc/self/cgroup /proc/self/mountinfo
}

# --- Inside the namespaces, as their PID 1: build the root, wait for the go, become systemd.
inner() {
    local work=$1 deb=$2
    local ns=$work/ns r=$work/ns/root
    # Never on the host: only as PID 1 of the namespaces made below, with mounts of their own.
    [ $$ = 1 ] || { echo "install-test: --inner is for the test's own namespaces" >&2; exit 2; }
    mount --make-rprivate /
    mount -t tmpfs -o mode=0755 kiln-test "$ns"
    mkdir "$ns/upper" "$ns/work" "$r"
    mount -t overlay -o "lowerdir=/,upperdir=$ns/upper,workdir=$ns/work" kiln-test "$r"

    mount -t proc proc "$r/proc"
    for p in sys sysrq-trigger; do
        [ -e "$r/proc/$p" ] || continue
        mount --bind "$r/proc/$p" "$r/proc/$p"
        mount -o remount,bind,ro "$r/proc/$p"
    done
    # A read-only sysfs of this network namespace: udev and friends stay away from devices.
    mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$r/sys"
    # The cgroup hierarchies, mounted anew in the cgroup namespace: rooted at the cgroups the
    # outer script made for this test, so systemd's units live (and are removed) under them.
    mount -t tmpfs -o mode=0755,nosuid,nodev,noexec cgroup "$r/sys/fs/cgroup"
    local mp type ctl path
    while read -r mp type ctl path; do
        mkdir -p "$r/sys/fs/cgroup/${mp##*/}"
        if [ "$type" = cgroup2 ]; then
            mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$r/sys/fs/cgroup/${mp##*/}"
        else
            case $ctl in name=*) ctl=none,$ctl ;; esac
            mount -t cgroup -o "nosuid,nodev,noexec,$ctl" cgroup "$r/sys/fs/cgroup/${mp##*/}"
        fi
    done < <(cgroup_hierarchies)
    mount -o remount,ro "$r/sys/fs/cgroup"

    # A /dev of its own with the few nodes needed, /dev/fuse among them.
    mount -t tmpfs -o mode=0755,nosuid dev "$r/dev"
    local d
    for d in null zero full random urandom tty fuse autofs; do
        [ -e "/dev/$d" ] || continue
        touch "$r/dev/$d"
        mount --bind "/dev/$d" "$r/dev/$d"
    done
    mkdir "$r/dev/pts" "$r/dev/shm"
    mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$r/dev/pts"
    ln -s pts/ptmx "$r/dev/ptmx"
    mount -t tmpfs -o mode=1777,nosuid,nodev shm "$r/dev/shm"
    ln -s /proc/self/fd "$r/dev/fd"
    for d in 0:stdin 1:stdout 2:stderr; do ln -s "/proc/self/fd/${d%%:*}" "$r/dev/${d#*:}"; done
    mount -t tmpfs -o mode=0755,nosuid,nodev run "$r/run"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$r/tmp"

    # What the host would start besides: its mounts, swaps, timers, device and kernel setup.
    echo "# kiln install test" >"$r/etc/fstab"
    for d in systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket \
        systemd-udev-trigger.service systemd-udev-settle.service systemd-modules-load.service \
        kmod-static-nodes.service systemd-sysctl.service systemd-binfmt.service \
        proc-sys-fs-binfmt_misc.automount sys-fs-fuse-connections.mount \
        sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount \
        dev-hugepages.mount systemd-timesyncd.service systemd-pstore.service \
        systemd-random-seed.service systemd-hwdb-update.service systemd-firstboot.service \
        systemd-remount-fs.service systemd-journald-audit.socket systemd-machine-id-commit.service \
        systemd-repart.service getty.target console-getty.service rpcbind.socket \
        apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer \
        fstrim.timer man-db.timer systemd-tmpfiles-clean.timer; do
        ln -sf /dev/null "$r/etc/systemd/system/$d"
    done
    # A host that forbids maintainer scripts to start and stop services (a container image's
    # policy-rc.d) would hide what they do on a real machine.
    rm -f "$r/usr/sbin/policy-rc.d"
    cp "$deb" "$r/root/kiln.deb"
    hostname kiln-test
    ip link set lo up
    # Open before saying ready, so that the go cannot be written before anyone listens.
    exec 3<>"$work/go"
    : >"$work/ready"
    read -r _ <&3
    exec 3<&-
    exec chroot "$r" /usr/bin/env -i container=kiln-test \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        /lib/systemd/systemd --unit=basic.target --show-status=no
}

if [ "${1:-}" = --inner ]; then
    inner "$2" "$3"
    exit 1
fi

# --- Outside.
deb='' build_args=() keep='' automount=1
while [ $# -gt 0 ]; do
    case $1 in
        --no-automount) automount='' ;;
        --deb) [ $# -ge 2 ] || die "--deb wants a path"; deb=$2; shift ;;
        --no-build) build_args+=(--no-build) ;;
        --profile) [ $# -ge 2 ] || die "--profile wants a name"; build_args+=(--profile "$2"); shift ;;
        --keep) keep=1 ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
    shift
done
[ "$(id -u)" = 0 ] || die "needs root (namespaces, mounts, dpkg in the throwaway root)"
for c in unshare nsenter chroot /lib/systemd/systemd; do
    command -v "$c" >/dev/null || die "$c is missing"
done
[ -c /dev/fuse ] || die "/dev/fuse is missing"
self=$(realpath "$0")
repo=$(dirname "$(dirname "$self")")
if [ -z "$deb" ]; then
    deb=$("$repo/scripts/package.sh" "${build_args[@]}" | tail -n 1)
fi
deb=$(realpath -e "$deb") || die "no package at $deb"

t0=${EPOCHREALTIME/./}
work=$(mktemp -d /tmp/kiln-install-test.XXXXXX)
mkdir "$work/ns"
mkfifo "$work/go"
log=$work/test.log
unshare_pid='' pid1='' cgroups=() failed=''

elapsed() {
    local us=$((${EPOCHREALTIME/./} - t0))
    printf '%3d.%ds' $((us / 1000000)) $((us / 100000 % 10))
}
pass() { echo "PASS $(elapsed)  $*"; }
fail() {
    echo "FAIL $(elapsed)  $*"
    failed=1
    exit 1
}

# Runs a command in the throwaway root under systemd (after boot) with a clean environment.
inside() {
    nsenter -t "$pid1" -m -p -n -u -i -r -w -- env -i \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 TERM=dumb "$@"
}
# The same before boot, when PID 1 is still the shell that built the root.
chrooted() {
    nsenter -t "$pid1" -m -p -n -u -i -- chroot "$work/ns/root" env -i \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 TERM=dumb "$@"
}
# Runs a command, its output to the log; fails the test with MESSAGE if it fails.
must() {
    local what=$1
    shift
    echo "+ $(elapsed) $*" >>"$log"
    "$@" >>"$log" 2>&1 || fail "$what (exit $?; see below)"
}
# Polls COMMAND until it succeeds or SECONDS pass (or the namespaces end).
wait_for() {
    local secs=$1 deadline
    shift
    deadline=$(($(date +%s) + secs))
    until "$@" >>"$log" 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] && kill -0 "$unshare_pid" 2>/dev/null || return 1
        sleep 0.1
    done
}

# Whether the namespaces' PID 1 is systemd yet (its executable's path as seen from here: in
# another mount namespace, chrooted).
is_systemd() { case $(readlink "/proc/$pid1/exe") in */lib/systemd/systemd) ;; *) false ;; esac; }

cleanup() {
    local status=$?
    set +e
    if [ -n "$failed" ] && [ -n "$pid1" ] && [ -d "/proc/$pid1" ]; then
        if is_systemd; then
            {
                echo "--- journal (kilnd, mounts, failed units)"
                inside journalctl -b --no-pager -n 40 -u kilnd -u 'mnt-*'
                inside systemctl --failed --no-pager
            } >>"$log" 2>&1
        fi
    fi
    if [ -n "$failed" ] || [ "$status" != 0 ]; then
        echo "--- end of $log"
        tail -n 60 "$log"
    fi
    # systemd halts the container on SIGRTMIN+3 (stops its units, then exits); a PID 1 that
    # does not go takes the namespace down with it when killed.
    if [ -n "$unshare_pid" ] && kill -0 "$unshare_pid" 2>/dev/null; then
        [ -n "$pid1" ] && kill -s RTMIN+3 "$pid1" 2>/dev/null
        for _ in $(seq 100); do kill -0 "$unshare_pid" 2>/dev/null || break; sleep 0.1; done
        [ -n "$pid1" ] && kill -KILL "$pid1" 2>/dev/null
        kill -KILL "$unshare_pid" 2>/dev/null
        wait "$unshare_pid" 2>/dev/null
    fi
    # The test's cgroups, deepest first, once their processes are gone.
    local c
    for c in "${cgroups[@]}"; do
        for _ in $(seq 50); do
            [ -d "$c" ] || break
            find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
            sleep 0.1
        done
        [ -d "$c" ] && echo "install-test: could not remove cgroup $c" >&2
    done
    if [ -n "$failed" ] || [ "$status" != 0 ]; then
        echo "RESULT: FAIL (logs in $work)"
        exit 1
    fi
    [ -n "$keep" ] && echo "logs in $work" || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

echo "install-test: $deb" | tee "$log"

# A cgroup of its own in every hierarchy (below this process's), for the namespaces' systemd.
while read -r mp _ _ path; do
    c="$mp${path%/}/kiln-test.$$"
    mkdir "$c"
    # A new cpuset has no CPUs or memory nodes until given its parent's.
    if [ -e "$c/cpuset.cpus" ]; then
        cat "$c/../cpuset.cpus" >"$c/cpuset.cpus"
        cat "$c/../cpuset.mems" >"$c/cpuset.mems"
    fi
    cgroups+=("$c")
done < <(cgroup_hierarchies)
(
    for c in "${cgroups[@]}"; do echo "$BASHPID" >"$c/cgroup.procs"; done
    exec unshare --mount --pid --fork --kill-child --net --uts --ipc --cgroup --mount-proc \
        --propagation private "$self" --inner "$work" "$deb"
) >"$work/boot.log" 2>&1 &
unshare_pid=$!

ns_pid1() {
    pid1=$(cat "/proc/$unshare_pid/task/$unshare_pid/children" 2>/dev/null)
    pid1=${pid1%% *}
    [ -n "$pid1" ]
}
wait_for 10 ns_pid1 || fail "the namespaces did not start (boot.log: $(tail -n 3 "$work/boot.log"))"
wait_for 20 test -e "$work/ready" \
    || fail "the throwaway root was not built ($(tail -n 3 "$work/boot.log"))"
pass "throwaway root: overlay of / on a tmpfs, namespaces, cgroups below $$"

# 1. Installed where systemd does not run: nothing starts.
must "dpkg -i without systemd" chrooted dpkg -i /root/kiln.deb
chrooted sh -c '! pgrep -x kilnd' >>"$log" 2>&1 || fail "kilnd runs after an install without systemd"
must "kiln --version" chrooted kiln --version
must "dpkg --purge without systemd" chrooted dpkg --purge kiln
pass "dpkg -i and --purge on a root without systemd: nothing started"

# 2. systemd boots.
echo 1<>"$work/go"
wait_for 10 is_systemd || fail "systemd did not start ($(tail -n 3 "$work/boot.log"))"
system_up() {
    local s
    s=$(inside systemctl is-system-running 2>/dev/null)
    echo "is-system-running: $s"
    [ "$s" = running ] || [ "$s" = degraded ]
}
wait_for 30 system_up || fail "systemd did not finish booting"
inside systemctl --failed --no-legend --no-pager >>"$log" 2>&1
pass "systemd booted: $(inside systemctl is-system-running)"

# 3. Installed under systemd: the unit is there, neither enabled nor started.
must "dpkg -i" inside dpkg -i /root/kiln.deb
[ "$(inside systemctl is-enabled kilnd 2>/dev/null)" = disabled ] \
    || fail "kilnd.service is $(inside systemctl is-enabled kilnd 2>&1) after install, not disabled"
[ "$(inside systemctl is-active kilnd 2>/dev/null)" = inactive ] \
    || fail "kilnd.service is $(inside systemctl is-active kilnd 2>&1) after install"
pass "dpkg -i: kilnd.service installed, disabled, inactive"

# 4. What the package holds.
page=$(inside man -w kiln-volume 2>>"$log") || fail "man -w kiln-volume finds no page"
page8=$(inside man -w 8 kilnd 2>>"$log") || fail "man -w 8 kilnd finds no page"
pass "man pages: $page, $page8"

completion_has_volume() {
    inside bash -c '
        source /usr/share/bash-completion/completions/kiln || exit 1
        f=$(complete -p kiln | sed -n "s/.*-F \([^ ]*\).*/\1/p")
        [ -n "$f" ] || { echo "no completion function for kiln"; exit 1; }
        COMP_WORDS=(kiln ""); COMP_CWORD=1; COMP_LINE="kiln "; COMP_POINT=5
        "$f" kiln "" kiln
        echo "$f: ${COMPREPLY[*]}"
        printf "%s\n" "${COMPREPLY[@]}" | grep -qx volume'
}
must "bash completion of 'kiln ' offers no 'volume'" completion_has_volume
pass "bash completion: kiln <TAB> offers volume"

lib=/usr/lib/x86_64-linux-gnu
soname=$(inside readelf -d "$lib/libkiln.so.0.1.0" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libkiln.so.0 ] || fail "libkiln.so.0.1.0 has SONAME '$soname', not libkiln.so.0"
[ "$(inside readlink "$lib/libkiln.so")" = libkiln.so.0 ] || fail "libkiln.so does not link to libkiln.so.0"
[ "$(inside readlink "$lib/libkiln.so.0")" = libkiln.so.0.1.0 ] || fail "libkiln.so.0 does not link to libkiln.so.0.1.0"
[ "$(inside pkg-config --variable=libdir kiln)" = "$lib" ] || fail "kiln.pc's libdir is not $lib"
pass "libkiln: SONAME $soname, symlinks, pkg-config: $(echo $(inside pkg-config --cflags --libs kiln))"

# 5. kilnd as a service.
# A state directory from before (a kilnd run by hand) is closed to other users too.
must "mkdir /var/lib/kiln" inside mkdir -m 0755 /var/lib/kiln
must "systemctl enable --now kilnd" inside systemctl enable --now kilnd
wait_for 20 inside kiln volume list || fail "kilnd does not answer kiln volume list"
mode=$(inside stat -c %a /var/lib/kiln)
[ "$mode" = 700 ] || fail "/var/lib/kiln has mode $mode, not 700"
pass "systemctl enable --now kilnd: kiln volume list answers; /var/lib/kiln is 0700"

must "kiln volume create" inside kiln volume create v1 127.0.0.1:/srv/kiln/b1
must "kiln volume start" inside kiln volume start v1
# The volume's root is the brick directory kilnd made: not writable by everyone, and nothing
# kilnd keeps (volfiles it runs, logs, the pool's log) is either.
mode=$(inside stat -c %a /srv/kiln/b1)
[ "$mode" = 755 ] || fail "the new brick directory has mode $mode, not 755"
open=$(inside find /var/lib/kiln -perm -o+w ! -type l ! -type s)
[ -z "$open" ] || fail "kilnd left files anyone may write: $open"
pass "volume v1 (127.0.0.1:/srv/kiln/b1) created and started; brick 0755, no world-writable state"

# 6. /etc/fstab and mount -a.
fstab_line='127.0.0.1:/v1 /mnt/kiln kiln defaults,_netdev,x-systemd.automount 0 0'
must "fstab" inside sh -c "mkdir -p /mnt/kiln && echo '$fstab_line' >>/etc/fstab"
# Under an automount, findmnt lists the autofs mount and the Kiln mount on top of it.
kiln_mounted() { inside findmnt -n -o FSTYPE --mountpoint /mnt/kiln | grep -qx fuse.kiln; }
must "mount -a" inside mount -a
kiln_mounted || fail "mount -a left no fuse.kiln mount on /mnt/kiln"
must "a second mount -a" inside mount -a
[ "$(inside findmnt -n --mountpoint /mnt/kiln | wc -l)" = 1 ] || fail "a second mount -a mounted again"
pass "fstab line '$fstab_line': mount -a mounts it (twice: once)"

must "random data" inside sh -c 'head -c 8M /dev/urandom >/root/data'
sum=$(inside sha256sum /root/data | cut -d' ' -f1)
must "cp into the mount" inside cp /root/data /mnt/kiln/data
[ "$(inside sha256sum /mnt/kiln/data | cut -d' ' -f1)" = "$sum" ] || fail "the data read back differs"
[ "$(inside sha256sum /srv/kiln/b1/data | cut -d' ' -f1)" = "$sum" ] || fail "the brick's copy differs"
pass "8 MiB written through the mount, read back and on the brick: sha256 ${sum:0:16}..."

if inside sh -c 'command -v cc' >/dev/null 2>&1; then
    must "C program" inside sh -c 'cat >/root/t.c <<"EOF"
#include <kiln.h>
#include <stdio.h>
#include <stdlib.h>
int main(void) {
    static char buf[16 << 20];
    kiln_t *k;
    int r = kiln_volume_open("127.0.0.1:/v1", NULL, &k);
    if (r) { fprintf(stderr, "kiln_volume_open: %d\n", r); return 1; }
    int64_t n = kiln_read_file(k, "/data", buf, sizeof buf);
    if (n < 0) { fprintf(stderr, "kiln_read_file: %lld\n", (long long)n); return 1; }
    fwrite(buf, 1, n, stdout);
    return kiln_fini(k) != 0;
}
EOF
cc -o /root/t /root/t.c $(pkg-config --cflags --libs kiln) && ldd /root/t | grep -q "libkiln.so.0 =>"'
    [ "$(inside sh -c '/root/t | sha256sum' | cut -d' ' -f1)" = "$sum" ] || fail "libkiln read other data"
    pass "C program built with pkg-config kiln, linked to libkiln.so.0, reads the same data"
else
    echo "SKIP  the C program against libkiln: no C compiler (cc) on this machine"
fi

# kilnd's /metrics on the port /etc/default/kilnd gives it.
kilnd_metrics() {
    inside bash -c 'exec 3<>/dev/tcp/127.0.0.1/24070 && printf "GET /metrics HTTP/1.0\r\n\r\n" >&3 && cat <&3' \
        | grep -q 'kiln_heal_backlog_files'
}
must "kilnd's /metrics on 127.0.0.1:24070 (from /etc/default/kilnd)" kilnd_metrics
pass "kilnd serves /metrics on 127.0.0.1:24070, as /etc/default/kilnd says"

# An NBD export as an instance of the kiln-nbd@ template, read whole by a real NBD client.
if inside sh -c 'command -v nbdcopy' >/dev/null 2>&1; then
    must "/etc/kiln/nbd/data.conf" inside sh -c 'mkdir -p /etc/kiln/nbd && echo "KILN_NBD_ARGS=\"127.0.0.1:/v1/data --read-only --listen unix:/run/kiln-nbd/data/nbd.sock\"" >/etc/kiln/nbd/data.conf'
    must "systemctl start kiln-nbd@data" inside systemctl start kiln-nbd@data
    nbd_up() { inside test -S /run/kiln-nbd/data/nbd.sock; }
    wait_for 20 nbd_up || fail "kiln-nbd@data made no socket: $(inside journalctl -u kiln-nbd@data -n 5 --no-pager)"
    got=$(inside sh -c 'nbdcopy "nbd+unix:///?socket=/run/kiln-nbd/data/nbd.sock" - | sha256sum' | cut -d' ' -f1)
    [ "$got" = "$sum" ] || fail "nbdcopy through kiln-nbd@data read other data"
    must "systemctl stop kiln-nbd@data" inside systemctl stop kiln-nbd@data
    inside test -e /run/kiln-nbd/data && fail "the instance's runtime directory outlived it"
    # Left enabled and running: the package's removal must stop it and its purge unlink it.
    must "systemctl enable --now kiln-nbd@data" inside systemctl enable --now kiln-nbd@data
    wait_for 20 nbd_up || fail "kiln-nbd@data made no socket the second time"
    pass "kiln-nbd@data (/etc/kiln/nbd/data.conf): nbdcopy reads the 8 MiB through it; enabled"
else
    echo "SKIP  the kiln-nbd@ template: no nbdcopy (libnbd-bin) on this machine"
fi

# The logs rotate while their writers go on: the brick's log is copied and truncated, and the
# brick still writes to it.
if inside sh -c 'command -v logrotate' >/dev/null 2>&1; then
    blog=/var/lib/kiln/vols/v1/bricks/0.log
    inside test -s "$blog" || fail "$blog is empty or missing"
    must "logrotate -f" inside logrotate -f -s /root/logrotate.state /etc/logrotate.d/kiln
    inside test -s "$blog.1" || fail "logrotate made no $blog.1"
    must "a write after rotation" inside sh -c 'echo y >/mnt/kiln/rotated && rm /mnt/kiln/rotated'
    inside rm -f /root/logrotate.state
    pass "logrotate -f /etc/logrotate.d/kiln: $blog rotated to $blog.1"
else
    echo "SKIP  logrotate: not installed on this machine"
fi

# 7. A restart of kilnd leaves the bricks running (KillMode=process); the mount goes on.
bricks() { inside pgrep -f -- '--volfile /var/lib/kiln/' | sort | paste -sd' '; }
before=$(bricks)
[ -n "$before" ] || fail "no brick process"
must "systemctl restart kilnd" inside systemctl restart kilnd
wait_for 20 inside kiln volume status v1 || fail "kilnd does not answer after a restart"
[ "$(bricks)" = "$before" ] || fail "bricks changed across a kilnd restart: $before -> $(bricks)"
[ "$(inside sha256sum /mnt/kiln/data | cut -d' ' -f1)" = "$sum" ] || fail "data differs after a restart"
pass "systemctl restart kilnd: brick pids $before unchanged, mount still reads"

# mount(8) hands a remount of the fstab line to mount.kiln, which must keep nosuid and nodev.
flags_are() {
    local o
    o=",$(inside findmnt -n -o OPTIONS --mountpoint /mnt/kiln),"
    case $o in *",$1,"*) ;; *) echo "not $1: $o"; return 1 ;; esac
    case $o in *,nosuid,*nodev,* | *,nodev,*nosuid,*) ;; *) echo "lost nosuid/nodev: $o"; return 1 ;; esac
}
must "mount -o remount,ro" inside mount -o remount,ro /mnt/kiln
must "remount,ro" flags_are ro
inside sh -c 'echo x >/mnt/kiln/nope' >>"$log" 2>&1 && fail "a mount remounted ro took a write"
must "mount -o remount,rw" inside mount -o remount,rw /mnt/kiln
must "remount,rw" flags_are rw
must "a write after remount,rw" inside sh -c 'echo x >/mnt/kiln/yes && rm /mnt/kiln/yes'
pass "mount -o remount,ro and back to rw (nosuid, nodev kept)"

must "umount" inside umount /mnt/kiln
# (A kiln-nbd@ instance runs /usr/bin/kiln too: only a mount's process counts here.)
no_kiln_mount() { ! inside pgrep -f '^/usr/bin/kiln mount '; }
wait_for 10 no_kiln_mount || fail "the kiln mount process did not exit after umount"
pass "umount: the mount process exited"

# 8. mount -t kiln with options: read-only, vm-image mode.
must "mount -t kiln -o ro" inside mount -t kiln -o ro,mode=vm-image 127.0.0.1:/v1 /mnt/kiln
opts=$(inside findmnt -n -o OPTIONS --mountpoint /mnt/kiln)
must "-o ro" flags_are ro
inside sh -c 'echo x >/mnt/kiln/nope' >>"$log" 2>&1 && fail "a read-only mount took a write"
[ "$(inside sha256sum /mnt/kiln/data | cut -d' ' -f1)" = "$sum" ] || fail "the read-only mount reads other data"
must "umount" inside umount /mnt/kiln
wait_for 10 no_kiln_mount || fail "the kiln mount process did not exit after umount"
pass "mount -t kiln -o ro,mode=vm-image: $opts"

# 9. The fstab line as systemd mounts it at boot (mnt-kiln.mount runs mount.kiln).
must "daemon-reload" inside systemctl daemon-reload
must "systemctl start mnt-kiln.mount" inside systemctl start mnt-kiln.mount
kiln_mounted || fail "mnt-kiln.mount is active but nothing is mounted"
[ "$(inside sha256sum /mnt/kiln/data | cut -d' ' -f1)" = "$sum" ] || fail "mnt-kiln.mount reads other data"
must "systemctl stop mnt-kiln.mount" inside systemctl stop mnt-kiln.mount
wait_for 10 no_kiln_mount || fail "the kiln mount process did not exit after stopping mnt-kiln.mount"
pass "systemctl start/stop mnt-kiln.mount (from the fstab line)"

# systemd's automount needs the kernel's autofs (/dev/autofs); a kernel without it is said so.
if [ -n "$automount" ] && [ ! -e /dev/autofs ] && ! modprobe autofs4 2>/dev/null; then
    echo "SKIP  x-systemd.automount: this kernel has no autofs (/dev/autofs); --no-automount says so"
    automount=''
fi
if [ -n "$automount" ]; then
    must "systemctl start mnt-kiln.automount" inside systemctl start mnt-kiln.automount
    [ "$(inside timeout 40 sha256sum /mnt/kiln/data | cut -d' ' -f1)" = "$sum" ] \
        || fail "reading through mnt-kiln.automount failed"
    kiln_mounted || fail "the automount left no fuse.kiln mount"
    must "systemctl stop mnt-kiln.automount" inside systemctl stop mnt-kiln.automount mnt-kiln.mount
    wait_for 10 no_kiln_mount || fail "the kiln mount process did not exit after the automount stopped"
    pass "x-systemd.automount: the first access mounts the volume"
fi

# 10. Stop, disable, purge.
must "kiln volume stop" inside kiln volume stop v1 --yes
must "systemctl disable --now kilnd" inside systemctl disable --now kilnd
no_kilnd() { ! inside pgrep -x kilnd; }
wait_for 10 no_kilnd || fail "kilnd processes remain after volume stop and systemctl disable --now"
pass "volume stopped, kilnd disabled and stopped: no kilnd process"

# Nothing of the package left: files, unit, enablement, state, logs, processes.
assert_gone() {
    inside dpkg -L kiln >>"$log" 2>&1 && fail "dpkg -L kiln still lists files"
    inside dpkg -s kiln >>"$log" 2>&1 && fail "dpkg -s kiln still knows the package"
    local f
    for f in /lib/systemd/system/kilnd.service /usr/lib/systemd/system/kilnd.service \
        /etc/systemd/system/kilnd.service /etc/systemd/system/multi-user.target.wants/kilnd.service \
        /usr/bin/kiln /usr/sbin/kilnd /sbin/mount.kiln /sbin/mount.fuse.kiln "$lib/libkiln.so.0" \
        /usr/include/kiln.h "$lib/pkgconfig/kiln.pc" /usr/share/man/man1/kiln-volume.1.gz \
        /usr/share/bash-completion/completions/kiln /var/lib/kiln /var/log/kiln \
        /etc/default/kilnd /etc/logrotate.d/kiln /usr/lib/systemd/system/kiln-nbd@.service \
        /usr/lib/systemd/system/kiln-vhost-user-blk@.service \
        /etc/systemd/system/multi-user.target.wants/kiln-nbd@data.service; do
        inside test -e "$f" -o -L "$f" && fail "$f is left after the purge"
    done
    inside pgrep -a kiln >>"$log" 2>&1 && fail "kiln processes are left after the purge"
    inside systemctl cat kilnd >>"$log" 2>&1 && fail "systemd still knows kilnd.service"
    return 0
}
must "dpkg --purge kiln" inside dpkg --purge kiln
assert_gone
# The brick is the user's data: it stays, as after a volume delete.
[ "$(inside sha256sum /srv/kiln/b1/data | cut -d' ' -f1)" = "$sum" ] || fail "the purge touched the brick's data"
pass "dpkg --purge kiln: package, unit, binaries, state and logs gone; the brick's data kept"

# 11. Purged while everything runs: kilnd enabled and running, a volume started. (Mounts are
# clients and stay; without their bricks they wait for them, like NFS hard mounts.)
must "dpkg -i again" inside dpkg -i /root/kiln.deb
must "systemctl enable --now kilnd" inside systemctl enable --now kilnd
wait_for 20 inside kiln volume list || fail "kilnd does not answer kiln volume list"
must "kiln volume create" inside kiln volume create v2 127.0.0.1:/srv/kiln/b2
must "kiln volume start" inside kiln volume start v2
must "dpkg --purge kiln, all running" inside dpkg --purge kiln
assert_gone
pass "dpkg --purge kiln with kilnd enabled and a volume started: all gone"

# Everything the root changed is in the overlay's upper layer: after taking away what the test
# itself made, nothing there may be Kiln's (deletions show as whiteouts, character devices).
must "the test's own files" inside sh -c \
    'rm -rf /root/kiln.deb /root/data /root/t /root/t.c /srv/kiln /mnt/kiln /etc/kiln && echo "# kiln install test" >/etc/fstab'
upper() { nsenter -t "$pid1" -m -- find "$work/ns/upper" "$@"; }
[ -n "$(upper -path '*/var/lib/dpkg/status')" ] || fail "cannot see the overlay's upper layer"
left=$(upper ! -type c -iname '*kiln*' -printf '/%P\n')
[ -z "$left" ] || fail "left behind: $left"
pass "nothing named *kiln* is left in what the root changed"
echo "RESULT: PASS ($(elapsed) in all)"
