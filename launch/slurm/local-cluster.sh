#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd on localhost), for testing
# launch/slurm/gate.sbatch for real. Needs root and Debian's slurmd, slurmctld,
# slurm-client and munge packages (launch/slurm/ci-setup.sh installs them).
#
#   local-cluster.sh start DIR   write DIR/slurm.conf, start munged (if needed), slurmctld,
#                                slurmd; wait until the node is idle; print SLURM_CONF=...
#   local-cluster.sh stop DIR    stop the daemons started for DIR, by their pid files
#
# Use the cluster with SLURM_CONF=DIR/slurm.conf in the environment of sbatch/sinfo/srun.
set -euo pipefail

action="${1:-}"
dir="${2:-}"
if [ -z "$action" ] || [ -z "$dir" ]; then
    echo "local-cluster.sh: error: usage: local-cluster.sh start|stop DIR" >&2
    exit 2
fi

stop() {
    for name in slurmd slurmctld; do
        if [ -f "$dir/$name.pid" ]; then
            kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
        fi
    done
    for name in slurmd slurmctld; do
        for _ in $(seq 50); do
            [ -f "$dir/$name.pid" ] && kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null || break
            sleep 0.1
        done
        rm -f "$dir/$name.pid"
    done
}

if [ "$action" = "stop" ]; then
    stop
    exit 0
fi
[ "$action" = "start" ] || { echo "local-cluster.sh: error: unknown action $action (start|stop)" >&2; exit 2; }
[ "$(id -u)" = "0" ] || { echo "local-cluster.sh: error: needs root (slurmd runs jobs as their users)" >&2; exit 2; }
for bin in slurmctld slurmd munged sinfo; do
    command -v "$bin" >/dev/null || { echo "local-cluster.sh: error: $bin not found; run launch/slurm/ci-setup.sh" >&2; exit 2; }
done

mkdir -p "$dir/spool/ctld" "$dir/spool/d" "$dir/log"
host=$(hostname)
cpus=$(nproc)
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
# A free port pair for this cluster, so a leftover or a second cluster does not collide.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
dport=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')

cat > "$dir/slurm.conf" <<EOF
ClusterName=distdiag-local
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$dport
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

# munge: a key owned by munge, mode 400, and munged running as the munge user (docs/facts.md).
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! pgrep -u munge -x munged >/dev/null; then
    runuser -u munge -- munged
fi

export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
    if sinfo -h -o '%T' 2>/dev/null | grep -q '^idle'; then
        echo "SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
echo "local-cluster.sh: error: the node did not become idle within 20 s; see $dir/log" >&2
stop
exit 1
