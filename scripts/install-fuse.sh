#!/usr/bin/env bash
# Installs libfuse and fusermount for the `dmdask mount` test (tests/test_fuse.py).
#
# Debian/Ubuntu: apt-get install fuse3 (as root, or through sudo when available). Does
# nothing when fusermount3 (or fusermount) is already on PATH. Never fails the build:
# without FUSE the test skips and says why.
set -uo pipefail

if command -v fusermount3 >/dev/null 2>&1 || command -v fusermount >/dev/null 2>&1; then
    echo "install-fuse: found $(command -v fusermount3 || command -v fusermount)"
    exit 0
fi
if [ ! -e /dev/fuse ]; then
    echo "install-fuse: this machine has no /dev/fuse; the FUSE test will be skipped"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-fuse: no apt-get here; install libfuse 3 and fusermount3 yourself (the FUSE test skips)"
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "install-fuse: apt-get needs root; the FUSE test will be skipped"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq --no-install-recommends fuse3 \
    || echo "install-fuse: apt-get install fuse3 failed; the FUSE test will be skipped"
exit 0
