"""The last word is ours: torchrun's error file carries distdiag's verdict.

When a worker fails, torchrun prints a failure summary whose "Root Cause (first observed
failure)" block is the failure with the earliest timestamp, read from each failed worker's
error file (`TORCHELASTIC_ERROR_FILE`, the JSON torch's
`torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception` writes);
a worker without one counts as failing when torchrun looked, and shows no message. Without
this, distdiag's verdict ("rank 1 never entered all_reduce #7") was followed by a block that
named rank 0, the rank that waited, with nothing to say.

So every rank that leaves on a failing verdict (the check's or the watchdog's) writes the
verdict's sentence there, dated when it learnt the verdict: the ranks the verdict blames
BLAME_LEAD_S earlier (the failure began with them; torchrun compares whole seconds and the
ranks learn the verdict up to a second apart), the ranks it ended BLAME_LEAD_S later (so that a
blamed rank that died without a file, which torchrun dates when it collects the failures,
still comes first): the block then names the
culprit rank with distdiag's sentence, under `torchrun -m distdiag.check`, `torchrun -m
distdiag.watch` and a script with the in-code HangWatchdog alike. Nothing is written without
the variable (not under torchrun), for a passing verdict, or for one excused.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distdiag.hang.records import Verdict
    from distdiag.report.model import Report

__all__ = ["ERROR_FILE_ENV", "BLAME_LEAD_S", "MAX_BLAMED", "blamed_ranks", "remember", "remembered", "write_early", "write_error_file"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
MAX_BLAMED = 64
"""Ranks a verdict carries as blamed at most (it is published to every rank: kept small)."""

BLAME_LEAD_S = 2
"""How much earlier the blamed ranks date their failure than the moment they learnt the verdict:
torchrun compares whole seconds, and the ranks learn the verdict up to a second apart."""

_STATE: dict[str, Any] = {"verdict": None, "at": 0.0, "written": False, "early": True}


def blamed_ranks(report: Report | None) -> list[int]:
    """The ranks the report blames: those of its most severe finding (critical, else error)
    that names ranks; [] when none does (a finding of the whole job, or a pass)."""
    for severity in ("critical", "error"):
        for probe in getattr(report, "probes", []):
            for finding in probe.findings:
                if finding.severity == severity and finding.ranks:
                    return sorted({int(r) for r in finding.ranks})[:MAX_BLAMED]
    return []


def remember(verdict: Verdict) -> None:
    """The verdict this rank published or received (distdiag.hang.records.Verdict): the one
    `write_error_file` writes when the process leaves, dated when it came. A rank the verdict
    blames writes it at once (where the verdict ends the run): it is the rank stuck in the
    user's code, and torchrun's SIGTERM after a peer's exit ends it before any exit path of
    ours runs (the in-code watchdog takes no signal), which left its root-cause block with
    "Signal 15" instead of the verdict."""
    _STATE["verdict"], _STATE["at"] = verdict, time.time()
    code = int(getattr(verdict, "exit_code", 0) or 0)
    rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else -1
    if _STATE.get("early", True) and code and rank in (getattr(verdict, "blamed", None) or []):
        write_error_file(code, rank)


def write_early(on: bool) -> None:
    """Whether a blamed rank writes its error file when the verdict comes (`remember`), not only
    when it leaves: off where a verdict does not end the run (the watchdog's action 'report')."""
    _STATE["early"] = on


def remembered() -> Verdict | None:
    return _STATE["verdict"]


def write_error_file(code: int, rank: int | None = None) -> bool:
    """Write the remembered verdict to torchrun's error file of this rank, once, when this
    process leaves with a failing `code`. Best effort: False when there is nothing to write
    or it cannot be written (the process is leaving; it must not fail for this)."""
    verdict = _STATE["verdict"]
    path = os.environ.get(ERROR_FILE_ENV)
    if rank is None:
        rank = int(os.environ.get("RANK", "-1")) if os.environ.get("RANK", "").isdigit() else -1
    if not path or code == 0 or verdict is None or _STATE["written"]:
        return False
    if getattr(verdict, "excused", None) or int(getattr(verdict, "exit_code", 0) or 0) == 0:
        return False
    blamed = list(getattr(verdict, "blamed", []) or [])
    summary = str(getattr(verdict, "summary", "") or "").strip() or f"the check failed (exit {code})"
    text = f"distdiag: {summary}" if rank in blamed or not blamed else f"distdiag ended this rank: {summary}"
    report = str(getattr(verdict, "report", "") or "")
    if report.startswith("/"):
        text += f"\nreport: {report}"
    # the blamed first; the ranks it ended after it, also after a blamed rank that died without
    # writing a file (torchrun dates that one when it collects the failures, after the verdict)
    stamp = int(_STATE["at"]) + (0 if not blamed else -BLAME_LEAD_S if rank in blamed else BLAME_LEAD_S)
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(stamp)}}}
    try:
        tmp = f"{path}.distdiag.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)
    except OSError:
        return False
    _STATE["written"] = True
    return True
