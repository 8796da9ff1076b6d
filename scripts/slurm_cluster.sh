#!/usr/bin/env bash
# A real one-node Slurm on this machine, for the tests that submit the recipes in examples/
# with sbatch (tests/slurm/, `make test-slurm`). Run as root.
#
#   scripts/slurm_cluster.sh start DIR [GPUS]   # install if missing, then munged, slurmctld, slurmd
#   scripts/slurm_cluster.sh stop DIR           # stop the daemons `start DIR` started, by PID
#
# Everything lives in DIR (created): slurm.conf, gres.conf, the munge key and socket, the
# daemons' state, spool, logs and PID files; nothing under /etc is written. `start` prints
# the one line a shell needs to talk to it: `export SLURM_CONF=DIR/slurm.conf`.
#
# The node declares GPUS GPUs (default 8) as a GRES backed by device files: symlinks to
# /dev/null in DIR/dev (Slurm 22.05 drops a GPU without a File= and refuses a regular file,
# and AutoDetect=off keeps it from looking for NVML), so jobs see SLURM_GPUS_ON_NODE etc. as
# on a GPU node while the recipes run on the CPU (CPU=1). It declares 8 CPUs whatever the
# machine has (SlurmdParameters=config_overrides), so the recipes' own #SBATCH shape (8 tasks
# per node) is accepted on a 2-core machine.
set -euo pipefail

usage() {
    echo "usage: $0 start DIR [GPUS] | stop DIR" >&2
    exit 2
}

die() {
    echo "${0##*/}: error: $*" >&2
    exit 1
}

#: Daemons `start` launches, in order; `stop` ends them in reverse.
DAEMONS=(munged slurmctld slurmd)

install_slurm() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    ((EUID == 0)) || die "Slurm is not installed and only root can install it \
(apt-get install slurm-wlm munge)."
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get: \
install slurm-wlm (22.05 or later) and munge."
    echo "installing slurm-wlm and munge (apt-get, about 30 s)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds.
wait_for() {
    local seconds=$1 what=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$what did not come up within $seconds s (logs in $DIR)."
        sleep 0.2
    done
}

start() {
    local gpus=${1:-8} node i
    [[ $gpus =~ ^[1-9][0-9]*$ ]] || die "GPUS=$gpus must be a positive integer."
    ((EUID == 0)) || die "the test Slurm runs its daemons as root; run as root."
    install_slurm
    for i in "${!DAEMONS[@]}"; do
        [[ -f $DIR/${DAEMONS[i]}.pid ]] && kill -0 "$(<"$DIR/${DAEMONS[i]}.pid")" 2>/dev/null &&
            die "a ${DAEMONS[i]} started in $DIR is still running: $0 stop $DIR first."
    done
    mkdir -p "$DIR"/{state,spool,dev,munge}
    chmod 700 "$DIR/munge"
    DIR=$(cd "$DIR" && pwd)
    node=$(hostname -s)
    # A key of its own, so nothing of the machine's munge set-up is needed or touched.
    [[ -f $DIR/munge/munge.key ]] || head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    for ((i = 0; i < gpus; i++)); do ln -sfn /dev/null "$DIR/dev/gpu$i"; done
    cat >"$DIR/slurm.conf" <<EOF
# One node, root daemons, no accounting, no cgroups (containers rarely allow them).
ClusterName=domino-test
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=3600
NodeName=$node CPUs=8 Gres=gpu:$gpus State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$DIR/gres.conf" <<EOF
AutoDetect=off
NodeName=$node Name=gpu File=$DIR/dev/gpu[0-$((gpus - 1))]
EOF
    export SLURM_CONF=$DIR/slurm.conf
    munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" \
        --seed-file="$DIR/munge/munge.seed"
    wait_for 10 munged test -S "$DIR/munge/munge.socket"
    slurmctld -f "$SLURM_CONF"
    wait_for 20 slurmctld scontrol ping
    slurmd -f "$SLURM_CONF"
    wait_for 20 "the node" bash -c "sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)'"
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
    local i name pid
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        name=${DAEMONS[i]}
        [[ -f $DIR/$name.pid ]] || continue
        pid=$(<"$DIR/$name.pid")
        if kill "$pid" 2>/dev/null; then
            # Give it 10 s to exit, so the next start finds its ports free.
            for _ in {1..50}; do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        fi
        rm -f "$DIR/$name.pid"
    done
}

[[ $# -ge 2 ]] || usage
DIR=$2
case $1 in
start) start "${3:-}" ;;
stop) stop ;;
*) usage ;;
esac
