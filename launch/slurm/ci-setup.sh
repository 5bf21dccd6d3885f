#!/usr/bin/env bash
# Install what the Slurm test needs (Debian packages, as root): slurmctld, slurmd, the
# client commands and munge. The test itself starts and stops a one-node cluster with
# launch/slurm/local-cluster.sh; without these packages (or without root) it skips.
#
# This changes the host (apt-get), so it runs only where that is meant: on the CI box
# (CI=true, as CI sets it) or when asked with DISTDIAG_CI_SLURM=1. Anywhere else it says so
# and changes nothing; .ci/run calls it on every machine.
set -euo pipefail
if [ "${CI:-}" != "true" ] && [ "${DISTDIAG_CI_SLURM:-}" != "1" ]; then
    echo "ci-setup.sh: not the CI box (neither CI=true nor DISTDIAG_CI_SLURM=1): not installing Slurm; the Slurm test will skip"
    exit 0
fi
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "ci-setup.sh: not root; cannot install Slurm (the Slurm test will skip)" >&2
    exit 0
fi
echo "ci-setup.sh: installing Debian packages slurmd slurmctld slurm-client munge on this host (apt-get update + install, as root)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurmd slurmctld slurm-client munge >/dev/null
