#!/usr/bin/env bash
# The cluster gate: run distdiag's check on this node's ranks, then the training command
# only if the check passed; otherwise exit with the check's own code.
#
#   launch/gate.sh [torchrun options] -- TRAINING COMMAND...
#
# Run it once per node (srun --ntasks-per-node=1, a PyTorchJob pod, ...). The torchrun
# options are the job's own (--nnodes, --nproc-per-node, --rdzv-backend c10d,
# --rdzv-endpoint, --rdzv-id); torchrun also reads them from PET_* variables, which is how
# Kubeflow passes them. The check runs on the same ranks, devices and network as the job.
#
# Exit codes: the training command's when the gate passed; else the check's verdict
# (1 a probe failed, 2 bad input, 3 a rank hung or died, 4 take this node out), read from
# the report each node's local rank 0 writes (torchrun itself turns every failure into 1).
#
# Environment:
#   DISTDIAG_PROFILE  profile of the check (default: gate)
#   DISTDIAG_CONFIG   a TOML config layered over the profile (expected busbw, GPUs per node)
#   DISTDIAG_REPORT   where this node's report goes (default: distdiag-gate-report.json)
#   DISTDIAG_JUNIT    where this node's JUnit XML goes (default: none)
#   DISTDIAG_CHECK_ARGS  more arguments for the check (e.g. "--timeout-s 60")
#   PYTHON            the interpreter with torch and distdiag (default: python3)
set -uo pipefail

torchrun_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    torchrun_args+=("$1")
    shift
done
if [ "${1:-}" != "--" ] || [ $# -lt 2 ]; then
    echo "gate.sh: error: usage: gate.sh [torchrun options] -- TRAINING COMMAND..." >&2
    exit 2
fi
shift

python="${PYTHON:-python3}"
report="${DISTDIAG_REPORT:-distdiag-gate-report.json}"
check_args=(--profile "${DISTDIAG_PROFILE:-gate}" --report "$report" --quiet)
[ -n "${DISTDIAG_CONFIG:-}" ] && check_args+=(--config "$DISTDIAG_CONFIG")
[ -n "${DISTDIAG_JUNIT:-}" ] && check_args+=(--junit "$DISTDIAG_JUNIT")
# shellcheck disable=SC2206 # word splitting of the extra arguments is intended
[ -n "${DISTDIAG_CHECK_ARGS:-}" ] && check_args+=(${DISTDIAG_CHECK_ARGS})

# A report left by an earlier run must not pass for this one.
rm -f -- "$report"
"$python" -m torch.distributed.run "${torchrun_args[@]}" -m distdiag.check "${check_args[@]}"
torchrun_rc=$?

code=$("$python" -c 'import sys
from distdiag.errors import ReportError
from distdiag.report import read_report
try:
    print(read_report(sys.argv[1]).exit_code)
except ReportError as exc:
    print(exc, file=sys.stderr)
    print(3)' "$report")
if [ "$code" != "0" ]; then
    echo "gate.sh: the distdiag gate failed on $(hostname) (exit $code, torchrun exited $torchrun_rc); report: $report; not starting the job" >&2
    exit "$code"
fi
echo "gate.sh: the distdiag gate passed on $(hostname); starting: $*" >&2
exec "$@"
