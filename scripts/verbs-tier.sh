#!/usr/bin/env bash
# The Soft-RoCE tier: railover's verbs layer against the real kernel verbs stack.
#
# Two QEMU guests booted from Debian's stock kernel (which ships rdma_rxe) and a busybox
# initramfs, joined by three virtual links (rails) that QEMU carries over host loopback
# TCP only. Every guest NIC gets an rxe device. Inside the guests:
#   1. the raw fabric baseline: ib_write_bw and ib_write_lat (perftest) over rxe0;
#   2. `railover verbs-check` on every rail: RC QPs set up from discovery, checksummed
#      RDMA WRITE_WITH_IMM both ways, then a fenced peer must fail the next write;
#   3. the plugin's comms over verbs lanes (fault-peer, one comm per rail);
#   4. failover: the same, with the sender's eth0 (rxe0's netdev) down for 4 s mid-stream:
#      every byte once and in order, the comm striped over both survivors, fail-back.
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
echo "verbs tier: building railover (verbs-check)"
timeout 900 cargo build -p railover-cli --quiet 2>&1 | tail -20
bin=target/debug/railover
[ -x "$bin" ] || fail "cargo build did not produce $bin"
run=$(mktemp -d)
trap 'rm -rf "$run"; [ -n "${qa:-}" ] && kill "$qa" 2>/dev/null; [ -n "${qb:-}" ] && kill "$qb" 2>/dev/null' EXIT
mkdir -p "$run/top/bin"
objcopy --strip-debug "$bin" "$run/top/bin/railover" || cp "$bin" "$run/top/bin/railover"
for l in $(ldd "$bin" | grep -oE '/[^ ]+\.so[^ ]*'); do
    mkdir -p "$run/top/$(dirname "$l")" && cp -L "$l" "$run/top/$l"
done
cat >"$run/top/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /mods/order); do insmod /mods/$m.ko || echo "VT: insmod $m failed"; done
role=$(sed -n 's/.*vt_role=\([ab]\).*/\1/p' /proc/cmdline)
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
echo "VT: role $role up $(cut -d' ' -f1 /proc/uptime)s, rxe0 IPv4 GID index ${gidx:-none}"
# Bounded retries: the other guest may not be listening yet.
retry() { n=0; until "$@"; do n=$((n + 1)); [ $n -ge 40 ] && return 1; sleep 1; done; }
PT="-d rxe0 -x ${gidx:-1} -F"
FP="--per-dev 1 --size 256K --depth 4 --seconds 4 --grace 5 --tick-ms 1000"
FO="--per-dev 1 --size 256K --depth 4 --seconds 24 --grace 10 --tick-ms 1000"
# Under TCG a verbs lane's handshake takes longer than the 200 ms probe default (an
# 8-byte write takes ~25 ms), so probes and lane handshakes get TCG-sized timeouts.
export RAILOVER_PROBE_TIMEOUT_MS=2000 RAILOVER_COMPLETION_TIMEOUT_MS=3000
if [ "$role" = a ]; then
    /bin/railover doctor 2>&1 | sed -n '/^Verbs NICs/,$p' | sed 's/^/VT: doctor| /'
    RAILOVER_HCA='^=rxe1' /bin/railover verbs-check list 2>&1 | sed 's/^/VT: hca| /'
    timeout 120 ib_write_bw $PT -s 1048576 -D 4 --report_gbits > /tmp/bw 2>&1; echo "VT: bw rc=$?"
    timeout 120 ib_write_lat $PT -s 8 -D 4 > /tmp/lat 2>&1; echo "VT: lat rc=$?"
    timeout 300 /bin/railover verbs-check serve --timeout-s 120; echo "VT: check rc=$?"
    # The plugin's comms over verbs lanes: fault-peer receives and checks every byte.
    RAILOVER_TRANSPORT=verbs RAILOVER_LOG=info timeout 120 /bin/railover fault-peer recv $FP >/tmp/fp 2>/tmp/fp.err &
    fp=$!
    n=0
    until grep -q '"event":"listening"' /tmp/fp; do
        n=$((n + 1)); [ $n -ge 600 ] && break; kill -0 $fp 2>/dev/null || break; sleep 0.1
    done
    { grep '"event":"handle"' /tmp/fp | sed 's/"event":"handle"/"cmd":"handle"/'; echo '{"cmd":"go"}'; } >/tmp/handles
    timeout 60 nc -l -p 18700 -e cat /tmp/handles
    wait $fp; echo "VT: fp rc=$?"
    # Failover: the same three comms for longer; guest b takes rail 0 down mid-stream.
    RAILOVER_TRANSPORT=verbs RAILOVER_LOG=info timeout 150 /bin/railover fault-peer recv $FO >/tmp/fo 2>/tmp/fo.err &
    fo=$!
    n=0
    until grep -q '"event":"listening"' /tmp/fo; do
        n=$((n + 1)); [ $n -ge 600 ] && break; kill -0 $fo 2>/dev/null || break; sleep 0.1
    done
    { grep '"event":"handle"' /tmp/fo | sed 's/"event":"handle"/"cmd":"handle"/'; echo '{"cmd":"go"}'; } >/tmp/handles2
    timeout 60 nc -l -p 18701 -e cat /tmp/handles2
    wait $fo; echo "VT: fo rc=$?"
else
    retry timeout 120 ib_write_bw $PT -s 1048576 -D 4 --report_gbits 192.0.2.1 > /tmp/bw 2>&1; echo "VT: bw rc=$?"
    retry timeout 120 ib_write_lat $PT -s 8 -D 4 192.0.2.1 > /tmp/lat 2>&1; echo "VT: lat rc=$?"
    timeout 300 /bin/railover verbs-check connect --peer $peers --timeout-s 120; echo "VT: check rc=$?"
    retry sh -c 'nc 192.0.2.1 18700 </dev/null >/tmp/handles && grep -q go /tmp/handles'
    # stdin stays open past the sender's grace, so it closes its comms by itself.
    { cat /tmp/handles; sleep 12; } | RAILOVER_TRANSPORT=verbs RAILOVER_LOG=info \
        timeout 120 /bin/railover fault-peer send $FP >/tmp/fp 2>/tmp/fp.err
    echo "VT: fp rc=$?"
    retry sh -c 'nc 192.0.2.1 18701 </dev/null >/tmp/handles2 && grep -q go /tmp/handles2'
    { cat /tmp/handles2; sleep 45; } | RAILOVER_TRANSPORT=verbs RAILOVER_LOG=info \
        timeout 150 /bin/railover fault-peer send $FO >/tmp/fo 2>/tmp/fo.err &
    fo=$!
    n=0
    until grep -q '"event":"connected"' /tmp/fo; do
        n=$((n + 1)); [ $n -ge 600 ] && break; kill -0 $fo 2>/dev/null || break; sleep 0.1
    done
    # eth0 is rxe0's netdev: its carrier loss must reach the engine as rxe0's.
    sleep 3; ip link set eth0 down; echo "VT: eth0 down $(cut -d' ' -f1 /proc/uptime)s"
    sleep 4; ip link set eth0 up; echo "VT: eth0 up $(cut -d' ' -f1 /proc/uptime)s"
    wait $fo; echo "VT: fo rc=$?"
fi
grep -E '"event":"(summary|error|bad|setup-failed|connected)"' /tmp/fp | sed 's/^/VT: fp| /'
grep -v '^$' /tmp/fp.err | head -20 | sed 's/^/VT: fp.err| /'
grep -E '"event":"(summary|error|bad|setup-failed|connected)"' /tmp/fo | sed 's/^/VT: fo| /'
grep -E 'failover comm=|failback comm=|NIC rxe|gave up|WARN|ERROR' /tmp/fo.err | head -40 | sed 's/^/VT: fo.err| /'
sed 's/^/VT: bw| /' /tmp/bw; sed 's/^/VT: lat| /' /tmp/lat
echo "VT: done $(cut -d' ' -f1 /proc/uptime)s"
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
qemu() {
    timeout 420 qemu-system-x86_64 -accel "$accel" -m 768 -smp 1 -cpu max -kernel "$kernel" \
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
qemu -append "console=ttyS0 quiet panic=-1 vt_role=a" "${nics_a[@]}" >"$cache/guest-a.log" 2>&1 &
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
qemu -append "console=ttyS0 quiet panic=-1 vt_role=b" "${nics_b[@]}" >"$cache/guest-b.log" 2>&1 &
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
[ $ra -eq 124 ] || [ $rb -eq 124 ] && fail "a guest ran past its 420 s limit (logs: $a $b)"
grep -q 'VT: done' "$a" && grep -q 'VT: done' "$b" || fail "a guest did not finish its tests (logs: $a $b)"

# --- verdict ---------------------------------------------------------------------------
status=0
check() {
    local name=$1
    shift
    if "$@"; then
        echo "verbs tier: ok   $name"
    else
        echo "verbs tier: FAIL $name"
        status=1
    fi
}
# perftest's result rows: bytes, iterations, peak, average Gb/s, Mpps / bytes, iterations,
# average us, transactions/s.
bw=$(sed -n 's/^VT: bw| *\([0-9][0-9]* .*\)/\1/p' "$b" | awk '{print $4 " Gb/s average over " $2 " x " $1 " B writes"}' | tail -1)
lat=$(sed -n 's/^VT: lat| *\([0-9][0-9]* .*\)/\1/p' "$b" | awk '{print $3 " us average over " $2 " x " $1 " B writes"}' | tail -1)
check "ib_write_bw over rxe0 ran" grep -q 'VT: bw rc=0' "$b"
check "ib_write_lat over rxe0 ran" grep -q 'VT: lat rc=0' "$b"
for r in 0 1 2; do
    check "verbs-check rail rxe$r (client)" grep -q "verbs-check: rail rxe$r:1 PASS" "$b"
    check "verbs-check rail rxe$r (server)" grep -q "verbs-check: rail rxe$r:1 PASS" "$a"
done
check "doctor shows rxe2:1 ACTIVE Ethernet with a rail" grep -qE 'VT: doctor\| +rxe2:1 +ACTIVE +Ethernet .* rail [0-9]' "$a"
check "doctor marks the IPv4 RoCE v2 GID of rxe0" grep -q 'VT: doctor| .*\*gid\[[0-9]*\] RoCEv2 ::ffff:192.0.2.1' "$a"
check "RAILOVER_HCA=^=rxe1 leaves rxe0 and rxe2" sh -c "grep -q 'VT: hca| verbs-check: nic rxe0:1' '$a' && grep -q 'VT: hca| verbs-check: nic rxe2:1' '$a' && grep -q 'VT: hca| verbs-check: skipped rxe1:1: not selected by RAILOVER_HCA' '$a' && ! grep -q 'VT: hca| verbs-check: nic rxe1' '$a'"
check "fault-peer over verbs lanes: receiver saw every byte (exit 0)" grep -q 'VT: fp rc=0' "$a"
check "fault-peer over verbs lanes: sender finished (exit 0)" grep -q 'VT: fp rc=0' "$b"
check "the plugin ran on the verbs fabric" grep -q 'VT: fp.err| .*fabric verbs' "$a"
check "verbs-check exited 0 on guest a" grep -q 'VT: check rc=0' "$a"
check "verbs-check exited 0 on guest b" grep -q 'VT: check rc=0' "$b"
# Failover scenario: rail 0's netdev down on guest b (the sender) mid-stream, then up.
check "failover over verbs: receiver saw every byte once, in order (exit 0)" grep -q 'VT: fo rc=0' "$a"
check "failover over verbs: sender finished without a failed request (exit 0)" grep -q 'VT: fo rc=0' "$b"
check "failover over verbs: eth0 down reached the engine as rxe0's carrier" grep -q 'VT: fo.err| .*NIC rxe0 lost its link' "$b"
check "failover over verbs: a comm left rxe0, striped over both survivors" grep -qE 'VT: fo.err\| .*failover comm=[0-9]+ rxe0->[^ ]* => .* spread_over=[2-9]' "$b"
check "failover over verbs: eth0 up reached the engine as rxe0's carrier" grep -q 'VT: fo.err| .*NIC rxe0 is up again' "$b"
check "failover over verbs: traffic failed back onto rxe0" grep -qE 'VT: fo.err\| .*failback comm=[0-9]+ .* => rxe0->' "$b" "$a"
fpbytes=$(grep 'VT: fp| ' "$a" | sed -n 's/.*"role":"recv".*"bytes":\([0-9]*\).*/\1/p' | tail -1)
fobytes=$(grep 'VT: fo| ' "$a" | sed -n 's/.*"role":"recv".*"bytes":\([0-9]*\).*/\1/p' | tail -1)
fomove=$(grep -o 'failover comm=.*' "$b" | head -1)
foback=$(grep -ho 'failback comm=.*' "$b" "$a" | head -1)
echo "verbs tier: baseline ib_write_bw ${bw:-?}; ib_write_lat ${lat:-?}"
echo "verbs tier: plugin over verbs lanes (fault-peer, 3 comms on 3 rails, 256 KiB messages): ${fpbytes:-?} bytes verified in a 4 s send window (~$(( ${fpbytes:-0} * 8 / 4 / 1000000 )) Mb/s aggregate)"
echo "verbs tier: failover over verbs lanes (eth0 down 4 s on the sender): ${fobytes:-?} bytes verified in a 24 s window; ${fomove:-no failover line}; ${foback:-no failback line}"
echo "verbs tier: guests ran ${guest_s}s under $accel; whole tier $(($(date +%s) - t0))s"
if [ $status -eq 0 ]; then
    echo "verbs tier: passed"
fi
exit $status
