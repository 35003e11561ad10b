#!/usr/bin/env bash
# The Soft-RoCE tier: railover's verbs layer against the real kernel verbs stack.
#
# Two QEMU guests booted from Debian's stock kernel (which ships rdma_rxe) and a busybox
# initramfs, joined by three virtual links (rails) that QEMU carries over host loopback
# TCP only. Every guest NIC gets an rxe device; eth<i> is rxe<i>'s netdev. Inside the
# guests (steps, as RAILOVER_VERBS_STEPS names them):
#   base  the raw fabric baseline, ib_write_bw and ib_write_lat (perftest) over rxe0;
#         `railover verbs-check` on every rail (RC QPs set up from discovery, checksummed
#         RDMA WRITE_WITH_IMM both ways, then a fenced peer must fail the next write), and
#         on both guests every device's flush QP (iflush's loopback RDMA READ of a
#         registered buffer brings back its bytes through two patterns; a READ under a
#         deregistered key fails and stays failed; a fresh flush QP then works); on rxe0
#         the seal of a receive lane given up (verbs-check --seal: the sealed QP still
#         writes, the peer's writes to it are refused);
#         `railover doctor`, RAILOVER_HCA;
#   fp    the plugin's comms over verbs lanes (fault-peer, one comm per rail);
#   sc    64 comms at once (rails in turn, 64 KiB messages), every byte checked; the
#         memory each end pins (VmPin) with them connected and with data flowing, and
#         that 16 connections which never authenticate make the receiver pin nothing;
#   pb/pl throughput (one comm, 1 MiB messages) and 8-byte ping-pong latency on rxe0,
#         reported as ratios to ib_write_bw / ib_write_lat;
#   fo rd bd fl tw   faults mid-stream on three comms: the sender's rail 0 down 4 s, the
#         receiver's 3 s, both sides' at once, rail 0 flapping 3 x 1 s, rxe0 and rxe1
#         down on the sender (all on rxe2) 4 s. Each: every byte once and in order, no
#         failed request, the carrier reaching the engine, failover and fail-back lines;
#         payloads written in place by the sender's NIC, memory registered by regMr on
#         each comm's own NIC and lazily on the backups;
#   q2    two QPs per lane (RAILOVER_QPS_PER_LANE=2) through the sender's rail 0 down;
#   za    every payload in place (RAILOVER_ZERO_COPY=always), resent ones included, through
#         the sender's rail 0 down;
#   gs/gr GPU-typed memory (NCCL_PTR_CUDA) through the sender's rail 0 down, with rxe1
#         left out of GPU memory (RAILOVER_GDR_HCA) on the sender (gs) or the receiver
#         (gr): the moved comm must leave rxe1 for rxe2, nothing lost or copied;
#   gf    GPU-typed memory on every NIC, each receive flushed (iflush) before it is read,
#         through the receiver's rail 0 down: flushes on the NIC that went down count
#         as done, none fails the comm;
#   kp    the sender SIGKILLed mid-stream: the receiver fails every comm with
#         ncclSystemError/ncclRemoteError within completion + probe timeout + 4 s;
#   abi   tests/abi/driver.c (ncclNetPlugin_v12) against the built .so in guest a, its
#         two processes' lanes over rxe;
#   gd    the same driver with its data buffers registered as GPU memory (NCCL_PTR_CUDA,
#         RAILOVER_GDR=force): every payload must go in place, none through a ring.
# On a failed check the tier ends with the failed steps' log lines from both guests.
# Everything comes from Debian packages, installed with apt-get when run as root; the
# kernel and the guests' base image are cached under $RAILOVER_VERBS_CACHE
# (default target/verbs-tier, ignored by git).
#
# When something it needs is missing and cannot be installed, or QEMU cannot run, it
# prints "verbs tier: SKIP: <why>" and exits 0: that is a skip, never a pass.
# Exit status 1 when a check failed. The figures are printed, not asserted (TCG speed
# says nothing about hardware).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
skip() {
    echo "verbs tier: SKIP: $*"
    exit 0
}
fail() {
    echo "verbs tier: FAIL: $*"
    exit 1
}

[ "$(uname -m)" = x86_64 ] || skip "the guests are x86_64 and this host is $(uname -m)"
cache=${RAILOVER_VERBS_CACHE:-target/verbs-tier}
mkdir -p "$cache" || skip "cannot create the cache directory $cache"
cache=$(cd "$cache" && pwd)
multiarch=/usr/lib/x86_64-linux-gnu

# --- host packages --------------------------------------------------------------------
# command-or-file : Debian package
wanted=(
    "qemu-system-x86_64:qemu-system-x86"
    "busybox:busybox-static"
    "cpio:cpio"
    "depmod:kmod"
    "ib_write_bw:perftest"
    "rdma:iproute2"
    "$multiarch/libibverbs.so.1:libibverbs1"
    "$multiarch/libibverbs/librxe-rdmav34.so:ibverbs-providers"
)
have() { case $1 in /*) [ -e "$1" ] ;; *) command -v "$1" >/dev/null 2>&1 ;; esac; }
missing=()
for w in "${wanted[@]}"; do
    have "${w%%:*}" || missing+=("${w##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || skip "not root, and these packages are missing: ${missing[*]}"
    echo "verbs tier: installing ${missing[*]}"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } >/dev/null 2>&1 ||
        skip "apt-get could not install ${missing[*]}"
fi
# busybox-static replaces a dynamic busybox; the guest needs the static one.
bb=$(command -v busybox)
file -L "$bb" 2>/dev/null | grep -q 'dynamically linked' && skip "$bb is not the static busybox"

# --- kernel ---------------------------------------------------------------------------
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$kpkg" ]; then
    kpkg=$(cd "$cache" && ls -d kroot-* 2>/dev/null | head -1 | sed 's/^kroot-/linux-image-/')
fi
[ -n "$kpkg" ] || skip "apt-cache names no linux-image for linux-image-amd64, and none is cached"
kver=${kpkg#linux-image-}
kroot=$cache/kroot-$kver
if [ ! -e "$kroot/boot/vmlinuz-$kver" ]; then
    mkdir -p "$cache/deb"
    (cd "$cache/deb" && ls "$kpkg"_*.deb >/dev/null 2>&1 || apt-get download "$kpkg" >/dev/null 2>&1) ||
        skip "cannot download $kpkg"
    rm -rf "$kroot.tmp" && mkdir -p "$kroot.tmp"
    dpkg -x "$cache"/deb/"$kpkg"_*.deb "$kroot.tmp" || skip "cannot unpack $kpkg"
    depmod -b "$kroot.tmp" "$kver" || skip "depmod failed for $kver"
    mv "$kroot.tmp" "$kroot"
    rm -f "$cache"/deb/"$kpkg"_*.deb
fi

# --- the guests' base image (busybox, modules, rdma-core, perftest), cached -------------
base=$cache/base-$kver.cpio.gz
if [ ! -s "$base" ]; then
    echo "verbs tier: building the guest base image for $kver"
    root=$cache/base-root
    rm -rf "$root" && mkdir -p "$root"/{bin,proc,sys,dev,tmp,mods,etc/libibverbs.d}
    cp "$bb" "$root/bin/busybox"
    copy_with_libs() {
        local f
        for f in "$@"; do
            mkdir -p "$root/$(dirname "$f")" && cp -L "$f" "$root/$f" || return 1
            for l in $(ldd "$f" 2>/dev/null | grep -oE '/[^ ]+\.so[^ ]*'); do
                mkdir -p "$root/$(dirname "$l")" && cp -L "$l" "$root/$l"
            done
        done
    }
    copy_with_libs "$multiarch/libibverbs.so.1" "$multiarch/libibverbs/librxe-rdmav34.so" \
        "$(command -v rdma)" "$(command -v ib_write_bw)" "$(command -v ib_write_lat)" ||
        skip "cannot copy rdma-core and perftest into the guest image"
    cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/" || skip "no /etc/libibverbs.d/rxe.driver"
    # Modules in dependency order. crc32_generic is not a declared dependency of
    # rdma_rxe, but rxe needs the crc32 algorithm and the guest has no modprobe.
    order=()
    add_mod() {
        local m=$1 d f
        for d in "${order[@]}"; do [ "$d" = "$m" ] && return 0; done
        f=$(modinfo -b "$kroot" -k "$kver" -F filename "$m" 2>/dev/null) || return 1
        case $f in (builtin*|"") return 0 ;; esac
        for d in $(modinfo -b "$kroot" -k "$kver" -F depends "$m" | tr ',' ' '); do
            add_mod "$d" || return 1
        done
        order+=("$m")
        cp "$f" "$root/mods/$m.ko"
    }
    for m in virtio_pci virtio_net crc32_generic rdma_rxe; do
        add_mod "$m" || skip "kernel $kver has no module $m"
    done
    printf '%s\n' "${order[@]}" >"$root/mods/order"
    (cd "$root" && find . | cpio -o -H newc 2>/dev/null | gzip -1) >"$base.tmp" && mv "$base.tmp" "$base"
    rm -rf "$root"
fi

# --- railover's test binary, and the init that runs the tests ----------------------------
echo "verbs tier: building railover (the CLI and the plugin .so) and the ABI driver"
timeout 900 cargo build -p railover-cli -p railover --quiet 2>&1 | tail -20
bin=target/debug/railover so=target/debug/librailover.so
[ -x "$bin" ] || fail "cargo build did not produce $bin"
[ -e "$so" ] || fail "cargo build did not produce $so"
run=$(mktemp -d)
trap 'rm -rf "$run"; [ -n "${qa:-}" ] && kill "$qa" 2>/dev/null; [ -n "${qb:-}" ] && kill "$qb" 2>/dev/null' EXIT
mkdir -p "$run/top/bin"
objcopy --strip-debug "$bin" "$run/top/bin/railover" || cp "$bin" "$run/top/bin/railover"
# The ABI conformance driver (tests/abi.rs builds it the same way) and the plugin it loads.
mkdir -p "$run/top/lib"
objcopy --strip-debug "$so" "$run/top/lib/librailover.so" || cp "$so" "$run/top/lib/librailover.so"
${CC:-cc} -std=gnu11 -O1 -g -Wall -Wextra -pthread -I tests/abi -o "$run/top/bin/abi-driver" \
    tests/abi/driver.c -ldl || fail "cannot compile tests/abi/driver.c with ${CC:-cc}"
for f in "$bin" "$so" "$run/top/bin/abi-driver"; do
    for l in $(ldd "$f" | grep -oE '/[^ ]+\.so[^ ]*'); do
        mkdir -p "$run/top/$(dirname "$l")" && cp -L "$l" "$run/top/$l"
    done
done
cat >"$run/top/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /mods/order); do insmod /mods/$m.ko || echo "VT: insmod $m failed"; done
role=$(sed -n 's/.*vt_role=\([ab]\).*/\1/p' /proc/cmdline)
only=$(sed -n 's/.*vt_steps=\([a-z0-9,]*\).*/\1/p' /proc/cmdline)
want() { [ -z "$only" ] || case ",$only," in *",$1,"*) true ;; *) false ;; esac; }
if [ "$role" = a ]; then me=1; peer=2; else me=2; peer=1; fi
nets="192.0.2 198.51.100 203.0.113"
i=0; peers=""
ip link set lo up
for n in $nets; do
    ip link set eth$i up
    ip addr add $n.$me/24 dev eth$i
    rdma link add rxe$i type rxe netdev eth$i || echo "VT: rxe$i not created"
    peers="$peers${peers:+,}$n.$peer"
    i=$((i + 1))
done
# The IPv4 RoCE v2 GID of rxe0 (perftest's -x).
gidx=""
for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
    case $(cat $g) in 0000:0000:0000:0000:0000:ffff:*) gidx=${g##*/}; break ;; esac
done
now() { cut -d' ' -f1 /proc/uptime; }
echo "VT: role $role up $(now)s, rxe0 IPv4 GID index ${gidx:-none}"
# Bounded retries, once a second: the other guest may not be listening yet.
retry_for() { n=0 most=$1; shift; until "$@"; do n=$((n + 1)); [ $n -ge $most ] && return 1; sleep 1; done; }
retry() { retry_for 40 "$@"; }
# The guests meet at each step's handles: the one that arrives first waits out the other's
# previous step, up to that step's own limit (150 s), so one slow step does not put the
# guests out of step for all the rest.
meet=180
meet() { retry_for $meet "$@"; }
# Bounded wait for a line matching $1 in file $2 while process $3 runs.
await() {
    n=0
    until grep -q "$1" "$2" 2>/dev/null; do
        n=$((n + 1)); [ $n -ge 600 ] && return 1; kill -0 "$3" 2>/dev/null || return 1; sleep 0.1
    done
}
links() { # down|up NETDEV...: a cut (or its end) on this guest, stamped
    s=$1; shift
    for d in "$@"; do ip link set "$d" "$s"; done
    echo "VT: $name $* $s $(now)s"
}
# What the host's checks and, on a failure, its diagnostics read from step $1, printed as
# the step ends: a guest that later runs past its time limit has still logged it.
report() {
    s=$1
    [ -e /tmp/$s ] || return 0
    { grep -E '"event":"(summary|bad|setup-failed|connected|pingpong|pingpong-failed)"' /tmp/$s | head -25
      grep '"event":"error"' /tmp/$s | head -12; grep '"event":"error"' /tmp/$s | tail -1; } | sed "s/^/VT: $s| /"
    grep -E 'fabric verbs|failover comm=|failback comm=|NIC rxe|gave up|turned away|WARN|ERROR' /tmp/$s.err |
        head -40 | sed "s/^/VT: $s.err| /"
    # Which memory each comm registered, and what refused it.
    grep -E 'buffers registered as|cannot register|came through the stream|only a NIC can send' /tmp/$s.err |
        head -12 | sed "s/^/VT: $s.mem| /"
}
# Every rail up again after a step, silently: a fault cut short (its step failed) must
# not leave a link down under the next steps.
restore() { for d in eth0 eth1 eth2; do ip link set $d up; done; }
# One fault-peer run over verbs lanes, a receiving, b sending:
#   scn NAME PORT SIDES FAULT OPTIONS...
# The sender's stdin stays open, so it closes its comms --grace seconds after its END.
# FAULT runs (eval) on the guests named in SIDES once that guest's end is connected; $p
# is the local fault-peer. $pre, when set, runs (eval) on a once its receiver listens,
# before the sender may connect. Prints "VT: NAME rc=R Ts" (T: what the step cost this guest,
# in seconds); its output stays in /tmp/NAME and /tmp/NAME.err.
steps=""
scn() {
    name=$1 port=$2 sides=$3 fault=$4
    shift 4
    steps="$steps $name"
    t=$(now)
    if [ "$role" = a ]; then
        RAILOVER_TRANSPORT=verbs RAILOVER_LOG=info timeout 150 /bin/railover fault-peer recv "$@" \
            >/tmp/$name 2>/tmp/$name.err &
        p=$!
        await '"event":"listening"' /tmp/$name $p
        [ -n "${pre:-}" ] && eval "$pre"
        { grep '"event":"handle"' /tmp/$name | sed 's/"event":"handle"/"cmd":"handle"/'; echo '{"cmd":"go"}'; } >/tmp/$name.h
        timeout $meet nc -l -p $port -e cat /tmp/$name.h
    else
        meet sh -c "nc 192.0.2.1 $port </dev/null >/tmp/$name.h && grep -q go /tmp/$name.h"
        # Through a FIFO, not a pipe: ash's wait would also wait for the pipe's writer.
        mkfifo /tmp/$name.in
        RAILOVER_TRANSPORT=verbs RAILOVER_LOG=info timeout 150 /bin/railover fault-peer send "$@" \
            </tmp/$name.in >/tmp/$name 2>/tmp/$name.err &
        p=$!
        { cat /tmp/$name.h; sleep 300; } >/tmp/$name.in &
    fi
    case $sides in *$role*) await '"event":"connected"' /tmp/$name $p && eval "$fault" ;; esac
    wait $p
    echo "VT: $name rc=$? $(awk "BEGIN { print $(now) - $t }")s"
    restore
    report $name
}
# Memory process $1 has pinned (registered), in KiB, as the kernel counts it.
vmpin() { awk '/^VmPin:/ { print $2 }' /proc/$1/status 2>/dev/null || echo 0; }
# Strangers: 16 connections to the receiver $p's verbs listener on rxe0 that never say
# Hello, held 18 s, past the receiver's pre-authentication deadline (16 s with the step's
# 8 s completion timeout), which turns them away; prints the most memory the receiver
# pinned meanwhile above what it had before.
strangers() {
    hex=$(awk '$4 == "0A" && $2 ~ /^010200C0:/ { sub(/.*:/, "", $2); print $2; exit }' /proc/net/tcp)
    [ -n "$hex" ] || { echo "VT: $name strangers: no verbs listener on 192.0.2.1"; return; }
    before=$(vmpin $p) most=0
    for k in $(seq 16); do sleep 18 | nc 192.0.2.1 $((0x$hex)) >/dev/null 2>&1 & done
    for k in $(seq 72); do
        v=$(vmpin $p); [ $((v - before)) -gt $most ] && most=$((v - before))
        sleep 0.25
    done
    echo "VT: $name strangers 16 pinned ${most} KiB above ${before} KiB"
}
# Latency: guest b pings, a pongs, one comm each way on device 0 (rxe0); the two handles
# cross over nc both ways.  pp NAME PORT OPTIONS...
pp() {
    name=$1 port=$2
    shift 2
    steps="$steps $name"
    t=$(now)
    if [ "$role" = a ]; then mode=pong; else mode=ping; fi
    mkfifo /tmp/$name.in
    RAILOVER_TRANSPORT=verbs RAILOVER_LOG=info timeout 150 /bin/railover fault-peer $mode "$@" \
        </tmp/$name.in >/tmp/$name 2>/tmp/$name.err &
    p=$!
    sleep 300 >/tmp/$name.in &
    await '"event":"listening"' /tmp/$name $p
    grep '"event":"handle"' /tmp/$name | sed 's/"event":"handle"/"cmd":"handle"/' >/tmp/$name.mine
    if [ "$role" = a ]; then
        timeout $meet nc -l -p $port -e cat /tmp/$name.mine
        meet sh -c "nc 192.0.2.2 $((port + 1)) </dev/null >/tmp/$name.peer && grep -q handle /tmp/$name.peer"
    else
        meet sh -c "nc 192.0.2.1 $port </dev/null >/tmp/$name.peer && grep -q handle /tmp/$name.peer"
        timeout $meet nc -l -p $((port + 1)) -e cat /tmp/$name.mine
    fi
    { cat /tmp/$name.peer; echo '{"cmd":"go"}'; } >/tmp/$name.in
    wait $p
    echo "VT: $name rc=$? $(awk "BEGIN { print $(now) - $t }")s"
    restore
    report $name
}
PT="-d rxe0 -x ${gidx:-1} -F"
# Under TCG a verbs lane's handshake takes longer than the 200 ms probe default (an
# 8-byte write takes ~25 ms), so probes and lane handshakes get TCG-sized timeouts.
export RAILOVER_PROBE_TIMEOUT_MS=2000 RAILOVER_COMPLETION_TIMEOUT_MS=3000
echo "VT: completion timeout ${RAILOVER_COMPLETION_TIMEOUT_MS} ms, probe timeout ${RAILOVER_PROBE_TIMEOUT_MS} ms"
# Survivors weighed equally: under TCG every rxe port runs at what the emulator's CPU
# leaves it, shared by all of them, so the rate a port delivers while backed up is noise
# about the CPU, not the port's capacity, and capacity weights would follow that noise
# (a comm's stripes all on one survivor). This tier checks the verbs data path; weighted
# striping is checked on the namespace testbed (fault tier) and in the unit tests.
export RAILOVER_STRIPE_WEIGHTS=equal
if ! want base; then
    :
elif [ "$role" = a ]; then
    /bin/railover doctor 2>&1 | sed -n '/^Verbs NICs/,$p' | sed 's/^/VT: doctor| /'
    RAILOVER_HCA='^=rxe1' /bin/railover verbs-check list 2>&1 | sed 's/^/VT: hca| /'
    timeout 120 ib_write_bw $PT -s 1048576 -D 4 --report_gbits > /tmp/bw 2>&1; echo "VT: bw rc=$?"
    timeout 120 ib_write_lat $PT -s 8 -D 4 > /tmp/lat 2>&1; echo "VT: lat rc=$?"
    timeout 300 /bin/railover verbs-check serve --timeout-s 120; echo "VT: check rc=$?"
    RAILOVER_HCA='=rxe0' timeout 120 /bin/railover verbs-check serve --seal --port 18650 --messages 4 --timeout-s 60 2>&1 |
        grep 'rail ' | sed 's/^/VT: seal| /'
else
    retry timeout 120 ib_write_bw $PT -s 1048576 -D 4 --report_gbits 192.0.2.1 > /tmp/bw 2>&1; echo "VT: bw rc=$?"
    retry timeout 120 ib_write_lat $PT -s 8 -D 4 192.0.2.1 > /tmp/lat 2>&1; echo "VT: lat rc=$?"
    timeout 300 /bin/railover verbs-check connect --peer $peers --timeout-s 120; echo "VT: check rc=$?"
    retry sh -c "RAILOVER_HCA='=rxe0' timeout 120 /bin/railover verbs-check connect --seal --port 18650 \
        --messages 4 --timeout-s 60 --peer 192.0.2.1 >/tmp/seal 2>&1"
    grep 'rail ' /tmp/seal | sed 's/^/VT: seal| /'
fi
# The plugin's comms over verbs lanes, one per rail: every byte checked by the receiver.
want fp && scn fp 18700 - : --per-dev 1 --size 256K --depth 4 --seconds 4 --grace 5 --tick-ms 1000
# Scale: 64 comms (rails in turn), every message checked by the receiver; what each end
# pins once its comms are connected and again with data flowing, and, before the sender
# connects, what 16 unauthenticated connections make the receiver pin (nothing: a lane's
# QPs and rings wait for its peer's proof). Each end sets up 64 lanes' QPs and rings on
# its one emulated CPU (about 0.1 s each under TCG), which holds its reactor for seconds
# while the first comms already run: a 3 s completion timeout failed them for silence,
# hence 8 s here.
if want sc; then
    pre=strangers RAILOVER_COMPLETION_TIMEOUT_MS=8000
    scn sc 18715 ab 'echo "VT: sc pinned connected $(vmpin $p) KiB"; sleep 4; echo "VT: sc pinned flowing $(vmpin $p) KiB"' \
        --comms 64 --size 64K --depth 2 --seconds 8 --grace 8 --tick-ms 2000
    pre="" RAILOVER_COMPLETION_TIMEOUT_MS=3000
fi
# Throughput against ib_write_bw: one comm (device 0, rxe0), 1 MiB messages.
want pb && scn pb 18701 - : --comms 1 --size 1M --depth 4 --seconds 4 --grace 5 --tick-ms 1000
# Latency against ib_write_lat: round trips of 8 bytes.
want pl && pp pl 18710 --rounds 40 --ping-size 8
# Faults, each on three comms (one per rail) sending 256 KiB messages; eth<i> is rxe<i>'s
# netdev, so its carrier loss must reach the engine as rxe<i>'s. Fail-back came 4-11 s
# after the link returned here, so each window runs 12 s or more past the outage.
F="--per-dev 1 --size 256K --depth 4 --grace 6 --tick-ms 1000"
# The sender's rail 0 down for 4 s: failover striped over both survivors, then fail-back.
want fo && scn fo 18702 b 'sleep 3; links down eth0; sleep 4; links up eth0' $F --seconds 22
# The receiver's rail 0 down for 3 s.
want rd && scn rd 18703 a 'sleep 3; links down eth0; sleep 3; links up eth0' $F --seconds 20
# Rail 0 down on both guests at once (each 3 s after its own end connected).
want bd && scn bd 18704 ab 'sleep 3; links down eth0; sleep 3; links up eth0' $F --seconds 20
# Flapping: the sender's rail 0 down and up three times, about a second each.
want fl && scn fl 18705 b 'sleep 3; for k in 1 2 3; do links down eth0; sleep 1; links up eth0; sleep 1; done' \
    $F --seconds 17
# Two NICs down on the sender: everything on rxe2 for 4 s, then both return.
want tw && scn tw 18706 b 'sleep 3; links down eth0 eth1; sleep 4; links up eth0 eth1' $F --seconds 22
# Two QPs per lane (both ends): writes alternate between the QPs, and a payload written
# in place must go on the QP that carries its header; the sender's rail 0 down for 3 s.
export RAILOVER_QPS_PER_LANE=2
want q2 && scn q2 18708 b 'sleep 3; links down eth0; sleep 3; links up eth0' $F --seconds 18
unset RAILOVER_QPS_PER_LANE
# Every payload in place (RAILOVER_ZERO_COPY=always, as memory the CPU cannot read needs),
# 256 KiB messages, resent ones included, through the sender's rail 0 going down.
export RAILOVER_ZERO_COPY=always
want za && scn za 18709 b 'sleep 3; links down eth0; sleep 3; links up eth0' $F --seconds 18
unset RAILOVER_ZERO_COPY
# GPU memory (fault-peer --gpu: NCCL_PTR_CUDA on host memory, RAILOVER_GDR=force) on the
# comms of NICs that take it; rxe1 left out of GPU memory by RAILOVER_GDR_HCA on one
# guest, so its comm there runs on host memory, and when the sender's rail 0 goes down
# the moved comm's GPU memory must not land on rxe1: refused there, that NIC left out
# for the comm, everything on rxe2. gs: the sender's rxe1; gr: the receiver's (which
# tells the sender).
export RAILOVER_GDR=force
[ "$role" = b ] && export RAILOVER_GDR_HCA='^=rxe1'
want gs && scn gs 18713 b 'sleep 3; links down eth0; sleep 3; links up eth0' $F --gpu --seconds 18
unset RAILOVER_GDR_HCA
[ "$role" = a ] && export RAILOVER_GDR_HCA='^=rxe1'
want gr && scn gr 18714 b 'sleep 3; links down eth0; sleep 3; links up eth0' $F --gpu --seconds 18
unset RAILOVER_GDR_HCA
# GPU memory on every NIC of both guests, and the receiver flushes every receive before
# it reads it (iflush, as NCCL's proxy does with GDR): the receiver's rail 0 down for 3 s.
# The flushes of the comm that moved must not fail for the NIC that went down.
want gf && scn gf 18715 a 'sleep 3; links down eth0; sleep 3; links up eth0' $F --gpu --seconds 20
unset RAILOVER_GDR
# The sender SIGKILLed mid-stream: the receiver must fail its comms, not hang.
want kp && scn kp 18707 b 'sleep 3; kill -9 $p; echo "VT: kp sender killed $(now)s"' \
    --per-dev 1 --size 256K --depth 4 --grace 4 --tick-ms 250 --seconds 15
# ABI conformance (tests/abi/driver.c, ncclNetPlugin_v12) over rxe lanes: the driver
# forks a sender and a receiver in this guest, so its lanes connect rxe to itself. Both
# share the guest's one emulated CPU: a lane's handshake there outlasts the pre-auth
# deadline that a 3 s completion timeout gives (6 s; the acceptor drops the lane, the
# connect fails with "peer closed the connection"), hence a longer timeout here.
if [ "$role" = a ] && want abi; then
    t=$(now)
    RAILOVER_TRANSPORT=verbs RAILOVER_COMPLETION_TIMEOUT_MS=8000 timeout 330 /bin/abi-driver /lib/librailover.so 12 >/tmp/abi 2>&1
    echo "VT: abi rc=$? $(awk "BEGIN { print $(now) - $t }")s"
    echo "VT: abi| $(grep -c '^PASS' /tmp/abi) PASS lines"
    grep -E '^(FAIL|driver)|failed test|check failed|fabric|WARN|ERROR' /tmp/abi | grep -v NCCL_PTR_CUDA |
        head -30 | sed 's/^/VT: abi| /'
    grep -E '^PASS (recv|send)\.data' /tmp/abi | sed 's/^/VT: abi| /'
fi
# The same with every data buffer registered as GPU memory (NCCL_PTR_CUDA on host
# memory, which RAILOVER_GDR=force lets the plugin take without nvidia-peermem): the
# plugin must move every payload with the NIC, in place, since the CPU may not touch
# GPU memory; a payload it tried to copy would fail its lane and, with every pair the
# same, the comm.
if [ "$role" = a ] && want gd; then
    t=$(now)
    RAILOVER_TRANSPORT=verbs RAILOVER_GDR=force RAILOVER_ABI_PTR=cuda RAILOVER_COMPLETION_TIMEOUT_MS=8000 \
        timeout 330 /bin/abi-driver /lib/librailover.so 12 >/tmp/gd 2>&1
    echo "VT: gd rc=$? $(awk "BEGIN { print $(now) - $t }")s"
    grep -E '^(FAIL|driver)|failed test|check failed|GPU memory|WARN|ERROR' /tmp/gd |
        head -30 | sed 's/^/VT: gd| /'
    grep -E '^PASS (recv|send)\.data|flushes \(' /tmp/gd | sed 's/^/VT: gd| /'
fi
# Placement while rxe0 and rxe1 were down (sender), and the killed sender's last data.
grep -s '"event":"lanes"' /tmp/tw | grep '"counts":\[0,0,[1-9]' | head -1 | sed 's/^/VT: tw| /'
grep -s '"event":"tick"' /tmp/kp | grep '"bytes":\[[0-9,]*[1-9]' | tail -1 | sed 's/^/VT: kp| last data /'
want base && { sed 's/^/VT: bw| /' /tmp/bw; sed 's/^/VT: lat| /' /tmp/lat; }
echo "VT: done $(now)s"
poweroff -f
EOF
chmod +x "$run/top/init"
(cd "$run/top" && find . | cpio -o -H newc 2>/dev/null | gzip -1) >"$run/top.cpio.gz"
cat "$base" "$run/top.cpio.gz" >"$run/initrd.gz"

# --- boot -----------------------------------------------------------------------------
accel=tcg
if [ -w /dev/kvm ] && grep -qE '\b(vmx|svm)\b' /proc/cpuinfo; then accel=kvm; fi
if [ "$accel" = tcg ]; then
    echo "verbs tier: no usable KVM (no vmx/svm or /dev/kvm): guests run under TCG emulation"
fi
# Probe that QEMU starts at all (it quits at once through its monitor).
echo quit | timeout 20 qemu-system-x86_64 -accel "$accel" -machine none -nodefaults \
    -display none -serial none -monitor stdio >/dev/null 2>&1 ||
    skip "qemu-system-x86_64 -accel $accel does not start here"
# Three loopback ports for the rails, free now (another run may be using others).
base_port=$((20000 + RANDOM % 20000))
for _ in $(seq 50); do
    busy=0
    for r in 0 1 2; do
        ss -Htln "sport = :$((base_port + r))" 2>/dev/null | grep -q . && busy=1
    done
    [ $busy -eq 0 ] && break
    base_port=$((20000 + RANDOM % 20000))
done
kernel=$kroot/boot/vmlinuz-$kver
# RAILOVER_VERBS_STEPS=abi,fo (say) runs only those steps, for working on one; the tier
# then ends with a SKIP line instead of "passed".
all_steps="base fp sc pb pl fo rd bd fl tw q2 za gs gr gf kp abi gd"
only=${RAILOVER_VERBS_STEPS:-}
for st in ${only//,/ }; do
    case " $all_steps " in *" $st "*) ;; *) fail "RAILOVER_VERBS_STEPS=$only: no step '$st' (steps: $all_steps)" ;; esac
done
# About 5 minutes of tests under TCG; the limit leaves room for a slow, shared host.
guest_limit=600
qemu() {
    timeout "$guest_limit" qemu-system-x86_64 -accel "$accel" -m 768 -smp 1 -cpu max -kernel "$kernel" \
        -initrd "$run/initrd.gz" -nographic -no-reboot -nic none "$@"
}
nics_a=() nics_b=()
for r in 0 1 2; do
    nics_a+=(-netdev "socket,id=r$r,listen=127.0.0.1:$((base_port + r))"
        -device "virtio-net-pci,netdev=r$r,mac=52:54:00:aa:0$r:01")
    nics_b+=(-netdev "socket,id=r$r,connect=127.0.0.1:$((base_port + r))"
        -device "virtio-net-pci,netdev=r$r,mac=52:54:00:bb:0$r:02")
done
echo "verbs tier: booting two guests ($kver, $accel, rails on 127.0.0.1:$base_port-$((base_port + 2)))"
tboot=$(date +%s)
qemu -append "console=ttyS0 quiet panic=-1 vt_role=a${only:+ vt_steps=$only}" "${nics_a[@]}" >"$cache/guest-a.log" 2>&1 &
qa=$!
# Guest b connects once a's three listeners are up (QEMU opens them before booting).
for _ in $(seq 200); do
    up=0
    for r in 0 1 2; do ss -Htln "sport = :$((base_port + r))" | grep -q . && up=$((up + 1)); done
    [ $up -eq 3 ] && break
    kill -0 $qa 2>/dev/null || break
    sleep 0.1
done
[ "${up:-0}" -eq 3 ] || fail "guest a did not open its rail sockets; its log: $(tail -5 "$cache/guest-a.log")"
qemu -append "console=ttyS0 quiet panic=-1 vt_role=b${only:+ vt_steps=$only}" "${nics_b[@]}" >"$cache/guest-b.log" 2>&1 &
qb=$!
wait $qb
rb=$?
wait $qa
ra=$?
qa="" qb=""
guest_s=$(($(date +%s) - tboot))
a=$cache/guest-a.log b=$cache/guest-b.log
# -o: the first console line carries terminal escapes before the marker.
grep -ho 'VT: .*\|verbs-check: .*' "$a" | sed 's/^/  a| /'
grep -ho 'VT: .*\|verbs-check: .*' "$b" | sed 's/^/  b| /'
# Diagnostics for CI, whose log keeps only the tail: after the check lines, what the
# failed steps left in both guests (exit codes, summaries, setup failures, the first
# request errors, WARN/ERROR lines such as lanes turned away), at most 40 lines.
diag_step() { # STEP GUEST-LOG
    grep -ao "VT: $1\( rc=\|| \|\.err| \| eth\).*\|verbs-check: .*FAIL.*" "$2" |
        grep -aE "VT: $1 (rc=|eth)|\"event\":\"(summary|setup-failed|bad|error)\"|WARN|ERROR|gave up|turned away|FAIL|VT: $1\| [^{]" |
        awk '/"event":"error"/ { if (++e > 3) next } 1' | cut -c1-240
}
diagnose() { # STEP...
    echo "verbs tier: diagnostics for $*:"
    local s
    for s in "$@"; do
        diag_step "$s" "$a" | sed "s/^/  a| /"
        diag_step "$s" "$b" | sed "s/^/  b| /"
    done | head -40
}
unfinished() {
    echo "verbs tier: FAIL: $1 (logs: $a $b)"
    # The first steps that ended badly on either guest (a later step often only timed
    # out waiting for its peer), then what each guest printed last.
    local st bad=()
    for st in $all_steps; do
        grep -aq "VT: $st rc=[1-9]" "$a" "$b" && bad+=("$st")
    done
    [ ${#bad[@]} -gt 0 ] && diagnose "${bad[@]:0:3}"
    echo "verbs tier: diagnostics: the guests' last lines:"
    for g in a b; do
        eval "tail -16 \$$g" | tr -d '\r' | grep -av '^$' | cut -c1-200 | tail -12 | sed "s/^/  $g| /"
    done
    exit 1
}
[ $ra -eq 124 ] || [ $rb -eq 124 ] && unfinished "a guest ran past its $guest_limit s limit"
grep -q 'VT: done' "$a" && grep -q 'VT: done' "$b" || unfinished "a guest did not finish its tests"

# --- verdict ---------------------------------------------------------------------------
status=0
failed_steps=()
check() { # STEP NAME COMMAND...: STEP names what the diagnostics show on a failure
    local step=$1 name=$2 group=$1
    shift 2
    case $step in bw | lat | check | flush | doctor | hca | seal) group=base ;; esac
    [ -z "$only" ] || case ",$only," in *",$group,"*) ;; *) return 0 ;; esac
    if "$@"; then
        echo "verbs tier: ok   $name"
    else
        echo "verbs tier: FAIL $name"
        status=1
        case " ${failed_steps[*]} " in *" $step "*) ;; *) failed_steps+=("$step") ;; esac
    fi
}
# Guest log readers: a step's exit code, a field of its summary, whether a line is there.
rc_of() { grep -ao "VT: $1 rc=[0-9]*" "$2" | tail -1 | sed 's/.*rc=//'; }
cost_of() { grep -ao "VT: $1 rc=[0-9]* [0-9.]*s" "$a" "$b" | sed 's/.* //; s/s$//' | sort -n | tail -1; }
field_of() { grep -ao "VT: $1| {\"event\":\"summary\".*" "$3" | grep -o "\"$2\":[0-9]*" | tail -1 | sed 's/.*://'; }
has() { grep -aqE "$@"; }
rc_is() { [ "$(rc_of "$1" "$2")" = "$3" ]; }
same_msgs() { local r s; r=$(field_of "$1" msgs "$a"); s=$(field_of "$1" msgs "$b"); [ -n "$r" ] && [ "$r" = "$s" ] && [ "$r" -gt 0 ]; }
# perftest's result rows: bytes, iterations, peak, average Gb/s, Mpps / bytes, iterations,
# average us, transactions/s.
bw_gbit=$(sed -n 's/^VT: bw| *\([0-9][0-9]* .*\)/\1/p' "$b" | awk '{print $4}' | tail -1)
bw=$(sed -n 's/^VT: bw| *\([0-9][0-9]* .*\)/\1/p' "$b" | awk '{print $4 " Gb/s average over " $2 " x " $1 " B writes"}' | tail -1)
lat_us=$(sed -n 's/^VT: lat| *\([0-9][0-9]* .*\)/\1/p' "$b" | awk '{print $3}' | tail -1)
lat=$(sed -n 's/^VT: lat| *\([0-9][0-9]* .*\)/\1/p' "$b" | awk '{print $3 " us average over " $2 " x " $1 " B writes"}' | tail -1)
check bw "ib_write_bw over rxe0 ran" grep -q 'VT: bw rc=0' "$b"
check lat "ib_write_lat over rxe0 ran" grep -q 'VT: lat rc=0' "$b"
for r in 0 1 2; do
    check check "verbs-check rail rxe$r (client)" grep -q "verbs-check: rail rxe$r:1 PASS" "$b"
    check check "verbs-check rail rxe$r (server)" grep -q "verbs-check: rail rxe$r:1 PASS" "$a"
    check flush "verbs-check flush QP of rxe$r: READs bring the buffer's bytes back, a stale key fails (guest b)" grep -q "verbs-check: flush rxe$r:1 PASS" "$b"
    check flush "verbs-check flush QP of rxe$r: READs bring the buffer's bytes back, a stale key fails (guest a)" grep -q "verbs-check: flush rxe$r:1 PASS" "$a"
done
check doctor "doctor shows rxe2:1 ACTIVE Ethernet with a rail" grep -qE 'VT: doctor\| +rxe2:1 +ACTIVE +Ethernet .* rail [0-9]' "$a"
check doctor "doctor marks the IPv4 RoCE v2 GID of rxe0" grep -q 'VT: doctor| .*\*gid\[[0-9]*\] RoCEv2 ::ffff:192.0.2.1' "$a"
check doctor "doctor says rxe takes host memory only: no peer memory, no dma-buf MRs (EOPNOTSUPP)" grep -qE 'VT: doctor\| +host memory only: no GPU peer-memory client.*no dma-buf registration \(Operation not supported' "$a"
check doctor "doctor says ibv_fork_init found fork safety unneeded: the guest kernel (6.1) copies pinned pages on fork" grep -q 'VT: doctor|   fork safety: unneeded' "$a"
check hca "RAILOVER_HCA=^=rxe1 leaves rxe0 and rxe2" sh -c "grep -q 'VT: hca| verbs-check: nic rxe0:1' '$a' && grep -q 'VT: hca| verbs-check: nic rxe2:1' '$a' && grep -q 'VT: hca| verbs-check: skipped rxe1:1: not selected by RAILOVER_HCA' '$a' && ! grep -q 'VT: hca| verbs-check: nic rxe1' '$a'"
check seal "verbs-check --seal on rxe0: the sealed QP's own write completed, the peer's write to it was refused" sh -c "grep -qE 'VT: seal\| verbs-check: rail rxe0:1 PASS.*own writes on 1 QP\(s\) completed; ours to it were refused.*remote (access|invalid request) error' '$a' && grep -q 'VT: seal| verbs-check: rail rxe0:1 PASS' '$b'"
check check "verbs-check exited 0 on guest a" grep -q 'VT: check rc=0' "$a"
check check "verbs-check exited 0 on guest b" grep -q 'VT: check rc=0' "$b"
check fp "fault-peer over verbs lanes: receiver saw every byte (exit 0)" rc_is fp "$a" 0
check fp "fault-peer over verbs lanes: sender finished (exit 0)" rc_is fp "$b" 0
check fp "the plugin ran on the verbs fabric" grep -q 'VT: fp.err| .*fabric verbs' "$a"
check pb "fault-peer, one comm of 1 MiB messages on rxe0: every byte once (exit 0 both ends)" sh -c "grep -q 'VT: pb rc=0' '$a' && grep -q 'VT: pb rc=0' '$b'"
# Zero copy: with no fault every message goes out once, so the sender's NIC writes each
# one straight into the receive buffer the receiver offered.
placed_all() { local p s; p=$(field_of "$1" placed_bytes "$b"); s=$(field_of "$1" bytes "$b"); [ -n "$p" ] && [ "${s:-0}" -gt 0 ] && [ "$p" -ge "$s" ]; }
check pb "zero copy: every byte the sender completed was written in place by its NIC" placed_all pb
check fp "zero copy: every byte the sender completed was written in place by its NIC" placed_all fp
# Registration: each comm's memory on its own device only while nothing fails (fault-peer
# registers one range per slot: 3 comms x depth 4, on both ends); a failover registers
# the moved comm's ranges on the backups as their lanes first use them.
regs_of() { [ "$(field_of "$1" registrations "$a")" = "$2" ] && [ "$(field_of "$1" registrations "$b")" = "$2" ]; }
check fp "registration: each comm's memory on its own device only (12 ranges, 12 registrations each end)" regs_of fp 12
regs_grew() { [ "$(field_of "$1" registrations "$b")" -gt "$2" ] 2>/dev/null; }
abi_clean() { grep -aq 'VT: abi| PASS recv.data' "$a" && grep -aq 'VT: abi| PASS send.data' "$a" && ! grep -aq 'VT: abi| FAIL' "$a"; }
check abi "ABI conformance (driver.c, ncclNetPlugin_v12) over rxe lanes: driver exit 0" rc_is abi "$a" 0
check abi "ABI conformance over rxe lanes: both data phases passed, no FAIL line" abi_clean
gd_clean() { grep -aq 'VT: gd| PASS recv.data' "$a" && grep -aq 'VT: gd| PASS send.data' "$a" && ! grep -aqE 'VT: gd\| (FAIL|.*came through the stream|.*only a NIC can send)' "$a"; }
check gd "GPU-typed memory (RAILOVER_GDR=force, regMr NCCL_PTR_CUDA) over rxe lanes: driver exit 0" rc_is gd "$a" 0
check gd "GPU-typed memory: both data phases passed with every payload in place, none copied" gd_clean
# NCCL's flush after a receive into GPU memory: a request (the READ on the device's flush
# QP), which the driver waits for with test().
gd_flushed() { grep -aoE 'VT: gd\| .*\(recv\).* [0-9]+ flushes \([1-9][0-9]* awaited\)' "$a" | grep -q .; }
check gd "GPU-typed memory: iflush after receives returned requests that completed (READs on the flush QP)" gd_flushed
check pl "fault-peer ping/pong, 8 B each way on rxe0: every round trip echoed intact (exit 0 both ends)" sh -c "grep -q 'VT: pl rc=0' '$a' && grep -q 'VT: pl rc=0' '$b'"
# Exactly once (the TCP tier's meaning): both ends exit 0 (no damage, no request error,
# every comm ran to its END) and the receiver verified what the sender completed.
exactly_once() { # STEP WHAT
    check "$1" "$2: receiver saw every byte once, in order (exit 0)" rc_is "$1" "$a" 0
    check "$1" "$2: sender finished without a failed request (exit 0)" rc_is "$1" "$b" 0
    check "$1" "$2: receiver verified every message the sender completed" same_msgs "$1"
}
lost() { has "VT: $1.err\| .*NIC $2 lost its link" "$3"; }
back() { has "VT: $1.err\| .*NIC $2 is up again" "$3"; }
# sc: 64 comms at once, and strangers that never authenticate.
exactly_once sc "64 comms"
comms_of() { [ "$(field_of "$1" comms "$a")" = "$2" ] && [ "$(field_of "$1" comms "$b")" = "$2" ]; }
check sc "64 comms: both ends ran all 64 over verbs lanes" comms_of sc 64
check sc "64 comms: 16 connections that never said Hello made the receiver pin nothing" grep -q 'VT: sc strangers 16 pinned 0 KiB' "$a"
check sc "64 comms: the receiver turned those connections away at its pre-authentication deadline" has 'VT: sc.err\| .*turned away an incoming connection' "$a"
# fo: the sender's rail 0 down for 4 s.
exactly_once fo "sender's rail 0 down"
check fo "sender's rail 0 down: eth0 down reached the engine as rxe0's carrier" lost fo rxe0 "$b"
check fo "sender's rail 0 down: a comm left rxe0, striped over both survivors" has 'VT: fo.err\| .*failover comm=[0-9]+ rxe0->[^ ]* => .* spread_over=[2-9]' "$b"
check fo "sender's rail 0 down: eth0 up reached the engine as rxe0's carrier" back fo rxe0 "$b"
check fo "sender's rail 0 down: traffic failed back onto rxe0" has 'VT: fo.err\| .*failback comm=[0-9]+ .* => rxe0->' "$b" "$a"
check fo "sender's rail 0 down: the moved comm's memory registered on the backups when it moved" regs_grew fo 12
# regMr registers on the comm's own NIC at once (3 comms x depth 4 buffers), before any
# lane moved a byte: the backups' registrations above came later, when comms moved there.
regs_at_connect() { [ "$(grep -ao "VT: $1| {\"event\":\"connected\".*" "$2" | grep -o '"registrations":[0-9]*' | tail -1 | sed 's/.*://')" = "$3" ]; }
check fo "sender's rail 0 down: regMr registered each comm's 4 buffers on its own NIC before traffic (12 at connect)" regs_at_connect fo "$b" 12
check fo "receiver: regMr registered each comm's 4 buffers on its own NIC before traffic (12 at connect)" regs_at_connect fo "$a" 12
# rd: the receiver's rail 0 down for 3 s.
exactly_once rd "receiver's rail 0 down"
lost_and_back() { lost "$1" "$2" "$3" && back "$1" "$2" "$3"; }
check rd "receiver's rail 0 down: the receiver's engine saw rxe0 go down and come back" lost_and_back rd rxe0 "$a"
check rd "receiver's rail 0 down: a comm failed over off rail 0" has 'VT: rd.err\| .*failover comm=[0-9]+ rxe0->' "$a" "$b"
check rd "receiver's rail 0 down: traffic failed back onto rail 0" has 'VT: rd.err\| .*failback comm=[0-9]+ .* => rxe0->' "$a" "$b"
# bd: rail 0 down on both guests at once.
exactly_once bd "rail 0 down on both sides"
lost_on_both() { lost "$1" "$2" "$a" && lost "$1" "$2" "$b"; }
check bd "rail 0 down on both sides: both engines saw rxe0 go down" lost_on_both bd rxe0
check bd "rail 0 down on both sides: a comm failed over off rail 0" has 'VT: bd.err\| .*failover comm=[0-9]+ rxe0->' "$a" "$b"
check bd "rail 0 down on both sides: traffic failed back onto rail 0" has 'VT: bd.err\| .*failback comm=[0-9]+ .* => rxe0->' "$a" "$b"
# fl: the sender's rail 0 flapping, three times down and up.
exactly_once fl "flapping rail 0 (3 x 1 s)"
cuts_seen() { [ "$(grep -ac "VT: $1.err| .*NIC $2 lost its link" "$3")" -ge "$4" ]; }
check fl "flapping rail 0: the engine saw every cut" cuts_seen fl rxe0 "$b" 3
# A flap can take a lane down while its comm is already striped elsewhere, which logs
# the lane's failure and no failover line of rxe0's own.
check fl "flapping rail 0: the cuts took traffic off rail 0 (a lane on rxe0 failed)" has 'VT: fl.err\| .*(failover comm=[0-9]+ rxe0->|comm [0-9]+: lane on nic0 -> [^ ]* failed)' "$b"
# tw: rxe0 and rxe1 down on the sender for 4 s.
exactly_once tw "two NICs down"
check tw "two NICs down: the engine saw rxe0 and rxe1 go down" sh -c "grep -aq 'VT: tw.err| .*NIC rxe0 lost its link' '$b' && grep -aq 'VT: tw.err| .*NIC rxe1 lost its link' '$b'"
check tw "two NICs down: every lane on rxe2 while they were down" has 'VT: tw\| .*"event":"lanes".*"counts":\[0,0,[1-9]' "$b"
check tw "two NICs down: traffic failed back when they returned" has 'VT: tw.err\| .*failback comm=[0-9]+ .* => rxe[01]->' "$b" "$a"
# q2: two QPs per lane through a failover, payloads written in place.
exactly_once q2 "two QPs per lane, sender's rail 0 down"
check q2 "two QPs per lane: the plugin opened 2 QPs per lane" has 'VT: q2.err\| .*fabric verbs.*2 QP\(s\) per lane' "$b"
check q2 "two QPs per lane: a comm failed over off rail 0" has 'VT: q2.err\| .*failover comm=[0-9]+ rxe0->' "$b"
placed_most() { local p s; p=$(field_of "$1" placed_bytes "$b"); s=$(field_of "$1" bytes "$b"); [ -n "$p" ] && [ "${s:-0}" -gt 0 ] && [ $((p * 10)) -ge $((s * 9)) ]; }
check q2 "two QPs per lane: at least 90% of the bytes written in place (replays come through the ring)" placed_most q2
# za: every payload in place through a failover.
exactly_once za "every payload in place, sender's rail 0 down"
check za "every payload in place: the plugin ran with zero copy always" has 'VT: za.err\| .*fabric verbs.*zero copy always' "$b"
check za "every payload in place: a comm failed over off rail 0" has 'VT: za.err\| .*failover comm=[0-9]+ rxe0->' "$b"
check za "every payload in place: the sender's NIC wrote every byte it completed" placed_all za
no_copies() { [ "$(field_of "$1" streamed_in "$a")" = 0 ] && [ "$(field_of "$1" streamed_out "$b")" = 0 ]; }
check za "every payload in place: no payload byte went through a ring, resent ones included (0 streamed either end)" no_copies za
# gs/gr: GPU memory kept off the NIC that cannot take it.
gpu_on() { # STEP GUEST-LOG: comms 0 and 2 in GPU memory, comm 1 (on rxe1) in host memory
    has "VT: $1.mem\| fault-peer: comm 0 .*NCCL_PTR_CUDA" "$2" && has "VT: $1.mem\| fault-peer: comm 2 .*NCCL_PTR_CUDA" "$2" &&
        has "VT: $1.mem\| fault-peer: comm 1 on device 1 .*NCCL_PTR_HOST" "$2"
}
never_copied() { ! has "VT: $1.mem\| .*(came through the stream|only a NIC can send)" "$a" && ! has "VT: $1.mem\| .*(came through the stream|only a NIC can send)" "$b"; }
exactly_once gs "GPU memory, the sender's rxe1 without it, sender's rail 0 down"
check gs "GPU memory, the sender's rxe1 without it: comm 1 on host memory there (ptrSupport), comms 0 and 2 on GPU memory" gpu_on gs "$b"
check gs "GPU memory, the sender's rxe1 without it: a comm failed over off rxe0" has 'VT: gs.err\| .*failover comm=[0-9]+ rxe0->' "$b"
check gs "GPU memory, the sender's rxe1 without it: rxe1 refused the moved comm's GPU memory, which left it (counted exclusion)" has 'VT: gs.mem\| .*rxe1 cannot register the comm.s memory' "$b"
check gs "GPU memory, the sender's rxe1 without it: no GPU payload was copied by the CPU" never_copied gs
check gs "GPU memory, the sender's rxe1 without it: traffic failed back onto rxe0" has 'VT: gs.err\| .*failback comm=[0-9]+ .* => rxe0->' "$b" "$a"
exactly_once gr "GPU memory, the receiver's rxe1 without it, sender's rail 0 down"
check gr "GPU memory, the receiver's rxe1 without it: comm 1 on host memory there (ptrSupport), comms 0 and 2 on GPU memory" gpu_on gr "$a"
check gr "GPU memory, the receiver's rxe1 without it: a comm failed over off rxe0" has 'VT: gr.err\| .*failover comm=[0-9]+ rxe0->' "$b"
check gr "GPU memory, the receiver's rxe1 without it: the receiver's rxe1 refused the moved comm's receive buffers (WARN)" has 'VT: gr.mem\| .*rxe1 cannot register the comm.s receive buffers' "$a"
check gr "GPU memory, the receiver's rxe1 without it: the receiver told the sender, which left the peer's NIC 1 out for the comm" has 'VT: gr.mem\| .*peer[0-9]+/nic1 cannot register the comm.s memory' "$b"
check gr "GPU memory, the receiver's rxe1 without it: no GPU payload was copied by the CPU" never_copied gr
check gr "GPU memory, the receiver's rxe1 without it: traffic failed back onto rxe0" has 'VT: gr.err\| .*failback comm=[0-9]+ .* => rxe0->' "$b" "$a"
# gf: receives into GPU memory flushed through the receiver's rail 0 going down.
exactly_once gf "GPU memory flushed, receiver's rail 0 down"
field_at_least() { local v; v=$(field_of "$1" "$2" "$a"); [ -n "$v" ] && [ "$v" -ge "$3" ]; }
check gf "GPU memory flushed: the receiver flushed every receive into GPU memory (iflush requests completed)" field_at_least gf flushes 1
check gf "GPU memory flushed: a comm failed over off the receiver's rxe0" has 'VT: gf.err\| .*failover comm=[0-9]+ rxe0->' "$a" "$b"
check gf "GPU memory flushed: flushes met rxe0 down and counted it done (its lanes fenced) instead of failing the comm" field_at_least gf flushes_excused 1
check gf "GPU memory flushed: traffic failed back onto rail 0" has 'VT: gf.err\| .*failback comm=[0-9]+ .* => rxe0->' "$a" "$b"
# kp: the sender SIGKILLed mid-stream.
timeout_ms=$(grep -ao 'VT: completion timeout [0-9]*' "$a" | grep -o '[0-9]*$' | tail -1)
probe_ms=$(grep -ao 'probe timeout [0-9]*' "$a" | grep -o '[0-9]*$' | tail -1)
# The receiver hears the lanes close at once, then waits a completion timeout and a
# probe for a replacement lane before it fails the comm (seen: 5.2-6.0 s); 4 s more for
# a slow, shared host.
kp_bound=$((${timeout_ms:-3000} + ${probe_ms:-2000} + 4000))
kp_last_data=$(grep -ao 'VT: kp| last data .*' "$a" | grep -o '"t":[0-9]*' | sed 's/.*://' | tail -1)
kp_last_err=$(grep -ao 'VT: kp| {"event":"error".*' "$a" | grep -o '"t":[0-9]*' | sed 's/.*://' | sort -n | tail -1)
kp_after=$(( ${kp_last_err:-0} - ${kp_last_data:-0} ))
check kp "killed sender: the receiver exited by itself with request errors, no damage (exit 3)" rc_is kp "$a" 3
kp_settled() { [ "$(field_of kp failed "$a")" = 3 ] && [ "$(field_of kp stalled "$a")" = 0 ] && [ "$(field_of kp bad "$a")" = 0 ]; }
check kp "killed sender: the receiver failed every comm, none left stalled" kp_settled
check kp "killed sender: the receiver's errors are ncclSystemError/ncclRemoteError only" sh -c "grep -ao 'VT: kp| {\"event\":\"summary\".*' '$a' | grep -qE '\"codes\":\[(\[[26],[0-9]+\],?)+\]'"
kp_prompt() { [ -n "$kp_last_data" ] && [ -n "$kp_last_err" ] && [ "$kp_after" -le "$kp_bound" ]; }
check kp "killed sender: the last error within completion + probe timeout + 4 s of the last data" kp_prompt
fpbytes=$(field_of fp bytes "$a")
pbbytes=$(field_of pb bytes "$a")
fobytes=$(field_of fo bytes "$a")
fomove=$(grep -ao 'VT: fo.err| .*failover comm=.*' "$b" | grep -o 'failover comm=.*' | head -1)
foback=$(grep -aho 'VT: fo.err| .*failback comm=.*' "$b" "$a" | grep -o 'failback comm=.*' | head -1)
# Figures, not asserted: TCG makes them meaningless for hardware.
pb_mbit=$(awk "BEGIN { printf \"%.0f\", ${pbbytes:-0} * 8 / 4 / 1e6 }")
ratio_bw=$(awk "BEGIN { b = ${bw_gbit:-0} * 1000; if (b > 0) printf \"%.2f\", $pb_mbit / b; else print \"?\" }")
ran() { [ -z "$only" ] || case ",$only," in *",$1,"*) ;; *) false ;; esac; }
ran base && echo "verbs tier: baseline ib_write_bw ${bw:-?}; ib_write_lat ${lat:-?}"
ran fp && echo "verbs tier: plugin over verbs lanes (fault-peer, 3 comms on 3 rails, 256 KiB messages): ${fpbytes:-?} bytes verified in a 4 s send window (~$(( ${fpbytes:-0} * 8 / 4 / 1000000 )) Mb/s aggregate)"
pinned_of() { grep -ao "VT: sc pinned $1 [0-9]*" "$2" | grep -o '[0-9]*$' | tail -1; }
per_comm() { awk "BEGIN { v = ${1:-0}; if (v > 0) printf \"%.2f MiB\", v / 1024 / 64; else print \"?\" }"; }
ran sc && echo "verbs tier: 64 comms: pinned per comm with the comms connected: receiver $(per_comm "$(pinned_of connected "$a")"), sender $(per_comm "$(pinned_of connected "$b")"); with data flowing (64 KiB messages, depth 2): receiver $(per_comm "$(pinned_of flowing "$a")"), sender $(per_comm "$(pinned_of flowing "$b")"); 16 unauthenticated connections: $(grep -ao 'VT: sc strangers 16 pinned [0-9]* KiB' "$a" | grep -o '[0-9]* KiB' | tail -1) more at the receiver"
ran pb && echo "verbs tier: throughput ratio: one comm, 1 MiB messages, depth 4 on rxe0: ~$pb_mbit Mb/s vs ib_write_bw ${bw_gbit:-?} Gb/s: railover/ib_write_bw = $ratio_bw"
pl_us=$(grep -ao 'VT: pl| {"event":"pingpong".*' "$b" | grep -o '"one_way_us":[0-9.]*' | sed 's/.*://' | tail -1)
ratio_lat=$(awk "BEGIN { l = ${lat_us:-0}; if (l > 0 && \"${pl_us}\" != \"\") printf \"%.2f\", ${pl_us:-0} / l; else print \"?\" }")
ran pl && echo "verbs tier: latency ratio: 8 B ping-pong, one comm each way on rxe0: ${pl_us:-?} us one way (half the round trip) vs ib_write_lat ${lat_us:-?} us: railover/ib_write_lat = $ratio_lat"
ran fo && echo "verbs tier: failover over verbs lanes (eth0 down 4 s on the sender): ${fobytes:-?} bytes verified in a 22 s window; ${fomove:-no failover line}; ${foback:-no failback line}"
foplaced=$(field_of fo placed_bytes "$b")
foregs=$(field_of fo registrations "$b")
ran fo && echo "verbs tier: zero copy through the failover: the sender's NIC wrote ${foplaced:-?} of ${fobytes:-?} bytes in place (replays come through the ring); the sender's registrations grew from 12 to ${foregs:-?} on the backups"
ran kp && echo "verbs tier: killed sender: the receiver's last error $kp_after ms after its last data (bound $kp_bound ms)"
costs=""
for s in fp sc pb pl fo rd bd fl tw q2 za gs gr kp abi gd; do ran $s && costs="$costs $s $(cost_of $s)s"; done
echo "verbs tier: guest seconds per step:$costs"
echo "verbs tier: guests ran ${guest_s}s under $accel; whole tier $(($(date +%s) - t0))s"
if [ $status -eq 0 ] && [ -n "$only" ]; then
    echo "verbs tier: SKIP: every step but $only (RAILOVER_VERBS_STEPS)"
elif [ $status -eq 0 ]; then
    echo "verbs tier: passed"
else
    diagnose "${failed_steps[@]}"
fi
exit $status
