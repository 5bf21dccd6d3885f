"""torchrun's error file carries distdiag's verdict, in the format torch's own ErrorHandler writes."""

from __future__ import annotations

import json

import pytest

from distdiag.hang.records import Verdict
from distdiag.report.model import Finding, ProbeResult, Report
from distdiag.runtime import lastword


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(lastword, "_STATE", {"verdict": None, "at": 0.0, "written": False})


def test_blamed_ranks_are_those_of_the_most_severe_finding():
    """The critical finding's ranks win over an error's; a finding of the whole job blames nobody."""
    probe = ProbeResult.from_findings("watchdog", [Finding("error", "slow", ranks=[2]), Finding("info", "waits", ranks=[0]),
                                                   Finding("critical", "rank 1 never entered", ranks=[1])])
    assert lastword.blamed_ranks(Report(world_size=3, probes=[probe])) == [1]
    whole = ProbeResult.from_findings("env", [Finding("error", "versions differ")])
    assert lastword.blamed_ranks(Report(world_size=3, probes=[whole])) == []


def test_error_file_is_torchs_format_and_the_culprit_dates_first(tmp_path, monkeypatch):
    """The blamed rank's file is dated earlier than a waiter's; torch's ProcessFailure reads both."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    verdict = Verdict(3, 0, "h", summary="rank 1 never entered all_reduce #7", report="/r/hang-report.json", blamed=[1])
    assert Verdict.from_dict(json.loads(json.dumps(verdict.to_dict()))).blamed == [1]
    failures = {}
    for rank in (0, 1):
        path = tmp_path / f"{rank}.json"
        monkeypatch.setenv(lastword.ERROR_FILE_ENV, str(path))
        monkeypatch.setattr(lastword, "_STATE", {"verdict": None, "at": 0.0, "written": False})
        lastword.remember(verdict)
        assert lastword.write_error_file(3, rank)
        failures[rank] = ProcessFailure(local_rank=rank, pid=1, exitcode=3, error_file=str(path))
    assert min(failures, key=lambda r: failures[r].timestamp) == 1
    shown = failures[1].message["extraInfo"]["py_callstack"]
    assert shown.startswith("distdiag: rank 1 never entered all_reduce #7") and "report: /r/hang-report.json" in shown
    assert failures[0].message["message"].startswith("distdiag ended this rank: rank 1 never entered")


def test_nothing_is_written_for_a_pass_an_excuse_or_outside_torchrun(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    lastword.remember(Verdict(3, 0, summary="x", blamed=[0]))
    monkeypatch.delenv(lastword.ERROR_FILE_ENV, raising=False)
    assert not lastword.write_error_file(3, 0)  # not under torchrun
    monkeypatch.setenv(lastword.ERROR_FILE_ENV, str(path))
    assert not lastword.write_error_file(0, 0)  # leaving with 0
    lastword.remember(Verdict(0, 0, summary="all passed"))
    assert not lastword.write_error_file(3, 0)  # a passing verdict
    lastword.remember(Verdict(3, 0, summary="x", excused="it moved"))
    assert not lastword.write_error_file(3, 0)
    assert not path.exists()


def test_the_blamed_rank_writes_its_file_when_the_verdict_comes(tmp_path, monkeypatch):
    """The culprit is stuck in the user's code; torchrun SIGTERMs it once a peer leaves, before any
    exit path of ours: its file is written as the verdict arrives. Not for a peer it only ended,
    nor where a verdict ends no run (the watchdog's action 'report')."""
    verdict = Verdict(3, 0, "h", summary="rank 1 never entered all_reduce #7", blamed=[1])
    for rank, early, written in ((1, True, True), (0, True, False), (1, False, False)):
        path = tmp_path / f"{rank}-{early}.json"
        monkeypatch.setenv(lastword.ERROR_FILE_ENV, str(path))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(lastword, "_STATE", {"verdict": None, "at": 0.0, "written": False})
        lastword.write_early(early)
        lastword.remember(verdict)
        assert path.exists() == written, (rank, early)
        if written:
            assert "distdiag: rank 1 never entered all_reduce #7" in path.read_text()
            assert not lastword.write_error_file(3, rank)  # once
