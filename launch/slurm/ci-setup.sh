#!/usr/bin/env bash
# Install what the Slurm test needs (Debian packages, as root): slurmctld, slurmd, the
# client commands and munge. The test itself starts and stops a one-node cluster with
# launch/slurm/local-cluster.sh; without these packages (or without root) it skips.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "ci-setup.sh: not root; cannot install Slurm (the Slurm test will skip)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurmd slurmctld slurm-client munge >/dev/null
