#!/usr/bin/env bash
# Installs headless Chromium for the dashboard's browser test (tests/test_dashboard.py).
#
# Debian/Ubuntu: apt-get install chromium (as root, or through sudo when available).
# Does nothing when a Chromium or Chrome binary is already on PATH, or when
# $DMDASK_CHROMIUM names an executable. Exits non-zero when it cannot install one.
set -euo pipefail

for candidate in "${DMDASK_CHROMIUM:-}" chromium chromium-browser google-chrome google-chrome-stable; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1; then
        echo "install-browser: found $(command -v "$candidate") ($("$candidate" --version 2>/dev/null || echo '?'))"
        exit 0
    fi
done

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: no apt-get here; install Chromium yourself and put it on PATH" \
         "(or set DMDASK_CHROMIUM=/path/to/chrome)" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "install-browser: apt-get needs root (run this script as root or install sudo)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update
# Debian names the package "chromium"; older Ubuntu releases "chromium-browser"
# (a snap wrapper there: prefer Debian-based CI images).
if apt-cache show chromium >/dev/null 2>&1; then
    "${SUDO[@]}" apt-get install -y --no-install-recommends chromium fonts-dejavu-core
else
    "${SUDO[@]}" apt-get install -y --no-install-recommends chromium-browser fonts-dejavu-core
fi

for candidate in chromium chromium-browser; do
    if command -v "$candidate" >/dev/null 2>&1; then
        echo "install-browser: installed $(command -v "$candidate") ($("$candidate" --version 2>/dev/null || echo '?'))"
        exit 0
    fi
done
echo "install-browser: apt-get finished but no chromium binary is on PATH" >&2
exit 1
