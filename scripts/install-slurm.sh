#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, srun, sbatch) and MUNGE from Debian for the Slurm
# tests (tests/test_slurm.py), which start them on this machine with scripts/slurm-start.sh.
#
# Debian/Ubuntu: apt-get install slurm-wlm munge (as root, or through sudo when available).
# Does nothing when slurmctld, slurmd and munged are already on PATH (or in /usr/sbin).
# Never fails the build: without them the Slurm tests skip and say why. Starts nothing:
# Debian's packages ship systemd units, which these tests never use.
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
    echo "install-slurm: found $(command -v slurmctld) ($(slurmctld -V 2>/dev/null || echo '?')) and $(command -v munged)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm: no apt-get here; install Slurm (slurmctld, slurmd) and MUNGE yourself (the Slurm tests skip)"
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "install-slurm: apt-get needs root; the Slurm tests will be skipped"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d: no service starts from the packages' scripts (there may be no init system)
"${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq --no-install-recommends slurm-wlm munge \
    || echo "install-slurm: apt-get install slurm-wlm munge failed; the Slurm tests will be skipped"
exit 0
