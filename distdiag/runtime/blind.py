"""Where torch's flight recorder cannot see a job's NCCL collectives, said in its hang report.

With `TORCH_NCCL_BLOCKING_WAIT=1` the training thread waits on each NCCL collective itself and
torch hands no work to its watchdog thread: the recorder's `pg_status` never moves (completions
are not recorded), so every rank looks inside its last collective, whatever it is really doing.
The hang analysis reads those positions first; under blocking wait its verdict is built on a
view that does not move. `blind_spot` says so from the environment of the process that writes
the report, and `mark_blind` lowers every finding's confidence and adds a note beside the lead,
instead of a confident verdict. (CUDA-graph replays are never recorded either, blocking wait or
not: docs/watchdog.md.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from distdiag.hang.records import Cause
from distdiag.report.model import Finding

__all__ = ["BLOCKING_WAIT_ENVS", "BLIND_CONFIDENCE", "blind_spot", "mark_blind", "uses_nccl"]

BLOCKING_WAIT_ENVS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
"""torch's knob and its legacy name (torch reads either)."""
BLIND_CONFIDENCE = 0.4
"""The most a finding may claim when the recorder view is blind."""
_TRUE = {"1", "y", "yes", "true", "on"}


def uses_nccl(snaps: Iterable[Any]) -> bool:
    """Whether any rank's snapshot shows a group on NCCL's recorder."""
    for snap in snaps:
        engine = snap.get("engine") if isinstance(snap, Mapping) else None
        groups = engine.get("groups") if isinstance(engine, Mapping) else None
        if any(isinstance(g, Mapping) and g.get("backend") == "nccl" for g in groups or ()):
            return True
    return False


def blind_spot(env: Mapping[str, str] | None = None, snaps: Iterable[Any] = ()) -> str | None:
    """Why the recorder view of this job cannot be trusted, or None: blocking wait set in `env`
    (this process's environment by default) on a job whose snapshots show NCCL groups."""
    env = os.environ if env is None else env
    for name in BLOCKING_WAIT_ENVS:
        value = env.get(name, "").strip().lower()
        if value in _TRUE and uses_nccl(snaps):
            return f"{name}={env[name]}"
    return None


def mark_blind(findings: list[Finding], why: str | None) -> list[Finding]:
    """The findings with their confidence capped at BLIND_CONFIDENCE and a note after the lead
    saying what the recorder does not see (`why` from blind_spot; None: unchanged)."""
    if why is None or any(f.cause == Cause.RECORDER_BLIND for f in findings):
        return findings
    for f in findings:
        f.confidence = min(f.confidence, BLIND_CONFIDENCE)
    note = Finding(
        severity="warning",
        issue=f"torch's flight recorder cannot see this job's NCCL collectives ({why}): the positions above may be stale",
        evidence=(
            "with blocking wait torch hands no NCCL work to its watchdog thread: the recorder never records a "
            "completion (pg_status does not move), so a rank can look inside a collective it left long ago; the "
            f"findings' confidence is capped at {BLIND_CONFIDENCE}. The ranks' stacks still say where each main "
            "thread is"
        ),
        fix=(
            "for a report built on the recorder, run without TORCH_NCCL_BLOCKING_WAIT (the process group's timeout "
            "and TORCH_NCCL_ASYNC_ERROR_HANDLING end a stuck collective instead); until then read the stacks"
        ),
        confidence=1.0,
        cause=Cause.RECORDER_BLIND,
    )
    lead = next((i for i, f in enumerate(findings) if f.severity == "critical"), -1)
    findings.insert(lead + 1, note)
    return findings
