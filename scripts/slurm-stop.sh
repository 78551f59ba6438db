#!/usr/bin/env bash
# Stops what scripts/slurm-start.sh started in STATE_DIR (default /tmp/dmdask-slurm):
# cancels every job, stops slurmd, slurmctld and munged by their pids, removes the
# jobs' temp dirs. Never fails: what is not running is skipped.
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
STATE="$(realpath -m "${1:-/tmp/dmdask-slurm}")"
export SLURM_CONF="$STATE/slurm.conf"

if [ -f "$SLURM_CONF" ]; then
    scancel --user="$(id -un)" >/dev/null 2>&1 || true
    for _ in $(seq 1 15); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
        sleep 1
    done
fi
stop() {  # stop PIDFILE: TERM, then KILL after 10 s
    [ -f "$1" ] || return 0
    local pid; pid="$(cat "$1")"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null
        for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}
stop "$STATE/slurmd.pid"
stop "$STATE/slurmctld.pid"
stop "$STATE/munge/munged.pid"
rm -rf "$STATE/tmp"/* "$STATE/ctld"/* "$STATE/spool"/* 2>/dev/null || true
echo "slurm-stop: stopped the Slurm of $STATE"
