#!/usr/bin/env bash
# The cluster gate: run distdiag's check on this node's ranks, then the training command
# only if the check passed; otherwise exit with the check's own code.
#
#   launch/gate.sh [torchrun options] -- TRAINING COMMAND...
#
# This file is `distdiag gate` (distdiag/launcher/gate.py run_gate) for launchers that call a
# script; a pip install has the command without this file. Run it once per node (srun
# --ntasks-per-node=1, a PyTorchJob pod, ...). The torchrun options are the job's own
# (--nnodes, --nproc-per-node, --rdzv-backend c10d, --rdzv-endpoint, --rdzv-id); torchrun
# also reads them from PET_* variables, which is how Kubeflow passes them. The check runs on
# the same ranks, devices and network as the job.
#
# Exit codes: the training command's when the gate passed; else the check's verdict
# (1 a probe failed, 2 bad input, 3 a rank hung or died, 4 take this node out), read from
# the report each node's local rank 0 writes (torchrun itself turns every failure into 1).
# SIGTERM/SIGINT reach torchrun and its workers (nothing is orphaned).
#
# Environment:
#   DISTDIAG_PROFILE  profile of the check (default: gate)
#   DISTDIAG_CONFIG   a TOML config layered over the profile (expected busbw, GPUs per node)
#   DISTDIAG_REPORT   where this node's report goes (default: distdiag-gate-report.json)
#   DISTDIAG_JUNIT    where this node's JUnit XML goes (default: none)
#   DISTDIAG_CHECK_ARGS  more arguments for the check (e.g. "--timeout-s 60")
#   DISTDIAG_DEBUG=1  torchrun's whole stderr (otherwise its log lines are left out)
#   PYTHON            the interpreter with torch and distdiag (default: python3)
exec "${PYTHON:-python3}" -m distdiag gate "$@"
