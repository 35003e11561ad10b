#!/usr/bin/env bash
# Installs Prometheus's `promtool` and `prometheus` server (Debian package `prometheus`)
# when they are missing, so the observability tests can check the alert rules, the
# exposition text and a real scrape. Needs root to install; without root it only reports.
# Exit status: 0 when both tools are on PATH afterwards, 1 otherwise.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "railover: promtool/prometheus missing and not root: apt-get install prometheus" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# Wait for other apt users (parallel tests, prereqs) rather than failing on the lock.
apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null
# No recommends: the server binary and promtool are all the tests need, and the package's
# service is not started in containers without systemd.
apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1
