#!/usr/bin/env bash
# Start or stop a real, throw-away Slurm cluster on this machine (no systemd, no cgroups).
#
#   tests/launch/local_slurm.sh start DIR   # prints the SLURM_CONF line to export
#   tests/launch/local_slurm.sh stop DIR    # stops exactly the daemons `start` launched (by PID)
#
# The cluster: one slurmctld and two emulated compute nodes (n1, n2: Debian's Slurm is built with
# MULTIPLE_SLURMD, so several slurmd run on one host), each declaring this host's CPUs and memory, in
# one partition `debug`. Everything lives under DIR: its own slurm.conf (use it with
# `export SLURM_CONF=DIR/slurm.conf`; /etc/slurm is not touched), its own munged socket, free TCP
# ports, state, spool and logs, so two clusters (two engineers' test runs) can coexist.
# The node names must resolve for torch rendezvous on MASTER_ADDR=n1: `start` appends one line to
# /etc/hosts tagged with DIR, and `stop` removes exactly that line.
#
# Needs root and the Debian packages slurmctld slurmd slurm-client munge (install: see `need`).
# Facts behind the settings: docs/slurm.md and /work/shared/docs/local_slurm.md.
set -euo pipefail

die() { echo "local_slurm: error: $*" >&2; exit 1; }

need() {
    local cmd missing=()
    for cmd in munged slurmctld slurmd sbatch scontrol sinfo squeue scancel; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    ((${#missing[@]} == 0)) || die "missing ${missing[*]}; install with:" \
        "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
    [[ $(id -u) == 0 ]] || die "must run as root (slurmd launches jobs as their owner)"
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Three consecutive free ports (slurmctld, n1, n2) from a random base.
pick_ports() {
    local base tries
    for ((tries = 0; tries < 50; tries++)); do
        base=$((17000 + (RANDOM % 4000) * 2))
        if port_free "$base" && port_free $((base + 1)) && port_free $((base + 2)); then
            echo "$base"
            return 0
        fi
    done
    die "no free port triple found in 17000-25000"
}

hosts_tag() { echo "# local_slurm $1"; }

wait_for() {  # wait_for SECONDS COMMAND...: 0 once COMMAND succeeds, 1 after SECONDS
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [[ $(grep -c ' idle$' <<<"$states") == 2 ]]
}

start() {
    local dir=$1 host hw base ctld_port munge_dir
    need
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [[ ! -e $dir/slurm.conf ]] || die "$dir already holds a cluster; stop it first or use a new DIR"
    mkdir -p "$dir"/{state,run,log,spool/n1,spool/n2}
    host=$(hostname -s)
    # "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
    hw=$(slurmd -C | head -n1 | sed -e 's/^NodeName=[^ ]* //')
    base=$(pick_ports)
    ctld_port=$base

    # munged of our own: private socket, same key as the system one (/etc/munge/munge.key). Its files
    # live outside DIR: munged (running as user munge) must reach them, and DIR may sit in a private
    # directory such as pytest's tmp_path (mode 0700).
    munge_dir=$(mktemp -d /tmp/local_slurm_munge.XXXXXX)
    echo "$munge_dir" >"$dir/munge_dir"
    chown munge:munge "$munge_dir"
    chmod 0755 "$munge_dir"  # munged insists that clients can reach the socket
    runuser -u munge -- munged --socket="$munge_dir/munge.socket" --pid-file="$munge_dir/munged.pid" \
        --log-file="$munge_dir/munged.log" --seed-file="$munge_dir/munged.seed" \
        || die "munged did not start; see $munge_dir/munged.log"

    cat >"$dir/slurm.conf" <<EOF
# Written by tests/launch/local_slurm.sh for a throw-away local cluster.
ClusterName=localci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$munge_dir/munge.socket
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
DependencyParameters=kill_invalid_depend
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# Job ids (and so the launcher's MASTER_PORT, derived from them) differ between clusters on one host.
FirstJobId=$((1000 + RANDOM % 18000))
KillWait=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmdLogFile=$dir/log/slurmd-%n.log
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + 1)) $hw State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + 2)) $hw State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF=$dir/slurm.conf

    # Node names must resolve (torch rendezvous on MASTER_ADDR=n1); tagged so `stop` removes only ours.
    echo "127.0.0.1 n1 n2 $(hosts_tag "$dir")" >>/etc/hosts

    slurmctld -c || die "slurmctld did not start; see $dir/log/slurmctld.log"
    slurmd -N n1 || die "slurmd n1 did not start; see $dir/log/slurmd-n1.log"
    slurmd -N n2 || die "slurmd n2 did not start; see $dir/log/slurmd-n2.log"
    if ! wait_for 60 nodes_idle; then
        sinfo -N >&2 || true
        die "nodes did not become idle within 60 s; logs in $dir/log"
    fi
    echo "export SLURM_CONF=$dir/slurm.conf"
}

no_active_jobs() { [[ -z $(squeue -h -t RUNNING,COMPLETING,SUSPENDED 2>/dev/null) ]]; }

pid_alive() { kill -0 "$1" 2>/dev/null; }

stop_pidfile() {  # stop_pidfile FILE: TERM, wait up to 10 s, then KILL; by PID only
    local file=$1 pid
    [[ -s $file ]] || return 0
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] || return 0
    pid_alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    wait_for 10 bash -c "! kill -0 $pid 2>/dev/null" || kill -KILL "$pid" 2>/dev/null || true
}

stop() {
    local dir=$1 tag node munge_dir
    [[ -d $dir ]] || die "no such cluster directory: $dir"
    dir=$(cd "$dir" && pwd)
    tag=$(hosts_tag "$dir")
    if [[ -f $dir/slurm.conf ]]; then
        export SLURM_CONF=$dir/slurm.conf
        # Jobs first: their slurmstepd processes outlive slurmd otherwise.
        if scancel --full --quiet --partition=debug 2>/dev/null; then
            wait_for 30 no_active_jobs || true
        fi
    fi
    for node in n1 n2; do
        stop_pidfile "$dir/run/slurmd-$node.pid"
    done
    stop_pidfile "$dir/run/slurmctld.pid"
    if [[ -s $dir/munge_dir ]]; then
        munge_dir=$(<"$dir/munge_dir")
        stop_pidfile "$munge_dir/munged.pid"
        [[ $munge_dir == /tmp/local_slurm_munge.* ]] && rm -rf "$munge_dir"
    fi
    if grep -qF "$tag" /etc/hosts; then
        # In place (not a rename): /etc/hosts may be a bind mount in containers.
        local kept
        kept=$(grep -vF "$tag" /etc/hosts)
        printf '%s\n' "$kept" >/etc/hosts
    fi
    echo "local_slurm: stopped cluster in $dir"
}

case ${1:-} in
    start) [[ $# == 2 ]] || die "usage: $0 start DIR"; start "$2" ;;
    stop) [[ $# == 2 ]] || die "usage: $0 stop DIR"; stop "$2" ;;
    *) die "usage: $0 start|stop DIR" ;;
esac
