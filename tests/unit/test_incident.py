"""The typed incident (distdiag/hang/records.py), its store keys (distdiag/runtime/keys.py) and
the protocol both the check and the watchdog run (distdiag/runtime/incident.py), on a real
TCPStore served in this process (issue 22 item 7, issue 21 item 1)."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from distdiag.hang.records import (
    EventKind,
    IncidentEvent,
    RankSnapshot,
    Silence,
    SilentReason,
    Verdict,
)
from distdiag.runtime import snapwire
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.incident import (
    Incident,
    StoreValueTooLarge,
    checked_value,
    compact_snapshot,
    silent_rank_reasons,
)
from distdiag.runtime.keys import MAX_STORE_VALUE, IncidentKeys, Keys
from tests.unit.test_exchange_scale import Counting

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def server():
    """A TCPStore server in this process, as torchrun's agent hosts one."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timedelta(seconds=10))
    yield store


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


# -- the typed record ----------------------------------------------------------------------


def test_a_watchdog_snapshot_reads_back_as_it_was_posted():
    """Progress.snapshot (the watchdog's) through RankSnapshot and back: the same JSON."""
    from distdiag.watchdog.progress import Progress

    progress = Progress(history=16)
    progress.enter_phase("checkpoint", 15.0)
    posted = {**progress.snapshot(16), "rank": 2, "host": "node-a", "pid": 1234,
              "event": {"kind": "timeout", "detail": "no progress for 5s", "rank": 0}, "importing": False}
    snap = RankSnapshot.from_dict(json.loads(json.dumps(posted)))
    assert snap.rank == 2 and snap.phases[0].name == "checkpoint" and not snap.phases[0].over_budget
    assert snap.event is not None and snap.event.kind is EventKind.TIMEOUT
    assert json.loads(json.dumps(snap.to_dict())) == json.loads(json.dumps(posted))


def test_a_check_snapshot_reads_back_as_it_was_posted():
    """Tracker.snapshot (the check's) with its reason under `reason`, as the sentinel posts it."""
    from distdiag.runtime.tracker import Tracker

    tracker = Tracker()
    posted = {**tracker.snapshot(), "rank": 0, "host": "h", "pid": 7,
              "reason": {"kind": "deadline", "detail": "the whole check exceeded --deadline-s", "rank": 0}}
    snap = RankSnapshot.from_dict(json.loads(json.dumps(posted)))
    assert snap.event_key == "reason" and snap.event is not None and snap.event.kind is EventKind.DEADLINE
    assert snap.to_dict() == json.loads(json.dumps(posted))


def test_unknown_fields_and_kinds_from_another_version_are_kept():
    """A newer rank's snapshot: fields this version does not know ride along; an unknown event
    kind reads as OTHER and is written back as it came."""
    posted = {"rank": 1, "phase": "training", "stack": [], "future_field": {"x": 1},
              "engine": {"state": "ok", "groups": [{"group": "world", "enqueued": 3, "completed": 2, "peer": 5}],
                         "new_engine_field": True},
              "event": {"kind": "quantum_hang", "detail": "?", "rank": 3}}
    snap = RankSnapshot.from_dict(posted)
    assert snap.event is not None and snap.event.kind is EventKind.OTHER
    assert snap.engine is not None and snap.engine.groups[0].inside
    assert snap.to_dict() == posted
    old = RankSnapshot.from_dict({"rank": 4})  # an older, sparser snapshot: defaults, no error
    assert old.phases == [] and old.engine is None and old.to_dict() == {"rank": 4, "stack": []}


def test_a_silent_rank_is_its_line_and_its_reason():
    why = Silence(SilentReason.STOPPED, "its process (pid 9) is stopped (SIGSTOP or a debugger)")
    assert why == "its process (pid 9) is stopped (SIGSTOP or a debugger)" and why.reason.definite
    assert copy.deepcopy(why).reason is SilentReason.STOPPED
    noted = why.noted("; more")
    assert noted.endswith("; more") and noted.reason is SilentReason.STOPPED
    assert Silence.reason_of("a plain line") is None
    (never,) = silent_rank_reasons([3], {}, "h").values()
    assert never.reason is SilentReason.NEVER_CHECKED_IN and never.reason.cause == "never_checked_in"


def test_the_verdict_is_small_whatever_the_summary():
    v = Verdict(3, 5, "node-a", 1, "hang", "x" * 100_000, "/tmp/hang-report.json", chunks=200)
    text = json.dumps(v.to_dict())
    assert len(text) < 1024
    back = Verdict.from_dict(json.loads(text))
    assert (back.exit_code, back.writer, back.chunks, back.outcome) == (3, 5, 200, "hang")
    event = IncidentEvent(EventKind.DESYNC, {"group": "world", "step": 3}, 1)
    assert IncidentEvent.from_dict(event.to_dict()) == event


# -- the keys ------------------------------------------------------------------------------


def test_the_incident_keys_are_the_ones_reports_and_older_ranks_use():
    check, watchdog = IncidentKeys(), IncidentKeys(3)
    assert (check.snap, check.writer, check.verdict, check.report) == ("snap", "writer", "verdict", "report")
    assert (watchdog.snap, watchdog.writer, watchdog.verdict, watchdog.again(1)) == ("snap/3", "writer/3", "verdict/3", "again/3/1")
    assert Keys.event(2) == "event/2" and Keys.heartbeat(0) == "hb/0"
    names = [watchdog.snap, watchdog.writer, watchdog.verdict, watchdog.progress, watchdog.stage, watchdog.report,
             watchdog.report_chunk(0), Keys.INFO, Keys.ERROR, Keys.FINAL, Keys.ABORT_REASON]
    assert len(set(names)) == len(names)


OWNED = ["distdiag/runtime/sentinel.py", "distdiag/runtime/incident.py", "distdiag/check/finish.py",
         "distdiag/watchdog/watcher.py", "distdiag/watchdog/writer.py", "distdiag/watchdog/core.py",
         "distdiag/watchdog/phases.py", "distdiag/watchdog/marks.py", "distdiag/watchdog/stall.py", "distdiag/check/run.py"]


@pytest.mark.parametrize("path", OWNED)
def test_no_store_key_is_spelled_outside_the_keys_module(path):
    """The incident's files name keys through distdiag/runtime/keys.py, never as literals."""
    text = (ROOT / path).read_text()
    calls = re.findall(r"\b(?:store|ex|exchange)\.(?:post|collect|publish|read|claim|count|present|wait_count|wait_read|"
                       r"bump|check|set|get|compare_set|add|multi_get)\(\s*\[?f?[\"'][a-z_]", text)
    assert calls == []


# -- the protocol on a real store ----------------------------------------------------------


def test_nothing_over_the_limit_reaches_the_store():
    with pytest.raises(StoreValueTooLarge, match="over distdiag's limit of 65536"):
        checked_value("verdict", "x" * (MAX_STORE_VALUE + 1))


def test_a_huge_snapshot_is_cut_to_the_limit_and_says_what_it_dropped():
    """Frames that do not compress (each one different) past the limit: the deepest go, and the
    snapshot says so; the long history goes under its own key, whole."""
    import random

    rng = random.Random(1)
    stack = [f"/train.py:{i} in f_{rng.getrandbits(64):x}: x = {rng.getrandbits(128):x}" for i in range(4000)]
    snap = RankSnapshot(rank=0, phase="training", stack=stack,
                        extra={"history": [{"op": "all_reduce", "seq": i, "site": "a" * 100} for i in range(5000)]})
    core, hist = compact_snapshot(snap)
    assert len(core) <= MAX_STORE_VALUE
    back = snapwire.decode(core)
    assert back["trimmed"] == ["stack"] and "history" not in back and back["stack"][-1] == stack[-1]
    assert len(snapwire.decode(hist)["history"]) == 5000


def test_an_oversize_report_goes_out_verdict_first_in_chunks(server):
    """A 1,024-rank-sized report (2.5 MB): the verdict is small and first, the report comes in
    chunks under the limit, and another host's reader puts it back together."""
    writer = Incident(Exchange(_client(server), 0, 4), IncidentKeys(1), 4)
    report = json.dumps({"ranks": [{"rank": r, "where": "x" * 2400} for r in range(1024)]})
    assert len(report) > 2_000_000
    assert writer.publish_verdict(Verdict(3, 0, "node-a", outcome="hang", chunks=writer.chunk_count(report)))
    reader = Incident(Exchange(_client(server), 3, 4), IncidentKeys(1), 4)
    verdict, _ = reader.wait_verdict(5.0)
    assert verdict is not None and verdict.exit_code == 3 and verdict.chunks == writer.chunk_count(report)
    assert writer.publish_report(report, {"host": "node-a"}) == verdict.chunks > 1
    sizes = [len(server.get(IncidentKeys(1).report_chunk(i))) for i in range(verdict.chunks)]
    assert max(sizes) <= MAX_STORE_VALUE and len(server.get("verdict/1")) < 1024
    text, meta = reader.wait_report(5.0)
    assert text == report and meta["host"] == "node-a"


def test_a_writer_whose_store_connection_broke_still_publishes_the_verdict(server):
    """The failure issue 21 saw: a write over TCPStore's 8 MiB limit resets the writer's
    connection. The verdict goes out on a new client all the same."""
    broken = _client(server)
    with pytest.raises(Exception):  # noqa: B017 - torch raises DistNetworkError (version-dependent type)
        broken.set("too_big", b"x" * (9 * 1024 * 1024))
    writer = Incident(Exchange(broken, 0, 2), IncidentKeys(), 2, store_factory=lambda: _client(server))
    assert writer.publish_verdict(Verdict(3, 0, "h", outcome="hang"))
    assert json.loads(server.get("verdict"))["exit_code"] == 3
    assert writer.publish_report("{}", {"host": "h"}) == 1


def test_a_waiter_waits_while_the_writer_moves_and_leaves_when_it_stalls(server):
    """The wait follows the writer's progress: a writer slower than the stall limit in total
    but moving is waited for; one that stops moving ends the wait with a line saying where."""
    keys = IncidentKeys(7)
    writer = Incident(Exchange(_client(server), 0, 2), keys, 2)
    waiter = Incident(Exchange(_client(server), 1, 2), keys, 2)

    def slow_writer() -> None:
        for k in range(8):
            writer.advance(f"gathered {k} of 2 snapshots")
            time.sleep(0.1)
        writer.publish_verdict(Verdict(3, 0, "h", outcome="hang"))

    thread = threading.Thread(target=slow_writer, daemon=True)
    thread.start()
    verdict, why = waiter.wait_verdict(0.5)
    thread.join(10)
    assert verdict is not None and why == ""

    stalled = Incident(Exchange(_client(server), 1, 2), IncidentKeys(8), 2)
    Incident(Exchange(_client(server), 0, 2), IncidentKeys(8), 2).advance("analysing")
    verdict, why = stalled.wait_verdict(0.3)
    assert verdict is None and why == "the writer made no progress for 0.3s (last at: analysing)"


def test_a_waiter_of_a_16k_rank_job_costs_the_store_one_request_a_poll(server):
    """16k ranks wait for one verdict: each polls the writer's progress alone, every
    N / 25,000 s (0.66 s), and reads the verdict only once the progress moved (issue 21 item 3:
    three requests every 50 ms each were a million requests a second)."""
    world = 16384
    keys = IncidentKeys(11)
    writer = Incident(Exchange(_client(server), 0, world), keys, world)
    counted = Counting(_client(server))
    waiter = Incident(Exchange(counted, 5, world), keys, world)
    writer.advance("analysing")
    timer = threading.Timer(2.0, lambda: writer.publish_verdict(Verdict(3, 0, "h", outcome="hang")))
    timer.start()
    verdict, why = waiter.wait_verdict(30.0, stop=lambda: False)
    timer.join()
    assert verdict is not None and verdict.exit_code == 3, why
    polls = len(counted.calls) - 3  # the verdict read as the progress moved: a check at first, a check and a get after
    assert 3 <= polls <= 6, counted.calls


def test_a_waiter_reads_the_verdict_on_news_not_at_every_stage(server):
    """The writer's stages and heartbeats keep a waiter waiting without sending it to read the
    verdict (16k ranks x 2 requests a stage); the verdict's news does: read at the first poll
    and once it is out."""
    keys = IncidentKeys(13)
    writer = Incident(Exchange(_client(server), 0, 2), keys, 2)
    counted = Counting(_client(server))
    waiter = Incident(Exchange(counted, 1, 2), keys, 2)
    stops: list[bool] = []

    def write() -> None:
        for k in range(10):
            writer.advance(f"stage {k}")
            time.sleep(0.06)
        writer.publish_verdict(Verdict(3, 0, "h"))

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    verdict, why = waiter.wait_verdict(5.0, poll_s=0.02, stop=lambda: stops.append(True) or False)
    thread.join(10)
    assert verdict is not None, why
    assert len(stops) == 1, counted.calls  # at the first poll only: no stage was news
    assert counted.count("add") >= 10  # it did see the stages go by


def test_a_rank_asked_to_read_again_sees_it_though_it_polls_only_the_progress(server):
    """The writer asks again and then moves its progress: the waiter's `stop()` runs then."""
    keys = IncidentKeys(12)
    writer = Incident(Exchange(_client(server), 0, 2), keys, 2)
    waiter = Incident(Exchange(_client(server), 1, 2), keys, 2)
    writer.advance("gathered 2 of 2 snapshots")
    asked: list[bool] = []

    def stop() -> bool:
        if server.check([keys.again(1)]):
            asked.append(True)
            writer.publish_verdict(Verdict(3, 0, "h"))
        return False

    threading.Timer(0.3, lambda: writer.ask_again([1])).start()
    verdict, _ = waiter.wait_verdict(5.0, stop=stop)
    assert asked and verdict is not None


def test_a_long_analysis_keeps_the_writer_moving(server):
    """Inside `moving` (the analysis) the writer's progress moves by itself: a waiter with a
    stall limit shorter than the stage still gets the verdict."""
    keys = IncidentKeys(9)
    writer = Incident(Exchange(_client(server), 0, 2), keys, 2)
    waiter = Incident(Exchange(_client(server), 1, 2), keys, 2)

    def analyse() -> None:
        with writer.moving("analysing 2 snapshot(s)", every_s=0.05):
            time.sleep(1.0)
        writer.publish_verdict(Verdict(3, 0, "h"))

    thread = threading.Thread(target=analyse, daemon=True)
    thread.start()
    verdict, why = waiter.wait_verdict(0.5)
    thread.join(10)
    assert verdict is not None, why


def test_the_checks_report_reaches_another_node_verdict_first_in_chunks(server, tmp_path, monkeypatch, capsys):
    """The check's writer on node 0 emits a report larger than one store value; local rank 0
    of node 1 reads the small verdict, then the chunks, and writes the same report there."""
    from distdiag.check.config import CheckConfig
    from distdiag.check.finish import RunEnd
    from distdiag.launcher.ranks import VERDICT_NOTE_ENV
    from distdiag.report.model import Finding, ProbeResult, Report
    from distdiag.report.render import ProgressLine
    from distdiag.runtime.context import LaunchInfo

    monkeypatch.setenv(VERDICT_NOTE_ENV, str(tmp_path / "verdict.json"))

    def end(node: int, rank: int) -> RunEnd:
        run = RunEnd.__new__(RunEnd)
        run.config = CheckConfig(report=str(tmp_path / f"node{node}" / "report.json"), quiet=True)
        run.info = LaunchInfo(rank, 2, 0, 1, node, "vm", 4000 + rank, 0, "r", "127.0.0.1", server.port, True)
        run.progress = ProgressLine(None)
        run.sentinel = None
        return run

    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    findings = [Finding(severity="error", issue=f"finding {i}", evidence="e" * 2000) for i in range(100)]
    report = Report(world_size=2, probes=[ProbeResult.from_findings("collectives", findings)], exit_code=1,
                    verdict="fail", outcome="completed", summary="finding 0")
    end(0, 0).emit(report, Exchange(_client(server), 0, 2))
    verdict = json.loads(server.get("verdict"))
    assert verdict["exit_code"] == 1 and verdict["chunks"] > 1 and len(json.dumps(verdict)) < 1024
    end(1, 1).mirror(Exchange(_client(server), 1, 2), Verdict.from_dict(verdict))
    mirrored = json.loads((tmp_path / "node1" / "report.json").read_text())
    assert mirrored["summary"] == "finding 0" and len(mirrored["probes"][0]["findings"]) == 100


def test_a_report_too_large_to_copy_whole_leaves_its_details_on_the_writers_host(server):
    """Past SHARED_REPORT_MAX the other hosts' copy keeps the findings and says where the full
    report is (each host reading the full one would move N/8 x the report through the store)."""
    from distdiag.runtime.incident import SHARED_REPORT_MAX

    writer = Incident(Exchange(_client(server), 0, 2), IncidentKeys(11), 2)
    small = json.dumps({"summary": "s", "probes": [{"name": "watchdog", "findings": [], "details": {"t": 1}}]})
    assert writer.shared_copy(small, "/r.json", "node-a") == small
    big = json.dumps({"summary": "s", "probes": [{"name": "watchdog", "findings": [{"issue": "rank 3 is stuck"}],
                                                  "details": {"stacks": "x" * SHARED_REPORT_MAX}}]})
    copy_ = json.loads(writer.shared_copy(big, "/r.json", "node-a"))
    assert copy_["probes"][0]["findings"] == [{"issue": "rank 3 is stuck"}]
    assert copy_["probes"][0]["details"]["note"].endswith("the full report is on host node-a at /r.json")


def test_a_snapshot_too_big_even_without_its_history_keeps_who_and_where():
    """Thousands of groups of members in no order (no run to write them as): the last resort
    keeps rank, phase, event and the innermost frames, and says the recorder's view was left out."""
    import random

    from distdiag.hang.records import EngineView, GroupPosition

    rng = random.Random(2)
    groups = [GroupPosition(f"ranks[{','.join(map(str, sorted(rng.sample(range(16384), 256))))}]", 3, 2) for _ in range(256)]
    snap = RankSnapshot(rank=5, phase="training", stack=["/train.py:9 in main: step()"],
                        engine=EngineView("ok", groups), event=IncidentEvent(EventKind.TIMEOUT, "x", 0))
    back = snapwire.decode(compact_snapshot(snap)[0])
    assert back["rank"] == 5 and back["event"]["kind"] == "timeout" and "engine" not in back
    assert back["stack"] == ["/train.py:9 in main: step()"] and "engine" in back["trimmed"]


def test_the_hang_analysis_names_none_of_the_checks_files():
    """hang/ reads the typed incident; it knows neither the check's runner nor its sentinel."""
    named = [f"{p.name}: {word}" for p in sorted((ROOT / "distdiag" / "hang").glob("*.py"))
             for word in ("distdiag/check", "check/run.py", "finish.py", "sentinel", "forked_rank")
             if word in p.read_text()]
    assert named == []


def test_the_check_and_the_watchdog_mirror_to_the_same_nodes(server, tmp_path, monkeypatch):
    """Two torchrun agents on one machine are two nodes sharing a hostname: the check and the
    watchdog both keep a copy on the other node (they used to disagree: the watchdog went by
    hostname and left that node without one), stamped with that node's launch id; neither
    writes over the writer's own file, nor keeps a copy on the writer's node."""
    from types import SimpleNamespace

    from distdiag.check.config import CheckConfig
    from distdiag.check.finish import RunEnd
    from distdiag.launcher.ranks import VERDICT_NOTE_ENV
    from distdiag.report.model import Report
    from distdiag.report.render import ProgressLine
    from distdiag.runtime.context import LaunchInfo
    from distdiag.runtime.incident import Seat
    from distdiag.runtime.launchid import LAUNCH_ID_ENV
    from distdiag.watchdog import watcher as watcher_module

    monkeypatch.setenv(VERDICT_NOTE_ENV, str(tmp_path / "verdict.json"))
    monkeypatch.setenv(LAUNCH_ID_ENV, "node-1-launch")
    for name in ("writer", "check", "watchdog", "same-node"):
        (tmp_path / name).mkdir()
    report = Report(world_size=4, exit_code=3, verdict="fail", outcome="hang", summary="rank 2 is stuck")
    for keys in (IncidentKeys(), IncidentKeys(3)):  # the check's incident, the watchdog's event #3
        writer = Incident(Exchange(_client(server), 0, 4), keys, 4, seat=Seat("vm", 0, 0, 2))
        text, where, _why = writer.write(report, str(tmp_path / "writer" / "report.json"))
        assert where is not None
        verdict = writer.publish(report, text, where)
        assert (verdict.host, verdict.node) == ("vm", 0) and verdict.chunks == 1

    def info(node: int, rank: int) -> LaunchInfo:
        return LaunchInfo(rank, 4, 0, 2, node, "vm", 4000 + rank, 0, "r", "127.0.0.1", server.port, True)

    run = RunEnd.__new__(RunEnd)
    run.config = CheckConfig(report=str(tmp_path / "check" / "report.json"), quiet=True)
    run.info, run.progress, run.sentinel = info(1, 2), ProgressLine(None), None
    run.mirror(Exchange(_client(server), 2, 4), verdict)  # the check reads the bare keys: same verdict there
    watchdog = SimpleNamespace(info=info(1, 2), world=4, store_factory=None, ex=Exchange(_client(server), 2, 4),
                               config=SimpleNamespace(dump_dir=str(tmp_path / "watchdog")))
    watcher_module._keep_copy(watchdog, watcher_module._incident(watchdog, 3), verdict)
    for copy_path in (tmp_path / "check" / "report.json", tmp_path / "watchdog" / watcher_module.REPORT_NAME):
        copy_ = json.loads(copy_path.read_text())
        assert copy_["summary"] == "rank 2 is stuck" and copy_["launch_id"] == "node-1-launch"

    same_node = SimpleNamespace(**{**vars(watchdog), "info": info(0, 0),
                                   "config": SimpleNamespace(dump_dir=str(tmp_path / "same-node"))})
    watcher_module._keep_copy(same_node, watcher_module._incident(same_node, 3), verdict)
    assert not (tmp_path / "same-node" / watcher_module.REPORT_NAME).exists()
    own_file = Incident(Exchange(_client(server), 2, 4), IncidentKeys(3), 4, seat=Seat("vm", 1, 0, 2))
    assert own_file.mirror(verdict, str(tmp_path / "writer" / "report.json")) is None
