#!/usr/bin/env bash
# Installs what the fault tests (tests/test_faults.py) need to build network namespaces: iproute2 (`ip netns`,
# `ip link`, veth) and util-linux (`unshare`). Does nothing when they are there; needs root to install.
set -euo pipefail

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "tests/netns/ensure_tools.sh: ${missing[*]} missing and not root: the fault tests will say so" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
