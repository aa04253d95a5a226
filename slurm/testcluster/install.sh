#!/usr/bin/env bash
# Install what the multi-node test cluster needs (Debian/Ubuntu).
#
# Idempotent: does nothing (and never touches the network) when every
# package is already present, so tests and CI can call it unconditionally.
set -euo pipefail

# libpmix-dev is needed even though nothing is compiled: Slurm's mpi/pmix
# plugin dlopen()s the unversioned libpmix.so, which only the -dev package
# ships. It also pulls in the runtime library (libpmix2, renamed libpmix2t64
# on newer Ubuntu), so that one is not listed by name.
PACKAGES=(
    slurmctld
    slurmd
    slurm-client
    slurmdbd       # accounting: sacct answers from it
    mariadb-server # slurmdbd's database (a private instance, started by start.sh)
    munge
    libpmix-dev
    openmpi-bin
    libopenmpi-dev
    iproute2       # ip netns, veth, bridge: one network namespace per node
    util-linux     # unshare, nsenter: each node's hostname and mounts
)

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    if [[ "$status" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "testcluster: all packages already installed"
    exit 0
fi

# CI runners are usually not root but have password-less sudo.
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null; then
        echo "testcluster: need root (or sudo) to install: ${missing[*]}" >&2
        exit 1
    fi
    SUDO=(sudo)
fi

echo "testcluster: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}"
