"""What the trainer-integration tests share: run a worker on real gloo ranks, read what it wrote."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from distdiag.report.model import read_report
from tests.harness import RunResult, run_ranks

HARD_TIMEOUT = 150.0
"""A rank imports transformers or lightning (seconds each on 2 shared cores), then trains."""


def run_worker(entry: str, tmp_path: Path, *words: str, world: int = 2) -> RunResult:
    return run_ranks(world, [str(tmp_path), *words], tmp_path, entry=entry, timeout=HARD_TIMEOUT)


def results(result: RunResult, world: int = 2) -> list[dict]:
    assert not result.timed_out and result.codes == [0] * world, (result.codes, result.stderr[-4000:])
    return [json.loads((result.workdir / f"result{r}.json").read_text()) for r in range(world)]


def above_info(findings: list[dict]) -> list[str]:
    return [f"{f['severity']}: {f['issue']}" for f in findings if f["severity"] != "info"]


def assert_healthy_twin(result: RunResult, dump_dir: Path) -> list[dict]:
    """Every rank ends 0, trains to the same losses as without distdiag, finds nothing above info."""
    per_rank = results(result)
    for r, res in enumerate(per_rank):
        assert res["losses"] and res["losses"] == res["plain_losses"], (r, res["losses"], res["plain_losses"])
        assert above_info(res["findings"]) == [], (r, res["findings"])
    assert not dump_dir.exists(), "a healthy run wrote a hang report"
    return per_rank


def hang_report(result: RunResult, dump_dir: Path):
    """The job ended on its own (no rank outlived the test's deadline) with a hang report."""
    assert not result.timed_out, result.stderr[-4000:]
    assert any(code not in (0, None) for code in result.codes), (result.codes, result.stderr[-4000:])
    report = read_report(dump_dir / "hang-report.json")
    crit = [f for f in report.probe("watchdog").findings if f.severity == "critical"]
    assert crit, report.probe("watchdog").findings
    return report, crit


def assert_names_short_rank(crit: list, short: int) -> None:
    """Uneven batches: the critical finding names the rank that ran out of data, and the fix
    says how to even the data out."""
    assert crit[0].ranks == [short], crit[0]
    assert "DistributedSampler" in crit[0].fix and "Join" in crit[0].fix, crit[0]


def nan_findings(per_rank: list[dict], module: str, rank: int, step: int) -> None:
    """The monitor names the module, the rank and the first step; every rank holds the same findings."""
    issues = [f["issue"] for f in per_rank[0]["findings"]]
    assert f"loss became non-finite at step {step} on rank(s) {rank}" in issues, issues
    trace = [i for i in issues if "first non-finite value" in i]
    assert len(trace) == 1 and f"on rank {rank} appeared in its forward: module {module!r}" in trace[0], issues
    assert [f["issue"] for f in per_rank[1]["findings"]] == issues


def worker_main(argv: list[str], words: dict[str, str], train: Callable[..., dict]) -> int:
    """A rank of a trainer worker: WORKDIR then key=value words over `words`; trains (twice
    with twin=1: without distdiag first), writes result{rank}.json in WORKDIR."""
    import torch
    import torch.distributed as dist

    w = dict(words)
    w.update(word.split("=", 1) for word in argv[1:])
    workdir = argv[0]
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    result: dict = {}
    if w["twin"] == "1":
        result["plain_losses"] = train(w, workdir, with_distdiag=False)["losses"]
    result.update(train(w, workdir, with_distdiag=True))
    with open(os.path.join(workdir, f"result{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
