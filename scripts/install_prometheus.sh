#!/bin/sh
# Install the Prometheus server the metrics tests scrape with, when it is missing (Debian/Ubuntu).
# Idempotent: does nothing when `prometheus` is on PATH. Needs root (or sudo) for apt-get.
set -e
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prometheus.sh: no apt-get here; install Prometheus (>= 2.30) so that 'prometheus' is on PATH" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "install_prometheus.sh: not root and no sudo; run 'apt-get install -y prometheus' as root" >&2
        exit 1
    fi
fi
echo "installing Prometheus (apt-get install prometheus) for the metrics tests" >&2
$SUDO apt-get update -qq
# The package's service is not needed: the tests start their own server on loopback.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus >/dev/null 2>&1
