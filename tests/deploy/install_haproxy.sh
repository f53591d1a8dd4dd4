#!/usr/bin/env bash
# What tests/deploy/test_haproxy_conf.py and test_router_live.py need: Debian's HAProxy (2.6 on bookworm, the
# version deploy/compose.replicas.yml runs). Run as root; idempotent.
#   bash tests/deploy/install_haproxy.sh
set -euo pipefail
if ! command -v haproxy >/dev/null; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends haproxy
fi
haproxy -v | head -1
