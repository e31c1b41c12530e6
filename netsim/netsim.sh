#!/usr/bin/env bash
# netsim: W emulated hosts on one machine (issue 26). Each host is a network namespace
# `gwns-hI` with one link `eth0` (10.77.0.(10+I)/24) to a bridge in its own namespace
# `gwns-sw`; nothing is added to the root namespace but the namespaces' names. Every link is
# shaped both ways with tc tbf (and netem for delay): the host's egress on `eth0`, its ingress
# on the bridge port `pI` in `gwns-sw`. MPI runs one rank per host over TCP only: mpirun in
# gwns-h0, one orted per other host started through `agent.sh` (plm_rsh_agent). Every host
# process runs in its own UTS and mount namespace (`enter.sh`): its own hostname and its own
# /tmp and /dev/shm, so that Open MPI's and PMIx's session directories never meet.
#
# Usage (as root):
#   netsim.sh up W RATE [DELAY_MS]   hosts up and shaped (RATE: tc rate such as 100mbit, or
#                                    `none` for unshaped links); removes a previous run first
#   netsim.sh check                  timed TCP transfer h0 -> h1 and h1 -> h0 against the rate
#   netsim.sh qdiscs                 checks that every link carries its tbf, both ways
#   netsim.sh mpirun ARGS...         mpirun with one rank per host (ARGS: program and its args)
#   netsim.sh counters               "host tx_bytes rx_bytes" of every host's link, from the
#                                    bridge side (pI's counters, as the host sees them)
#   netsim.sh down                   kills what runs in the namespaces, deletes them (by name)
#
# Environment: NETSIM_BURST (tbf burst, default the larger of 16 KB and 1 ms at the link's rate:
# 125 KB at 1 Gbit/s, where a 16 KB bucket refilled 7,600 times a second held the measured
# goodput to 0.58 x the rate), NETSIM_LATENCY (tbf queue, default
# 100ms), NETSIM_MPI_TIMEOUT (seconds, default 900), NETSIM_STATE (default /run/gwns).
# `up` on a machine where namespaces cannot be created fails with a message.
set -euo pipefail

NETSIM_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX=gwns-
SW=${PREFIX}sw
SUBNET=10.77.0.0/24
STATE=${NETSIM_STATE:-/run/gwns}
BURST=${NETSIM_BURST:-}
LATENCY=${NETSIM_LATENCY:-100ms}
export NETSIM_DIR NETSIM_STATE="$STATE"

die() {
    echo "netsim: $*" >&2
    exit 1
}

host_ns() { echo "${PREFIX}h$1"; }
# The tbf burst for RATE (tc syntax: 100mbit, 1gbit, ...): NETSIM_BURST, or the larger of 16 KB
# and what the rate carries in 1 ms.
burst_for() {
    [ -n "$BURST" ] && { echo "$BURST"; return; }
    local rate=$1 n unit bits
    n=${rate%%[a-z]*}
    unit=${rate#"$n"}
    case $unit in
        gbit) bits=$((n * 1000000000)) ;;
        mbit) bits=$((n * 1000000)) ;;
        kbit) bits=$((n * 1000)) ;;
        *) echo 16kb; return ;;
    esac
    local bytes=$((bits / 8000))
    [ "$bytes" -gt 16384 ] && echo "${bytes}b" || echo 16kb
}
host_ip() { echo "10.77.0.$((10 + $1))"; }

# Every namespace of a previous run, by name prefix, with whatever still runs inside.
cleanup() {
    local ns pids
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}" || true); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$STATE"
    local left
    left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}" || true)
    [ -z "$left" ] || die "could not delete namespaces: $left"
}

# tc on one device in one namespace: netem delay (when DELAY_MS > 0) above tbf.
shape() {
    local ns=$1 dev=$2 rate=$3 delay=$4
    [ "$rate" = none ] && [ "$delay" = 0 ] && return 0
    local parent=root
    if [ "$delay" != 0 ]; then
        tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "${delay}ms" limit 100000
        parent="parent 1:"
    fi
    if [ "$rate" != none ]; then
        # shellcheck disable=SC2086
        tc -n "$ns" qdisc add dev "$dev" $parent handle 10: tbf rate "$rate" burst "$(burst_for "$rate")" \
            latency "$LATENCY"
    fi
}

up() {
    local w=${1:?W} rate=${2:?RATE} delay=${3:-0}
    [ "$w" -ge 2 ] && [ "$w" -le 64 ] || die "W must be in 2..64, got $w"
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
    command -v ip >/dev/null || die "ip (iproute2) not found"
    command -v tc >/dev/null || die "tc (iproute2) not found"
    cleanup
    # A failure half-way removes what was made.
    trap cleanup EXIT
    mkdir -p "$STATE"
    ip netns add "$SW" 2>"$STATE/err" || die "cannot create network namespaces: $(cat "$STATE/err")"
    ip -n "$SW" link add br0 type bridge
    ip -n "$SW" link set br0 up
    ip -n "$SW" link set lo up
    : >"$STATE/hosts"
    : >"$STATE/hostfile"
    local i ns
    for ((i = 0; i < w; i++)); do
        ns=$(host_ns "$i")
        ip netns add "$ns"
        ip -n "$SW" link add "p$i" type veth peer name eth0 netns "$ns"
        ip -n "$SW" link set "p$i" master br0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$(host_ip "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        shape "$ns" eth0 "$rate" "$delay"  # host -> bridge
        shape "$SW" "p$i" "$rate" "$delay" # bridge -> host
        echo "$(host_ip "$i") $i" >>"$STATE/hosts"
        echo "$(host_ip "$i") slots=1" >>"$STATE/hostfile"
        mkdir -p "$STATE/h$i/tmp" "$STATE/h$i/shm"
    done
    echo "$w $rate $delay" >"$STATE/config"
    trap - EXIT
    echo "netsim: $w hosts up, links $rate, delay ${delay} ms, burst $(burst_for "$rate")"
}

config() {
    [ -f "$STATE/config" ] || die "no hosts are up (netsim.sh up W RATE)"
    read -r W RATE DELAY <"$STATE/config"
}

# Every host link carries its tbf, both ways.
qdiscs() {
    config
    [ "$RATE" = none ] && { echo "netsim: links unshaped"; return 0; }
    local i out
    for ((i = 0; i < W; i++)); do
        for side in "$(host_ns "$i") eth0" "$SW p$i"; do
            # shellcheck disable=SC2086
            set -- $side
            out=$(tc -n "$1" qdisc show dev "$2")
            grep -q "tbf.*rate" <<<"$out" || die "FAIL: no tbf on $2 in $1: $out"
        done
    done
    echo "netsim: tbf on all $((2 * W)) link directions"
}

# A timed transfer of about 2 s at the configured rate, both ways between h0 and h1: the
# goodput must land within [0.85, 1.02] x the tbf rate (TCP/IP and Ethernet headers take about
# 4.5 % of it).
check() {
    config
    [ "$RATE" = none ] && { echo "netsim: links unshaped, no rate to check"; return 0; }
    local bits
    bits=$(python3 "$NETSIM_DIR/shapecheck.py" bits "$RATE")
    local pairs=("0 1" "1 0") pair
    for pair in "${pairs[@]}"; do
        # shellcheck disable=SC2086
        set -- $pair
        transfer "$1" "$2" "$bits"
    done
}

transfer() {
    local from=$1 to=$2 bits=$3 port=$((5201 + $1))
    local ready="$STATE/ready-$to" result="$STATE/transfer-$from-$to"
    rm -f "$ready" "$result"
    ip netns exec "$(host_ns "$to")" timeout 30 python3 "$NETSIM_DIR/shapecheck.py" recv \
        "$(host_ip "$to")" "$port" "$ready" "$bits" >"$result" &
    local recv=$!
    local n=0
    until [ -f "$ready" ]; do
        n=$((n + 1))
        [ $n -le 100 ] || { kill "$recv" 2>/dev/null; die "receiver on host $to did not listen within 10 s"; }
        sleep 0.1
    done
    ip netns exec "$(host_ns "$from")" timeout 30 python3 "$NETSIM_DIR/shapecheck.py" send \
        "$(host_ip "$to")" "$port" "$bits" || { kill "$recv" 2>/dev/null; die "transfer $from -> $to failed"; }
    wait "$recv" || die "receiver on host $to failed"
    echo "netsim: host $from -> host $to: $(cat "$result")"
    grep -q "^ok" "$result" || die "shaping check failed"
}

counters() {
    config
    local i
    for ((i = 0; i < W; i++)); do
        # pI's rx is what host I sent, its tx what host I received.
        echo "$i $(ip netns exec "$SW" cat "/sys/class/net/p$i/statistics/rx_bytes") \
$(ip netns exec "$SW" cat "/sys/class/net/p$i/statistics/tx_bytes")"
    done
}

run_mpi() {
    config
    [ $# -ge 1 ] || die "mpirun: no program"
    command -v mpirun >/dev/null || die "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    local mca=(
        --mca plm_rsh_agent "$NETSIM_DIR/agent.sh"
        --mca plm_rsh_no_tree_spawn 1
        --mca pml ob1 --mca btl tcp,self
        --mca btl_tcp_if_include "$SUBNET" --mca oob_tcp_if_include "$SUBNET"
        --mca mpi_yield_when_idle 1
    )
    ip netns exec "$(host_ns 0)" unshare --uts --mount --propagation private -- \
        "$NETSIM_DIR/enter.sh" 0 \
        timeout --kill-after=10 "${NETSIM_MPI_TIMEOUT:-900}" \
        mpirun --allow-run-as-root --hostfile "$STATE/hostfile" -np "$W" --map-by node \
        --bind-to none "${mca[@]}" -x RAYON_NUM_THREADS=1 -x GRADWIRE_DEMO_NETDEV=eth0 "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
up) up "$@" ;;
down) cleanup && echo "netsim: down" ;;
check) check ;;
qdiscs) qdiscs ;;
counters) counters ;;
mpirun) run_mpi "$@" ;;
*) die "usage: netsim.sh up W RATE [DELAY_MS] | check | qdiscs | counters | mpirun PROG ARGS... | down" ;;
esac
