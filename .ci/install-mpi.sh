#!/usr/bin/env bash
# Installs what the `mpi` feature of gradwire needs: Open MPI (headers, libraries, mpirun) and
# libclang (bindgen in mpi-sys). Idempotent and quiet; skips apt when all are installed.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
packages=(libopenmpi-dev openmpi-bin libclang-dev)
installed=$(dpkg-query -W -f='${db:Status-Status}\n' "${packages[@]}" 2>/dev/null | grep -c '^installed$' || true)
if [ "$installed" -ne "${#packages[@]}" ]; then
    apt-get update -qq
    apt-get install -y -qq "${packages[@]}" >/dev/null
fi
command -v mpirun >/dev/null
