#!/usr/bin/env bash
# enter.sh I CMD...: run CMD as host I of netsim. Called inside `ip netns exec gwns-hI unshare
# --uts --mount`, so the hostname and the mounts below are this process tree's own: hostname
# gwns-hI, and /tmp and /dev/shm bound to the host's own directories, where Open MPI and PMIx
# put their session directories and sockets (short paths, nothing shared between hosts).
set -euo pipefail
host=${1:?host}
shift
state=${NETSIM_STATE:?}
hostname "gwns-h$host"
# A checkout under /tmp (a CI clone in a mktemp directory) would vanish under the host's own
# /tmp: bind it aside first, then back at its own path inside the new /tmp.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
aside=
case "$repo/" in
    /tmp/*)
        aside="$state/h$host/repo"
        mkdir -p "$aside"
        mount --bind "$repo" "$aside"
        ;;
esac
mount --bind "$state/h$host/tmp" /tmp
mount --bind "$state/h$host/shm" /dev/shm
if [ -n "$aside" ]; then
    mkdir -p "$repo"
    mount --bind "$aside" "$repo"
fi
export TMPDIR=/tmp OMPI_MCA_orte_tmpdir_base=/tmp PMIX_SYSTEM_TMPDIR=/tmp PMIX_SERVER_TMPDIR=/tmp
exec "$@"
