#!/usr/bin/env bash
# Open MPI's plm_rsh_agent for netsim: called by mpirun (in gwns-h0) as `agent.sh [OPTIONS]
# HOST COMMAND...`, where HOST is a host's address from the hostfile and COMMAND the orted
# command line for a shell (as ssh would run it). Starts COMMAND in that host's namespace, as
# that host (enter.sh).
set -euo pipefail
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    shift
done
addr=${1:?host}
shift
host=$(awk -v a="$addr" '$1 == a { print $2 }' "${NETSIM_STATE:?}/hosts")
[ -n "$host" ] || {
    echo "netsim agent: unknown host $addr" >&2
    exit 1
}
exec ip netns exec "gwns-h$host" unshare --uts --mount --propagation private -- \
    "${NETSIM_DIR:?}/enter.sh" "$host" sh -c "$*"
