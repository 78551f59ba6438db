#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine, for tests and trying the recipes of
# docs/hpc.md: munged, `slurmctld -D` and `slurmd -D` in the background (no systemd),
# everything under one state folder, listening on loopback only.
#
#   bash scripts/slurm-start.sh [STATE_DIR]   # default /tmp/dmdask-slurm
#   export SLURM_CONF=STATE_DIR/slurm.conf    # what sinfo, srun and sbatch then need
#   bash scripts/slurm-stop.sh [STATE_DIR]
#
# The node is named after `hostname`, with all of this machine's CPUs (2 at least) and memory. Every
# job gets a node-local temp dir, $SLURM_TMPDIR (STATE_DIR/tmp/JOBID, made by a task
# prolog, removed by the epilog), as HPC sites provide. No cgroups: ProctrackType
# linuxproc, TaskPlugin none (memory is not enforced; jobs see their grant in
# SLURM_MEM_PER_NODE). Ports: $DMDASK_SLURM_PORT (default 16817) and the next one.
# Exits 0 once `sinfo` shows the node idle; non-zero, with the daemons' logs, otherwise.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
STATE="$(realpath -m "${1:-/tmp/dmdask-slurm}")"
PORT="${DMDASK_SLURM_PORT:-16817}"
NODE="$(hostname -s)"
USER_NAME="$(id -un)"
CPUS="$(nproc)"
[ "$CPUS" -ge 2 ] || CPUS=2  # the recipes run two ranks on the node; config_overrides lets a 1-CPU machine claim 2
MEM_MB="$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)"

for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || { echo "slurm-start: $tool not found; run scripts/install-slurm.sh" >&2; exit 2; }
done
if [ -f "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
    echo "slurm-start: already running in $STATE (stop it with scripts/slurm-stop.sh $STATE)"
    exit 0
fi
mkdir -p "$STATE"/{ctld,spool,tmp,munge}
chmod 711 "$STATE/munge"  # the socket inside must be reachable by job processes
chmod 1777 "$STATE/tmp"

# MUNGE: a key of our own and a socket of our own, so a system munged is left alone
[ -s "$STATE/munge/munge.key" ] || mungekey --create --keyfile="$STATE/munge/munge.key" 2>/dev/null \
    || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$STATE/munge/munge.key"
munged --force --socket="$STATE/munge/munge.socket" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"

cat > "$STATE/task-prolog.sh" <<PROLOG
#!/bin/sh
# each task of a job: its node-local temp dir, as \$SLURM_TMPDIR
dir="$STATE/tmp/\$SLURM_JOB_ID"
mkdir -p "\$dir"
echo "export SLURM_TMPDIR=\$dir"
PROLOG
cat > "$STATE/epilog.sh" <<EPILOG
#!/bin/sh
# the job's temp dir goes with the job
rm -rf "$STATE/tmp/\$SLURM_JOB_ID"
EPILOG
chmod 755 "$STATE/task-prolog.sh" "$STATE/epilog.sh"

cat > "$STATE/slurm.conf" <<CONF
ClusterName=dmdask-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$USER_NAME
SlurmdUser=$USER_NAME
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
TaskProlog=$STATE/task-prolog.sh
Epilog=$STATE/epilog.sh
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$STATE/slurm.conf"

nohup slurmctld -D -f "$SLURM_CONF" > "$STATE/slurmctld.out" 2>&1 &
echo $! > "$STATE/slurmctld.pid"
nohup slurmd -D -f "$SLURM_CONF" -N "$NODE" > "$STATE/slurmd.out" 2>&1 &
echo $! > "$STATE/slurmd.pid"

for _ in $(seq 1 60); do
    if sinfo -h -N -n "$NODE" -o '%t' 2>/dev/null | grep -qx 'idle'; then
        echo "slurm-start: node $NODE idle ($CPUS CPUs, $MEM_MB MiB); export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 1
done
echo "slurm-start: node $NODE did not become idle in 60 s; sinfo says: $(sinfo -h -N -o '%N %t %E' 2>&1)" >&2
tail -n 20 "$STATE/slurmctld.out" "$STATE/slurmctld.log" "$STATE/slurmd.out" "$STATE/slurmd.log" "$STATE/munge/munged.log" >&2 2>/dev/null || true
exit 1
